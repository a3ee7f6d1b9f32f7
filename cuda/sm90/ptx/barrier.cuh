// Named barriers and register reconfiguration (sm_90a).
//
// bar.sync id, n: waits until n threads (a multiple of 32, counted per warp)
// have arrived at barrier id; bar.arrive id, n: counts this warp without
// waiting. Barrier 0 is __syncthreads(); the kernels use ids from 1 (see
// fwd_kernel.cuh for the assignment). A producer/consumer pair of named
// barriers is how one warpgroup hands the tensor cores to the next.
//
// setmaxnreg: a warpgroup-wide (.sync.aligned) change of the per-thread
// register budget; the kernel needs a register cap at entry
// (__launch_bounds__(threads, 1)), and each role must be one branch.
#pragma once

#include "common.cuh"

namespace jax_flash::sm90::ptx {

JF_DEVICE void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
JF_DEVICE void named_bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

template <int kRegs>
JF_DEVICE void setmaxnreg_inc() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
JF_DEVICE void setmaxnreg_dec() {
  static_assert(kRegs % 8 == 0 && kRegs >= 24 && kRegs <= 256, "setmaxnreg range");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace jax_flash::sm90::ptx
