// What compute-sanitizer racecheck makes of the two hand-off patterns the sm90
// kernels use between a producer warp and consumer warps through plain
// shared-memory stores (not TMA):
//   mbarrier  st.shared -> mbarrier.arrive (release)  | mbarrier.try_wait (acquire) -> ld.shared
//             (sm90 backward: LSE / delta rows written by the producer warp)
//   named     st.shared -> bar.arrive                 | bar.sync -> ld.shared
//             (sm90 forward, dynamic scheduler: the next tile index)
//   racy      st.shared and ld.shared with no ordering (control: racecheck must flag it)
// Both synchronised patterns are ordered by the PTX memory model (mbarrier
// arrive/try_wait default to .release/.acquire at CTA scope; bar.arrive /
// bar.sync order the memory accesses of the participating threads). Run:
//   compute-sanitizer --tool racecheck build_carry/racecheck_probe mbarrier|named|racy
// The program itself checks the values the consumer read (exit 1 on a mismatch).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "sm90/ptx/barrier.cuh"
#include "sm90/ptx/common.cuh"
#include "sm90/ptx/mbarrier.cuh"
#include "sm90/ptx/smem_ops.cuh"

using namespace jax_flash::sm90::ptx;

constexpr int kIters = 16, kStages = 2;

// Warp 0 produces, warp 1 consumes; out[lane] = sum over iterations.
__global__ void probe(int mode, float* out) {
  __shared__ float ring[kStages][32];
  __shared__ alignas(8) uint64_t full[kStages], empty[kStages];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0)
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_u32(&full[s]), 32);
      mbar_init(smem_u32(&empty[s]), 32);
    }
  mbar_fence_init();
  __syncthreads();
  float acc = 0.f;
  PipeState<kStages> st;
  for (int it = 0; it < kIters; ++it) {
    const uint32_t slot = smem_u32(&ring[st.index][lane]);
    if (mode == 0) {  // mbarrier ring
      if (warp == 0) {
        mbar_wait(smem_u32(&empty[st.index]), st.phase ^ 1u);
        st_shared_f32(slot, float(it * 32 + lane));
        mbar_arrive(smem_u32(&full[st.index]));
      } else {
        mbar_wait(smem_u32(&full[st.index]), st.phase);
        acc += ld_shared_f32(slot);
        mbar_arrive(smem_u32(&empty[st.index]));
      }
    } else if (mode == 1) {  // named barriers 1 (full) / 2 (empty), one slot in use
      if (warp == 0) {
        if (it > 0) named_bar_sync(2, 64);
        st_shared_f32(slot, float(it * 32 + lane));
        named_bar_arrive(1, 64);
      } else {
        named_bar_sync(1, 64);
        acc += ld_shared_f32(slot);
        named_bar_arrive(2, 64);
      }
    } else {  // racy: no ordering at all
      if (warp == 0)
        st_shared_f32(slot, float(it * 32 + lane));
      else
        acc += ld_shared_f32(slot);
    }
    st.advance();
  }
  if (mode == 1 && warp == 0) named_bar_sync(2, 64);  // the consumer's last release
  __syncthreads();
  if (warp == 1) out[lane] = acc;
}

int main(int argc, char** argv) {
  const char* name = argc > 1 ? argv[1] : "mbarrier";
  const int mode = !std::strcmp(name, "mbarrier") ? 0 : !std::strcmp(name, "named") ? 1 : 2;
  float* d_out = nullptr;
  cudaMalloc(&d_out, 32 * sizeof(float));
  probe<<<1, 64>>>(mode, d_out);
  float out[32];
  const cudaError_t err = cudaMemcpy(out, d_out, sizeof(out), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    std::printf("%s: CUDA error %s\n", name, cudaGetErrorString(err));
    return 1;
  }
  int bad = 0;
  for (int lane = 0; lane < 32; ++lane) {
    float want = 0.f;
    for (int it = 0; it < kIters; ++it) want += float(it * 32 + lane);
    bad += out[lane] != want;
  }
  std::printf("%s: %s (%d/32 lanes wrong)\n", name, bad ? "values WRONG" : "values ok", bad);
  return mode < 2 && bad ? 1 : 0;  // the racy control may read anything
}
