// Tile shapes and warp layouts per head-dim bucket. One place to tune.
//
// Forward (FA2 partitioning): a CTA owns kBlockM query rows for the whole KV
// sweep; its warps split those rows, kMT m-tiles (16 rows) each. Two m-tiles
// per warp halve the shared-memory traffic for K and V per mma (each B
// fragment feeds two mma), which is what keeps the SM's shared-memory
// bandwidth below the tensor-core rate at hdim 128 (FA2 uses the same shape).
//
// Backward (FA2 algorithm 2): a CTA owns kBlockN keys, keeps K, V, dK, dV for
// them, and sweeps the query blocks (double-buffered Q and dO). Its warps are
// laid out three ways, one per product:
//   S = Q K^T and dP = dO V^T : kWarpsM_S warps along the rows,
//   dV += P^T dO, dK += dS^T Q: kWarpsN_KV warps along the keys,
//   dQ = dS K                 : kWarpsM_Q warps along the rows,
// the remaining warps split the other dimension.
//
// A value head dim of its own (kHeadDimV != kHeadDim, a head-dim pair of
// head_dim.h): V, O, dO and dV are kHeadDimV wide, Q, K, dQ and dK
// kHeadDim; S and P do not depend on either. kHeadDimV defaults to
// kHeadDim, which gives exactly the tiles of a bucket.
#pragma once

#include "jax_flash/params.h"
#include "smem_layout.cuh"

namespace jax_flash::sm80 {

// The columns of V, O, dO and dV of a call. The kernels of a bucket serve
// only head_dim_v == head_dim (dispatch.cu) and read head_dim, so that their
// code is the same as without a value head dim; a pair's read head_dim_v.
template <typename Cfg>
JF_DEVICE int value_head_dim(const FwdParams& p) {
  if constexpr (Cfg::kHeadDimV == Cfg::kHeadDim) return p.head_dim;
  else return p.head_dim_v;
}

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kHeadDimV_ = kHeadDim_>
struct FwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMT = kBlockM / (16 * kWarps);  // m-tiles per warp
  static constexpr int kNT_S = kBlockN / 8;              // n-tiles of S per warp
  static constexpr int kNT_O = kHeadDimV / 8;            // n-tiles of O per warp
  static_assert(kMT * 16 * kWarps == kBlockM, "rows must split evenly over the warps");
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using KTile = SmemTile<kBlockN, kHeadDim>;
  using VTile = SmemTile<kBlockN, kHeadDimV>;
  using OTile = SmemTile<kBlockM, kHeadDimV>;  // the epilogue's, in Q's place
  static_assert(OTile::kBytes <= QTile::kBytes, "the output tile reuses Q's shared memory");
  static constexpr int kSmemQ = 0;
  static constexpr int kSmemK = kSmemQ + QTile::kBytes;
  static constexpr int kSmemV = kSmemK + KTile::kBytes;
  static constexpr int kSmemBytes = kSmemV + VTile::kBytes;
};

// Forward shapes (FA2's sm80 choices). Q is re-read from shared memory with
// ldmatrix for every KV block rather than kept in registers: with two m-tiles
// per warp its fragments (64 registers at hdim 128) do not fit next to O (128)
// and S (64) in 255 registers; the extra shared-memory traffic is the Q half
// of the S product only.
// The pair (192, 128) takes hdim 128's shape: its O and S are those of
// hdim 128 (the registers that bound the tile), Q and K only add reduction
// steps to S = Q K^T; 88 KB of shared memory.
template <int kHeadDim, int kHeadDimV = kHeadDim>
struct FwdConfigFor;
//                                           D   BM   BN  warps
template <> struct FwdConfigFor<64>  { using type = FwdConfig<64, 128, 128, 4>; };
template <> struct FwdConfigFor<96>  { using type = FwdConfig<96, 128, 64, 4>; };
template <> struct FwdConfigFor<128> { using type = FwdConfig<128, 128, 64, 4>; };
template <> struct FwdConfigFor<256> { using type = FwdConfig<256, 128, 64, 8>; };
//                                                D   BM  BN  warps  D_v
template <> struct FwdConfigFor<192, 128> { using type = FwdConfig<192, 128, 64, 4, 128>; };

// Fallbacks for GPUs with less opt-in shared memory per block than the
// H100/H200's 227 KB (A100: 163 KB; sm86/sm89: 99 KB). The launcher picks the
// preferred shape when it fits, else this one (same kernels, smaller tiles).
template <int kHeadDim, int kHeadDimV = kHeadDim>
struct FwdConfigSmallFor { using type = typename FwdConfigFor<kHeadDim, kHeadDimV>::type; };
template <> struct FwdConfigSmallFor<256> { using type = FwdConfig<256, 64, 64, 4>; };  // 96 KB

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kWarpsM_S_,
          int kWarpsN_KV_, int kWarpsM_Q_, int kHeadDimV_ = kHeadDim_>
struct BwdConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  // S / dP: warp tile kRowsS x kColsS.
  static constexpr int kWarpsM_S = kWarpsM_S_;
  static constexpr int kRowsS = kBlockM / kWarpsM_S;
  static constexpr int kColsS = kBlockN / (kWarps / kWarpsM_S);
  static constexpr int kMT_S = kRowsS / 16, kNT_S = kColsS / 8;
  // dK / dV: warp tiles kRowsKV (keys) x kColsK / kColsV (head dims).
  static constexpr int kWarpsN_KV = kWarpsN_KV_;
  static constexpr int kRowsKV = kBlockN / kWarpsN_KV;
  static constexpr int kColsK = kHeadDim / (kWarps / kWarpsN_KV);
  static constexpr int kColsV = kHeadDimV / (kWarps / kWarpsN_KV);
  static constexpr int kMT_KV = kRowsKV / 16, kNT_K = kColsK / 8, kNT_V = kColsV / 8;
  // dQ: warp tile kRowsQ x kColsQ.
  static constexpr int kWarpsM_Q = kWarpsM_Q_;
  static constexpr int kRowsQ = kBlockM / kWarpsM_Q;
  static constexpr int kColsQ = kHeadDim / (kWarps / kWarpsM_Q);
  static constexpr int kMT_Q = kRowsQ / 16, kNT_Q = kColsQ / 8;
  static_assert(kMT_S * 16 == kRowsS && kNT_S * 8 == kColsS && kNT_S % 2 == 0, "S tiling");
  static_assert(kMT_KV * 16 == kRowsKV && kNT_K * 8 == kColsK && kNT_K % 2 == 0, "dK tiling");
  static_assert(kNT_V * 8 == kColsV && kNT_V % 2 == 0, "dV tiling");
  static_assert(kMT_Q * 16 == kRowsQ && kNT_Q * 8 == kColsQ && kNT_Q % 2 == 0, "dQ tiling");

  using QTile = SmemTile<kBlockM, kHeadDim>;    // Q, 2 stages
  using dOTile = SmemTile<kBlockM, kHeadDimV>;  // dO, 2 stages
  using KTile = SmemTile<kBlockN, kHeadDim>;
  using VTile = SmemTile<kBlockN, kHeadDimV>;
  using PTile = SmemTile<kBlockM, kBlockN>;     // P and dS
  static constexpr int kSmemK = 0;
  static constexpr int kSmemV = kSmemK + KTile::kBytes;
  static constexpr int kSmemQ = kSmemV + VTile::kBytes;        // [2] stages
  static constexpr int kSmemdO = kSmemQ + 2 * QTile::kBytes;   // [2] stages
  static constexpr int kSmemP = kSmemdO + 2 * dOTile::kBytes;
  static constexpr int kSmemdS = kSmemP + PTile::kBytes;
  static constexpr int kSmemBytes = kSmemdS + PTile::kBytes;
  // sm90 fused-dQ staging (bwd_kernel's kBulkDq): the fp32 dQ tile, rows
  // padded by 8 floats so that the fragment stores are bank-conflict free,
  // reduced into dq_accum by the copy engine one row at a time.
  static constexpr int kDqPitch = kHeadDim + 8;
  static constexpr int kSmemdQ = kSmemBytes;
  static constexpr int kSmemBytesBulkDq = kSmemdQ + kBlockM * kDqPitch * 4;
};

// The pair (192, 128) takes hdim 256's warp layout at 64 x 64 (136 KB, an
// A100's 163 KB; with hdim 128's 64 x 128 it would need 192 KB).
template <int kHeadDim, int kHeadDimV = kHeadDim>
struct BwdConfigFor;
//                                         D   BM   BN  W  M_S N_KV M_Q
template <> struct BwdConfigFor<64>  { using type = BwdConfig<64, 128, 128, 8, 4, 4, 4>; };
template <> struct BwdConfigFor<96>  { using type = BwdConfig<96, 64, 128, 8, 2, 4, 4>; };
template <> struct BwdConfigFor<128> { using type = BwdConfig<128, 64, 128, 8, 2, 4, 2>; };
template <> struct BwdConfigFor<256> { using type = BwdConfig<256, 64, 64, 8, 4, 2, 2>; };
//                                              D   BM  BN  W  M_S N_KV M_Q  D_v
template <> struct BwdConfigFor<192, 128> { using type = BwdConfig<192, 64, 64, 8, 4, 2, 2, 128>; };
// Smaller shared-memory footprints (see FwdConfigSmallFor): 96, 88, 72, 136,
// and (192, 128) 88 KB.
template <int kHeadDim, int kHeadDimV = kHeadDim>
struct BwdConfigSmallFor;
template <> struct BwdConfigSmallFor<64>  { using type = BwdConfig<64, 64, 128, 8, 2, 4, 2>; };
template <> struct BwdConfigSmallFor<96>  { using type = BwdConfig<96, 64, 64, 8, 2, 4, 4>; };
template <> struct BwdConfigSmallFor<128> { using type = BwdConfig<128, 32, 64, 8, 2, 4, 2>; };
template <> struct BwdConfigSmallFor<256> { using type = BwdConfig<256, 32, 64, 8, 2, 2, 2>; };
template <> struct BwdConfigSmallFor<192, 128> { using type = BwdConfig<192, 32, 64, 8, 2, 2, 2, 128>; };

// Deterministic dQ pass: a CTA owns kBlockM query rows (one m-tile per warp)
// and sweeps the KV blocks (double-buffered K and V), like the forward; dS
// stays in registers and feeds dS K directly.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kHeadDimV_ = kHeadDim_>
struct DqConfig {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMT = kBlockM / (16 * kWarps);
  static constexpr int kNT_S = kBlockN / 8;
  static constexpr int kNT_O = kHeadDim / 8;  // n-tiles of dQ per warp
  static_assert(kMT * 16 * kWarps == kBlockM, "rows must split evenly over the warps");
  using QTile = SmemTile<kBlockM, kHeadDim>;
  using dOTile = SmemTile<kBlockM, kHeadDimV>;
  using KTile = SmemTile<kBlockN, kHeadDim>;
  using VTile = SmemTile<kBlockN, kHeadDimV>;
  static constexpr int kSmemQ = 0;
  static constexpr int kSmemdO = kSmemQ + QTile::kBytes;
  static constexpr int kSmemKV = kSmemdO + dOTile::kBytes;  // [2] stages of (K, V)
  static constexpr int kStageBytes = KTile::kBytes + VTile::kBytes;
  static constexpr int kSmemBytes = kSmemKV + 2 * kStageBytes;
};

template <int kHeadDim, int kHeadDimV = kHeadDim>
struct DqConfigFor { using type = DqConfig<kHeadDim, 64, (kHeadDim > 128 ? 32 : 64), 4, kHeadDimV>; };
template <int kHeadDim, int kHeadDimV = kHeadDim>
struct DqConfigSmallFor { using type = typename DqConfigFor<kHeadDim, kHeadDimV>::type; };
template <> struct DqConfigSmallFor<256> { using type = DqConfig<256, 32, 32, 2>; };  // 96 KB

}  // namespace jax_flash::sm80
