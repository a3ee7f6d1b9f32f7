// The FP8 pre-pass's index math (cuda/fp8/quantize.cu), host and device:
// launch 1's CTA order and which elements of a row each thread of a Q/K CTA
// holds. Plain C++ so that cuda/tests/fp8_prepass_check.cpp replays it on the
// host (every element loaded and stored exactly once, the order a bijection,
// the rotation's sums rounded as by the lane-per-4/8-elements transform the
// kernel had before).
#pragma once

#if defined(__CUDACC__)
#define JF_PREPASS_HD __host__ __device__ __forceinline__
#else
#define JF_PREPASS_HD inline
#endif

namespace jax_flash::fp8 {

constexpr int kPrepassThreads = 256;
constexpr int kPrepassWarps = kPrepassThreads / 32;

// Q's and K's threads: each holds kRowElems elements of a row (two 16-byte
// chunks of 8 values), kRowLanes lanes per row. Lane t of a row holds chunks
// t and t + kRowLanes, so one load instruction of a warp reads whole runs of
// 16 kRowLanes bytes of its rows (every sector it touches, in full), and the
// butterflies across lanes are log2(kRowLanes) stages of shuffles (2, 3, 4)
// instead of 5 with a row spread over all 32 lanes.
template <int D>
struct RowThreads {
  static_assert(D == 64 || D == 128 || D == 256, "head dim");
  static constexpr int kChunks = 2;                             // 16-byte chunks per thread and row
  static constexpr int kRowElems = 8 * kChunks;                 // 16
  static constexpr int kRowLanes = D / kRowElems;               // 4, 8, 16
  static constexpr int kWarpRows = 32 / kRowLanes;              // rows per warp and step: 8, 4, 2
  static constexpr int kStepRows = kPrepassWarps * kWarpRows;   // rows per CTA and step: 64, 32, 16
  // Steps (all loads issued before the first use) for a block of `block` rows.
  static constexpr int steps(int block) { return (block + kStepRows - 1) / kStepRows; }
  // Row (within the block) of thread `tid` at step s; >= block: none.
  JF_PREPASS_HD static int row(int tid, int s) {
    return s * kStepRows + (tid / 32) * kWarpRows + (tid % 32) / kRowLanes;
  }
  // Head-dim index of the thread's element j = 8 chunk + e (t = lane % kRowLanes).
  JF_PREPASS_HD static int dim(int t, int j) { return 8 * (t + kRowLanes * (j / 8)) + j % 8; }
};

// Launch 1 runs in clusters of kClusterCtas CTAs: a unit of work per
// cluster. A Q or K descale block is split over parts(kind, D) CTAs of one
// cluster (consecutive ranks), which exchange their maxima through
// distributed shared memory, so that no CTA holds more than 32 rotated values
// per thread (the whole kernel's register count, and so every kind's
// occupancy, follows its heaviest CTA); a V unit is kClusterCtas chunks of
// keys, one per CTA.
constexpr int kClusterCtas = 4;
enum Kind { kKindK = 0, kKindQ = 1, kKindV = 2 };
constexpr int parts(int kind, int head_dim) {
  return kind == kKindK ? 4 : kind == kKindQ ? (head_dim == 256 ? 2 : 1) : 1;
}
// Units of `items` blocks (Q, K) or chunks (V) of a kind.
constexpr long long units(long long items, int kind, int head_dim) {
  const int per_unit = kClusterCtas / parts(kind, head_dim);
  return (items + per_unit - 1) / per_unit;
}
// The block (chunk) and part of rank r of unit u.
struct Place {
  long long item;
  int part;
};
JF_PREPASS_HD Place place(long long u, int r, int kind, int head_dim) {
  const int p = parts(kind, head_dim);
  return {u * (kClusterCtas / p) + r / p, r % p};
}

// Launch 1's unit order (a bijection of [0, k_units + q_units + v_units)): K
// and Q alternate while both last, so that an SM holds K and Q CTAs at once
// (their different mixes of arithmetic and memory overlap); then the rest of
// the longer one; V's partial maxima last, so that the keys they read last
// are still in L2 when launch 2 starts (it quantises V from the last (batch,
// head) back).
struct Slot {
  int kind;        // kKindK, kKindQ, kKindV
  long long unit;  // within its kind
};
JF_PREPASS_HD Slot slot(long long idx, long long k_units, long long q_units) {
  const long long both = k_units < q_units ? k_units : q_units;
  if (idx < 2 * both) return {int(idx % 2), idx / 2};
  idx -= 2 * both;
  const int kind = k_units > both ? kKindK : kKindQ;
  const long long rest = (k_units > both ? k_units : q_units) - both;
  if (idx < rest) return {kind, both + idx};
  return {kKindV, idx - rest};
}

}  // namespace jax_flash::fp8
