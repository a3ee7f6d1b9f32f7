// Kernel arguments of the sm90 forward (one __grid_constant__ struct: the TMA
// descriptors must live in parameter/constant space) and the run-time view of
// the shared-memory plan.
#pragma once

#include <cuda.h>

#include "mask.cuh"
#include "ptx/common.cuh"
#include "scheduler.cuh"
#include "smem_layout.cuh"
#include "softmax.cuh"

namespace jax_flash::sm90 {

struct FwdKernelArgs {
  CUtensorMap tm_q;  // box {64, kBlockM, 1, 1}
  CUtensorMap tm_k;  // box {64, kBlockN, 1, 1}
  CUtensorMap tm_v;  // box {64, kBlockN, 1, 1}
  CUtensorMap tm_o;  // box {64, 64, 1, 1} (one consumer warpgroup's rows)
  MaskInfo mask;
  SoftmaxScale sm;
  TileScheduler sched;
  float* lse;        // [batch, heads, seqlen_q]
  int num_heads;
  int heads_per_kv;  // num_heads / num_heads_k
};

// Named barrier ids (0 is __syncthreads).
constexpr int kBarEpilogue = 1;   // + consumer WG index: the WG's own 128 threads
constexpr int kBarSched = 4;      // + consumer WG index: "this WG may issue its GEMMs"
constexpr int kBarOWrite = 13;    // all consumer WGs (kOInV): every WG is past its last PV

template <typename Cfg>
struct SmemPlan {
  uint32_t base;  // 1 KB-aligned shared-window address of the plan
  JF_DEVICE uint32_t q() const { return base + Cfg::kOffQ; }
  JF_DEVICE uint32_t k(int s) const { return base + Cfg::kOffK + s * Cfg::kKVBytes; }
  JF_DEVICE uint32_t v(int s) const { return base + Cfg::kOffV + s * Cfg::kKVBytes; }
  JF_DEVICE uint32_t o() const { return base + Cfg::kOffO; }
  JF_DEVICE uint32_t bar(int i) const { return base + Cfg::kOffBar + 8 * i; }
  JF_DEVICE uint32_t full_q() const { return bar(0); }
  JF_DEVICE uint32_t empty_q() const { return bar(1); }
  JF_DEVICE uint32_t full_k(int s) const { return bar(2 + s); }
  JF_DEVICE uint32_t empty_k(int s) const { return bar(2 + Cfg::kStages + s); }
  JF_DEVICE uint32_t full_v(int s) const { return bar(2 + 2 * Cfg::kStages + s); }
  JF_DEVICE uint32_t empty_v(int s) const { return bar(2 + 3 * Cfg::kStages + s); }
  JF_DEVICE uint32_t o_free() const { return bar(2 + 4 * Cfg::kStages); }
  // kFlagDynamic: the next tile index written to tile_slot() (producer) / read
  // by every consumer thread (mbarriers rather than named barriers: each
  // thread's own arrive orders its access, which racecheck can follow).
  JF_DEVICE uint32_t tile_full() const { return bar(3 + 4 * Cfg::kStages); }
  JF_DEVICE uint32_t tile_empty() const { return bar(4 + 4 * Cfg::kStages); }
  JF_DEVICE uint32_t tile_slot() const { return base + Cfg::kOffTile; }
};

}  // namespace jax_flash::sm90
