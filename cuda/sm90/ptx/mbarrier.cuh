// mbarrier (shared-memory transaction barrier) wrappers, PTX ISA 8.0 (sm_90).
//
// Phases. A barrier initialised with count c starts in phase 0; a phase
// completes when c arrivals have happened AND the transaction count (bytes
// announced with expect_tx, paid off by TMA complete_tx) is back to zero;
// the barrier then moves on to the next phase. try_wait.parity(P) returns
// true once the phase whose parity is P has completed, i.e. while the current
// phase's parity differs from P. Hence:
//   consumer of use k of a "full" barrier waits with parity k & 1;
//   producer that wants to refill slot s for use k waits on the "empty"
//   barrier with parity (k & 1) ^ 1: for k = 0 that is "phase -1", which a
//   fresh barrier reports as complete, so the first pass does not block.
#pragma once

#include "common.cuh"

namespace jax_flash::sm90::ptx {

JF_DEVICE void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the other threads and to the
// async proxy (TMA). Follow with a CTA barrier.
JF_DEVICE void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Plain arrival (one of the `count` expected).
JF_DEVICE void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Arrival that also announces `bytes` of incoming TMA transactions.
JF_DEVICE void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

// One probe (the hardware may suspend the thread for a while inside it).
JF_DEVICE bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}

// Blocks until the phase with parity `parity` has completed.
JF_DEVICE void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}

// Position in a ring of kStages slots: slot index and the parity of the
// current pass over the ring (flips each time the index wraps).
template <int kStages>
struct PipeState {
  int index = 0;
  uint32_t phase = 0;
  JF_DEVICE void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1u;
    }
  }
};

}  // namespace jax_flash::sm90::ptx
