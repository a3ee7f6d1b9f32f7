// Shared-memory plan and tile shapes of the sm90 forward.
//
// Every tile (Q, K, V, O) is kept in the layout that TMA writes with
// CU_TENSOR_MAP_SWIZZLE_128B and a box of 64 columns x `rows` rows, one box
// per 64-column block of the head dim:
//   [kHeadDim / 64][rows][64] 16-bit elements, 128 bytes per row, and within
//   each 1024-byte group of 8 rows the 16-byte chunk c of row r sits at chunk
//   c ^ (r % 8).
// This is also the canonical 128B-swizzle layout wgmma reads: K-major for Q
// (A) and K (B of S = Q K^T), MN-major for V (B of O = P V, N = head dim
// contiguous). See ptx/wgmma.cuh for the descriptors.
//
// Tile shapes follow FA3 (hopper/tile_size.h, bf16/fp16, hdim = hdim_v):
//   hdim  64: 192 x 128 (3 consumer warpgroups, FA3 uses 192 x 128 when causal
//             and 192 x 192 otherwise; 128 keeps one kernel per head dim)
//   hdim 128: 128 x 128 (2 consumer warpgroups; FA3: 128 x 128 causal,
//             128 x 176 otherwise)
//   hdim 256: 128 x  80 (2 consumer warpgroups, as FA3; 224 KB of smem)
// Each consumer warpgroup owns 64 consecutive query rows of the CTA's Q tile
// (wgmma's M = 64) and all of them share the K/V stages: the Q tile is
// kBlockM = 64 * kConsumerWGs rows. Two stages of K and V, as FA3.
#pragma once

#include <cstdint>

namespace jax_flash::sm90 {

// Byte offset of element (r, c) in a [cols/64][kRows][64] 128B-swizzled tile
// of 16-bit elements.
template <int kRows>
__host__ __device__ constexpr uint32_t sw128_offset(int r, int c) {
  return uint32_t((c / 64) * kRows * 128 + r * 128 + ((((c % 64) / 8) ^ (r % 8)) * 16) +
                  (c % 8) * 2);
}

// Forward variant bits (template parameter kFlags of the kernel).
enum : int {
  kFlagPingpong = 1,  // named-barrier hand-off of the tensor cores between consumer WGs
  kFlagOverlap = 2,   // softmax of block j while QK^T of block j+1 runs (same WG)
  kFlagDynamic = 4,   // dynamic persistent scheduler (global atomic tile counter, scheduler.cuh)
  kFlagEagerRescale = 8,  // ablation: rescale O after every block (OnlineSoftmax::update) instead of
                          // only when a row's max rose by > 2^8 (update_lazy, the default; softmax.cuh)
  kFlagQInRegs = 16,  // S = Q K^T as wgmma RS, Q's A fragments loaded into registers once per tile
                      // (ldmatrix) instead of read from shared memory by every wgmma (SS); the
                      // hdim-128 default (FwdConfig::kDefaultFlags)
};

// kOInV_: the O staging tile of the epilogue lives in the V ring (FA3's
// choice: smem_o aliases smem_v) instead of the Q tile, for tiles where O has
// no room of its own. The next tile's Q (and K) then load during the
// epilogue; only its first V load waits for the O store to have read the
// ring (mbarrier o_free), and the consumer warpgroups meet on a named barrier
// before writing O (another WG may still be reading V in its last PV).
template <int kHeadDim_, int kBlockN_, int kConsumerWGs_, int kStages_, bool kOInV_ = false>
struct FwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kConsumerWGs = kConsumerWGs_;
  static constexpr int kStages = kStages_;
  static constexpr bool kOInV = kOInV_;
  static constexpr int kBlockM = 64 * kConsumerWGs;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  // Register budgets after setmaxnreg (FA3: 24/240 with 2 consumer WGs,
  // 32/160 with 3); 128 * (producer + WGs * consumer) <= 64K.
  static constexpr int kProducerRegs = kConsumerWGs == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kConsumerWGs == 2 ? 240 : 160;
  static_assert(128 * (kProducerRegs + kConsumerWGs * kConsumerRegs) <= 65536, "register file");
  // FA3 rescales O before the PV GEMM (off the critical path) for hdim > 128.
  static constexpr bool kRescaleBeforePV = kHeadDim > 128;

  static_assert(kHeadDim % 64 == 0, "head dim bucket must be a multiple of 64 (128B swizzle atoms)");
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "kBlockN: multiple of 16, <= 256 (TMA box, wgmma N)");
  static_assert(kBlockM <= 256, "TMA box rows <= 256");

  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // one stage of K (or V)
  static constexpr int kOffQ = 0;
  static constexpr int kOffK = kOffQ + kQBytes;
  static constexpr int kOffV = kOffK + kStages * kKVBytes;
  static constexpr int kEndKV = kOffV + kStages * kKVBytes;
  // O gets its own buffer when it fits next to the rest (227 KB opt-in minus
  // the 1 KB alignment slack and the barriers); otherwise it reuses the Q tile
  // (then the next tile's Q load waits for the O store to be read out).
  static constexpr int kSmemLimit = 227 * 1024 - 1024 - 256;
  static constexpr bool kOAliasQ = !kOInV && kEndKV + kQBytes > kSmemLimit;
  static constexpr int kOffO = kOInV ? kOffV : kOAliasQ ? kOffQ : kEndKV;
  static constexpr int kOffBar = (kOAliasQ || kOInV) ? kEndKV : kEndKV + kQBytes;
  static_assert(!kOInV || kStages * kKVBytes >= kQBytes, "O tile must fit in the V ring");
  // mbarriers: full_q, empty_q, full_k[S], empty_k[S], full_v[S], empty_v[S],
  // o_free (kOInV only), tile_full, tile_empty (kFlagDynamic only); all
  // always allocated
  static constexpr int kNumBars = 5 + 4 * kStages;
  // One int after the barriers: the next tile index (kFlagDynamic), 16 bytes.
  static constexpr int kOffTile = kOffBar + 8 * kNumBars;
  static constexpr int kSmemBytes = kOffTile + 16;
  static constexpr int kSmemAlloc = kSmemBytes + 1024;  // + slack to align the base to 1 KB
  static_assert(kSmemBytes <= kSmemLimit + 256, "shared memory plan too large");
  static_assert(kOffK % 1024 == 0 && kOffV % 1024 == 0 && kKVBytes % 1024 == 0 &&
                    kQBytes % 1024 == 0 && kOffO % 1024 == 0,
                "128B-swizzled tiles must start 1 KB aligned");

  // The default variant: FA3 enables the inter-warpgroup scheduler barrier
  // ("pingpong") with intra-WG overlap only for hdim <= 128.
  // Q in registers (S = Q K^T as wgmma RS) where its 32 registers fit, i.e. the
  // hdim-128 x 128 tile (R237 of 240; hdim 256 would need 64): a third less
  // shared-memory operand traffic for QK^T, +2.6% at the power cap on the H200
  // (benchmarks/results/runs_2026-11-30c). It frees Q's buffer after the load,
  // so O needs its own buffer.
  static constexpr bool kQInRegsFits = kHeadDim == 128 && kBlockN == 128 && !kOInV && !kOAliasQ;
  static constexpr int kDefaultFlags =
      kFlagOverlap | (kHeadDim <= 128 ? kFlagPingpong : 0) | (kQInRegsFits ? kFlagQInRegs : 0);

  // q_empty arrivals: each consumer warp once its QK^T GEMMs are done (separate
  // O buffer; kFlagQInRegs: once it has read Q into registers), or each
  // consumer WG's storing thread once the O store has read the aliased tile.
  static constexpr int kQEmptyArrivals = kOAliasQ ? kConsumerWGs : 4 * kConsumerWGs;
  static constexpr int kKVEmptyArrivals = 4 * kConsumerWGs;  // every consumer warp
  static constexpr int kOFreeArrivals = kConsumerWGs;        // each WG's storing thread
};

// kBlockN of the hdim-128 kernel, overridable for tuning builds: 192 also
// compiles without spills (O then shares the Q buffer; FA3 calls 128 x 192 "quite
// good too"); 176 (FA3's non-causal choice) spills a few bytes here.
#ifndef JAX_FLASH_SM90_BLOCKN_HDIM128
#define JAX_FLASH_SM90_BLOCKN_HDIM128 128
#endif

template <int kHeadDim>
struct FwdConfigFor;
//                                       D    BN  WGs stages
template <> struct FwdConfigFor<64>  { using type = FwdConfig<64, 128, 3, 2>; };
template <> struct FwdConfigFor<128> { using type = FwdConfig<128, JAX_FLASH_SM90_BLOCKN_HDIM128, 2, 2>; };
template <> struct FwdConfigFor<256> { using type = FwdConfig<256, 80, 2, 2>; };

// Tile shapes of the tuning variants (instantiations.h, sm90_variant >= 5;
// FwdConfig256V is also the default for causal-like masks at hdim 256, the
// others are compiled only with -DJAX_FLASH_SM90_ABLATION).
using FwdConfig128N176V = FwdConfig<128, 176, 2, 2, true>;   // FA3's non-causal hdim-128 tile, O in V
using FwdConfig128N192V = FwdConfig<128, 192, 2, 2, true>;   // O in V
using FwdConfig128N192Q = FwdConfig<128, 192, 2, 2, false>;  // O in Q (= JAX_FLASH_SM90_BLOCKN_HDIM128=192)
using FwdConfig256V = FwdConfig<256, 80, 2, 2, true>;        // hdim 256, O in V

// The sm90 head-dim buckets (no 96: 65..128 use the 128 kernel, zero-padded).
inline int sm90_rounded_head_dim(int d) { return d <= 64 ? 64 : d <= 128 ? 128 : 256; }

}  // namespace jax_flash::sm90
