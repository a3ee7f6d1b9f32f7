// The FP8 pre-pass kernels (quantize.h: what they compute, the two launches
// and the workspace rule; prepass_layout.h: launch 1's units and order, the
// rows and head-dim elements of each Q/K thread, replayed on the host by
// cuda/tests/fp8_prepass_check.cpp). Arithmetic as quantize.py: float32
// throughout, IEEE divisions for the scales (not the fast-math
// approximation), round-to-nearest-even e4m3 after clipping to +-448.
//
// Launch 1 (prepass_kernel, clusters of 4 CTAs):
//   K, Q: a thread holds 16 values of a row (two 16-byte chunks, 4 / 8 / 16
//      lanes per row at D = 64 / 128 / 256) for each of its rows, every load
//      issued before the first use (2-4 16-byte loads per thread, 8-16 KiB
//      per CTA, 4 CTAs per SM), the
//      rotation's butterflies 3 + 1 stages in the thread and log2(lanes per
//      row) across lanes (the row spread over all 32 lanes took 5 stages of
//      shuffles and selects per value); the stages in the order of their
//      strides, so the sums round exactly as before; 8-byte e4m3 stores, two
//      values per conversion instruction;
//   V: CTA (chunk c, head, batch) covers keys [c L, (c + 1) L), L =
//      ceil(seqlen_k / v_chunks), and writes their per-channel max |v| to
//      v_partial[batch, head, c, :].
// Launch 2 (v_quant_kernel): CTA (256 keys, head, batch), walked backwards,
// takes the max of the v_chunks partial rows of its (batch, head), writes the
// descales (the CTA of keys 0..255) and quantises its keys: each thread 16
// channels of a key row, two 16-byte loads and one 16-byte store.
// Data touched once (Q, K, V's second read, every e4m3 store) carries the L2
// evict-first policy, so that it displaces the V keys awaiting their second
// read (launch 1's last reads, launch 2's first) as little as it can.
#include "quantize.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_fp8.h>

#include <climits>
#include <cstring>

#include "prepass_layout.h"
#include "jax_flash/fp8_scheme.h"

namespace jax_flash::fp8 {
namespace {

namespace cg = cooperative_groups;

constexpr float kE4M3Max = 448.f;
constexpr int kThreads = kPrepassThreads;
constexpr int kWarps = kPrepassWarps;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kVTileKeys = 256;   // keys per CTA of launch 2
constexpr int kVUnroll = 4;       // key rows in flight per thread (V)

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

__device__ __forceinline__ float clip(float x) { return fminf(fmaxf(x, -kE4M3Max), kE4M3Max); }

// e4m3 of two values, a in the low byte: one conversion instruction for both
// (the same cvt.rn.satfinite.e4m3x2 that the one-value intrinsic issues with
// a zero beside, so the bytes are those of two one-value conversions).
__device__ __forceinline__ uint32_t e4m3x2(float a, float b) {
  return uint32_t(__nv_cvt_float2_to_fp8x2(make_float2(clip(a), clip(b)), __NV_SATFINITE, __NV_E4M3));
}

// descale = amax / 448 and its inverse; 1 for an all-zero block.
__device__ __forceinline__ void scales(float amax, float& descale, float& inv) {
  const bool nz = amax > 0.f;
  descale = nz ? __fdiv_rn(amax, kE4M3Max) : 1.f;
  inv = nz ? __fdiv_rn(kE4M3Max, amax) : 1.f;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(kFull, x, o));
  return x;
}

// The two 16-bit values of a 32-bit word (the lower address first) as floats.
template <typename T>
__device__ __forceinline__ void unpack2(uint32_t w, float& lo, float& hi) {
  T t[2];
  memcpy(t, &w, sizeof(w));
  lo = to_float(t[0]);
  hi = to_float(t[1]);
}

// L2 policy for data touched once (Q and K read, every e4m3 value written,
// V read the second time): evicted first, so that the V keys launch 1 read
// last stay in L2 for launch 2's second read of them.
__device__ __forceinline__ uint64_t evict_first() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// 16 bytes at p (read-only for the kernel), not kept in L1, first out of L2.
__device__ __forceinline__ uint4 load_once(const void* p, uint64_t policy) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p), "l"(policy));
  return r;
}

// No "memory" clobber: nothing in these kernels reads what they store, and
// the clobber would keep the next keys' loads from moving above the stores.
__device__ __forceinline__ void store_once(void* p, uint2 v, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v2.u32 [%0], {%1, %2}, %3;" ::"l"(p), "r"(v.x), "r"(v.y), "l"(policy));
}

__device__ __forceinline__ void store_once(void* p, uint4 v, uint64_t policy) {
  asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w), "l"(policy));
}

// The 8 16-bit values of a 16-byte word (the lower address first) as floats.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& u, float* x) {
  unpack2<T>(u.x, x[0], x[1]);
  unpack2<T>(u.y, x[2], x[3]);
  unpack2<T>(u.z, x[4], x[5]);
  unpack2<T>(u.w, x[6], x[7]);
}

// e4m3(x[i] * inv[i]) of 8 values: 8 bytes, x[0] at the lowest address.
__device__ __forceinline__ uint2 e4m3x8(const float* x, const float* inv) {
  uint32_t w[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t lo = e4m3x2(x[4 * i] * inv[4 * i], x[4 * i + 1] * inv[4 * i + 1]);
    const uint32_t hi = e4m3x2(x[4 * i + 2] * inv[4 * i + 2], x[4 * i + 3] * inv[4 * i + 3]);
    w[i] = lo | (hi << 16);
  }
  return make_uint2(w[0], w[1]);
}

// Walsh-Hadamard transform (Sylvester order, unnormalised) of a row spread
// as RowThreads spreads it (element j = 8 chunk + e of lane t is d = 8 (t +
// kRowLanes chunk) + e). Its butterfly stages run in the order of their
// strides, 1, 2, ..., D/2, as in any other spread of the row over lanes, and
// each stage's values depend only on the previous stage's, so the sums round
// the same whatever the spread: strides 1, 2, 4 in the thread (bits of e),
// 8 .. 4 kRowLanes across the row's lanes (bits of t), D/2 in the thread
// again (the chunk bit).
template <int D>
__device__ __forceinline__ void fwht_row(float (&v)[RowThreads<D>::kRowElems], int t) {
  using R = RowThreads<D>;
  static_assert(R::kChunks == 2, "the chunk bit is the last stage");
#pragma unroll
  for (int h = 1; h < 8; h *= 2)
#pragma unroll
    for (int i = 0; i < R::kRowElems; ++i)
      if ((i & h) == 0) {
        const float a = v[i], b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
#pragma unroll
  for (int m = 1; m < R::kRowLanes; m *= 2) {
    // The lane with bit m of t clear holds the lower element of each pair:
    // lower a + b, upper a - b (a, b the lower's and the upper's values),
    // as fma(v, +-1, o): the product is exact, so one rounding of the same sum.
    const float sgn = (t & m) != 0 ? -1.f : 1.f;
#pragma unroll
    for (int e = 0; e < R::kRowElems; ++e) {
      const float o = __shfl_xor_sync(kFull, v[e], m);
      v[e] = fmaf(v[e], sgn, o);
    }
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float a = v[e], b = v[e + 8];
    v[e] = a + b;
    v[e + 8] = a - b;
  }
}

// What launch 1 needs beyond the arguments: the CTA counts of each kind.
struct Plan {
  PrepassArgs a;
  int chunks;                  // v_chunks(seqlen_k)
  int k_blocks, q_blocks;      // row blocks per head
  int k_items, q_items;        // row blocks of all heads
  int v_ctas;                  // chunks of all heads (one CTA each)
  int k_units, q_units;        // launch 1's units of each kind (prepass_layout.h)
};

// Part `part` of P of descale block blk of head h of x [batch, n, heads, D]
// (rows blk BLOCK + part BLOCK / P + [0, BLOCK / P)): step s of thread tid
// covers row RowThreads<D>::row(tid, s) of the part. The part's amax (warps,
// then shared memory), then, for P > 1, the block's over the P CTAs of the
// cluster that hold it (ranks part 0 .. P - 1, through distributed shared
// memory); descale by part 0; e4m3 with 8-byte stores. An inactive CTA (a
// unit's blocks beyond the last) loads and stores nothing but joins the
// cluster barriers, which every CTA of the cluster must reach.
template <typename T, int D, int BLOCK, int P>
__device__ __forceinline__ void rows_cta(const T* __restrict__ x, uint8_t* __restrict__ x8,
                                         float* __restrict__ descale_out, const float* signs, int n,
                                         int heads, int blk, int part, int h, int b, bool active) {
  using R = RowThreads<D>;
  constexpr int E = R::kRowElems;
  constexpr int kPartRows = BLOCK / P;
  static_assert(BLOCK % P == 0 && kClusterCtas % P == 0, "parts");
  constexpr int kSteps = (kPartRows + R::kStepRows - 1) / R::kStepRows;
  constexpr float kNorm = D == 64 ? 0.125f : D == 128 ? 0.08838834764831845f : 0.0625f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t = lane % R::kRowLanes;
  const bool rotate = signs != nullptr;
  const int64_t stride = int64_t(heads) * D;  // between rows
  const int64_t first = (int64_t(b) * n * heads + h) * D + 8 * t;
  const int row0 = blk * BLOCK + part * kPartRows + R::row(threadIdx.x, 0);
  auto valid = [&](int s) {
    return active && (kPartRows % R::kStepRows == 0 || R::row(threadIdx.x, s) < kPartRows) &&
           row0 + s * R::kStepRows < n;
  };

  // Bit j: the sign of element j is -1 (x * -1 as a flip of the sign bit:
  // the same bits, one register instead of E).
  uint32_t neg = 0;
  if (rotate) {
#pragma unroll
    for (int j = 0; j < E; ++j) neg |= uint32_t(signs[R::dim(t, j)] < 0.f) << j;
  }

  const uint64_t policy = evict_first();
  // Every load first (kSteps * kChunks 16-byte loads per thread in flight).
  uint4 raw[kSteps][R::kChunks];
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const T* src = x + first + int64_t(row0 + s * R::kStepRows) * stride;
#pragma unroll
    for (int c = 0; c < R::kChunks; ++c)
      raw[s][c] = valid(s) ? load_once(src + 8 * R::kRowLanes * c, policy)
                           : make_uint4(0u, 0u, 0u, 0u);  // +0 in bf16 and fp16
  }
  float v[kSteps][E];
  float amax = 0.f;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
#pragma unroll
    for (int c = 0; c < R::kChunks; ++c) unpack8<T>(raw[s][c], &v[s][8 * c]);
    if (rotate) {  // uniform over the CTA: the shuffles see every lane
#pragma unroll
      for (int e = 0; e < E; ++e)
        v[s][e] = __uint_as_float(__float_as_uint(v[s][e]) ^ ((neg << (31 - e)) & 0x80000000u));
      fwht_row<D>(v[s], t);
#pragma unroll
      for (int e = 0; e < E; ++e) v[s][e] *= kNorm;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(v[s][e]));
  }
  __shared__ float warp_amax[kWarps];
  __shared__ float cta_amax;
  amax = warp_max(amax);
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads();
  amax = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, warp_amax[w]);
  if constexpr (P > 1) {
    cg::cluster_group cluster = cg::this_cluster();
    if (threadIdx.x == 0) cta_amax = amax;
    cluster.sync();  // every part's amax is in its CTA's shared memory
    const unsigned base = cluster.block_rank() - unsigned(part);
    amax = 0.f;
#pragma unroll
    for (int i = 0; i < P; ++i) amax = fmaxf(amax, *cluster.map_shared_rank(&cta_amax, base + i));
  }
  float descale, inv;
  scales(amax, descale, inv);
  if (active && part == 0 && threadIdx.x == 0) {
    const int nb = (n + BLOCK - 1) / BLOCK;
    descale_out[(int64_t(b) * heads + h) * nb + blk] = descale;
  }
  float invs[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) invs[e] = inv;
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    if (!valid(s)) continue;
    uint8_t* dst = x8 + first + int64_t(row0 + s * R::kStepRows) * stride;
#pragma unroll
    for (int c = 0; c < R::kChunks; ++c)
      store_once(dst + 8 * R::kRowLanes * c, e4m3x8(&v[s][8 * c], invs), policy);
  }
  // No CTA leaves (its shared memory with it) while a peer may still read it.
  if constexpr (P > 1) cg::this_cluster().sync();
}

// V's threads: kLanes threads per key row, each 16 consecutive channels.
template <int D>
struct VThreads {
  static constexpr int kLanes = D / 16;
  static constexpr int kRows = kThreads / kLanes;  // key rows per step of the CTA
};

// 16 consecutive 16-bit values (32 bytes, 32-byte aligned): two 16-byte loads.
template <typename T>
__device__ __forceinline__ void load16(const T* src, uint4 (&raw)[2]) {
  const uint4* p = reinterpret_cast<const uint4*>(src);
  raw[0] = p[0];
  raw[1] = p[1];
}

template <typename T>
__device__ __forceinline__ void unpack16(const uint4 (&raw)[2], float (&x)[16]) {
  const uint32_t w[8] = {raw[0].x, raw[0].y, raw[0].z, raw[0].w,
                         raw[1].x, raw[1].y, raw[1].z, raw[1].w};
#pragma unroll
  for (int i = 0; i < 8; ++i) unpack2<T>(w[i], x[2 * i], x[2 * i + 1]);
}

// Launch 1, V: the per-channel max |v| of keys [c L, (c + 1) L) of (b, h).
template <typename T, int D>
__device__ __forceinline__ void v_amax_cta(const PrepassArgs& a, int chunks, int c, int h, int b) {
  constexpr int kLanes = VThreads<D>::kLanes, kRows = VThreads<D>::kRows;
  const int j = threadIdx.x % kLanes, r = threadIdx.x / kLanes;
  const int len = (a.seqlen_k + chunks - 1) / chunks;
  const int begin = c * len, end = min(a.seqlen_k, begin + len);
  const int64_t row_stride = int64_t(a.heads_k) * D;
  const T* src = static_cast<const T*>(a.v) + (int64_t(b) * a.seqlen_k * a.heads_k + h) * D + 16 * j;
  float m[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) m[i] = 0.f;
  for (int k0 = begin + r; k0 < end; k0 += kVUnroll * kRows) {
    uint4 raw[kVUnroll][2];
#pragma unroll
    for (int u = 0; u < kVUnroll; ++u) {
      const int key = k0 + u * kRows;
      if (key < end) {
        load16(src + key * row_stride, raw[u]);
      } else {
        raw[u][0] = raw[u][1] = make_uint4(0u, 0u, 0u, 0u);  // +0 in bf16 and fp16
      }
    }
#pragma unroll
    for (int u = 0; u < kVUnroll; ++u) {
      float x[16];
      unpack16<T>(raw[u], x);
#pragma unroll
      for (int i = 0; i < 16; ++i) m[i] = fmaxf(m[i], fabsf(x[i]));
    }
  }
  // The threads of one channel group: lanes j, j + kLanes, ... of each warp,
  // then the warps.
#pragma unroll
  for (int o = kLanes; o < 32; o *= 2)
#pragma unroll
    for (int i = 0; i < 16; ++i) m[i] = fmaxf(m[i], __shfl_xor_sync(kFull, m[i], o));
  __shared__ float part[kWarps][D];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane < kLanes) {
#pragma unroll
    for (int i = 0; i < 16; ++i) part[warp][16 * lane + i] = m[i];
  }
  __syncthreads();
  float* out = a.v_partial + ((int64_t(b) * a.heads_k + h) * chunks + c) * D;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float x = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) x = fmaxf(x, part[w][d]);
    out[d] = x;
  }
}

template <typename T, int D>
__global__ void __cluster_dims__(kClusterCtas, 1, 1) __launch_bounds__(kThreads)
    prepass_kernel(const __grid_constant__ Plan p) {
  const PrepassArgs& a = p.a;
  const Slot sl = slot(blockIdx.x / kClusterCtas, p.k_units, p.q_units);
  const int rank = blockIdx.x % kClusterCtas;  // the rank in the cluster (1-D clusters along x)
  const Place pl = place(sl.unit, rank, sl.kind, D);
  if (sl.kind == kKindV) {
    if (pl.item >= p.v_ctas) return;  // no cluster barrier in V units
    const int idx = int(pl.item), bh = idx / p.chunks;
    v_amax_cta<T, D>(a, p.chunks, idx % p.chunks, bh % a.heads_k, bh / a.heads_k);
  } else if (sl.kind == kKindK) {
    const bool active = pl.item < p.k_items;
    const int idx = active ? int(pl.item) : 0, bh = idx / p.k_blocks;
    rows_cta<T, D, fp8_k_block(D), parts(kKindK, D)>(
        static_cast<const T*>(a.k), static_cast<uint8_t*>(a.k8), a.k_descale, a.signs, a.seqlen_k, a.heads_k,
        idx % p.k_blocks, pl.part, bh % a.heads_k, bh / a.heads_k, active);
  } else {
    const bool active = pl.item < p.q_items;
    const int idx = active ? int(pl.item) : 0, bh = idx / p.q_blocks;
    rows_cta<T, D, kFp8QBlock, parts(kKindQ, D)>(
        static_cast<const T*>(a.q), static_cast<uint8_t*>(a.q8), a.q_descale, a.signs, a.seqlen_q, a.heads,
        idx % p.q_blocks, pl.part, bh % a.heads, bh / a.heads, active);
  }
}

// Launch 2: V's descales and e4m3 values; CTA (tile, h, b) quantises keys
// [256 tile, 256 (tile + 1)) of (b, h), the grid walked from its end.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 4) v_quant_kernel(const __grid_constant__ Plan p) {
  constexpr int kLanes = VThreads<D>::kLanes, kRows = VThreads<D>::kRows;
  constexpr int kSteps = kVTileKeys / kRows;  // 4, 8, 16
  constexpr int kGroups = kThreads / D;       // threads per channel in the reduction
  static_assert(kSteps % kVUnroll == 0 && kThreads % D == 0, "tiling");
  const PrepassArgs& a = p.a;
  // Backwards through (batch, head, tile): the first CTAs read the keys that
  // launch 1 read last (the most likely still in L2).
  const int tile = gridDim.x - 1 - blockIdx.x, h = gridDim.y - 1 - blockIdx.y, b = gridDim.z - 1 - blockIdx.z;
  const int64_t bh = int64_t(b) * a.heads_k + h;

  __shared__ float red[kThreads];
  __shared__ float inv_s[D];
  {
    const int d = threadIdx.x % D, g = threadIdx.x / D;
    const float* part = a.v_partial + bh * p.chunks * D + d;
    float m = 0.f;
#pragma unroll 8
    for (int c = g; c < p.chunks; c += kGroups) m = fmaxf(m, part[int64_t(c) * D]);
    red[threadIdx.x] = m;
  }
  __syncthreads();
  if (threadIdx.x < D) {
    float m = red[threadIdx.x];
#pragma unroll
    for (int g = 1; g < kGroups; ++g) m = fmaxf(m, red[g * D + threadIdx.x]);
    float descale, inv;
    scales(m, descale, inv);
    inv_s[threadIdx.x] = inv;
    if (tile == 0) a.v_descale[bh * D + threadIdx.x] = descale;
  }
  __syncthreads();

  const int j = threadIdx.x % kLanes, r = threadIdx.x / kLanes;
  float inv[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) inv[i] = inv_s[16 * j + i];
  const int64_t row_stride = int64_t(a.heads_k) * D;
  const int64_t first = (int64_t(b) * a.seqlen_k * a.heads_k + h) * D + 16 * j;
  const T* __restrict__ src = static_cast<const T*>(a.v) + first;
  uint8_t* __restrict__ dst = static_cast<uint8_t*>(a.v8) + first;
  const int key0 = tile * kVTileKeys + r;
  const uint64_t policy = evict_first();  // V's last read, V8's only write
#pragma unroll
  for (int s0 = 0; s0 < kSteps; s0 += kVUnroll) {
    uint4 raw[kVUnroll][2];
#pragma unroll
    for (int u = 0; u < kVUnroll; ++u) {
      const int key = key0 + (s0 + u) * kRows;
      if (key < a.seqlen_k) {
        raw[u][0] = load_once(src + key * row_stride, policy);
        raw[u][1] = load_once(src + key * row_stride + 8, policy);
      }
    }
#pragma unroll
    for (int u = 0; u < kVUnroll; ++u) {
      const int key = key0 + (s0 + u) * kRows;
      if (key >= a.seqlen_k) continue;
      float x[16];
      unpack16<T>(raw[u], x);
      const uint2 lo = e4m3x8(x, inv), hi = e4m3x8(x + 8, inv + 8);
      store_once(dst + key * row_stride, make_uint4(lo.x, lo.y, hi.x, hi.y), policy);
    }
  }
}

// CTA counts of launch 1 (int64: checked against the grid's limit).
struct Counts {
  int64_t chunks, k_blocks, q_blocks, k_items, q_items, v_ctas, k_units, q_units, v_units;
  int64_t ctas() const { return kClusterCtas * (k_units + q_units + v_units); }  // launch 1
};

Counts counts(const PrepassArgs& a) {
  Counts c;
  c.chunks = v_chunks(a.seqlen_k);
  const int k_block = fp8_k_block(a.head_dim);  // prepass_supported: one of the scheme's head dims
  c.k_blocks = (int64_t(a.seqlen_k) + k_block - 1) / k_block;
  c.q_blocks = (int64_t(a.seqlen_q) + kFp8QBlock - 1) / kFp8QBlock;
  c.k_items = int64_t(a.batch) * a.heads_k * c.k_blocks;
  c.q_items = int64_t(a.batch) * a.heads * c.q_blocks;
  c.v_ctas = int64_t(a.batch) * a.heads_k * c.chunks;
  c.k_units = units(c.k_items, kKindK, a.head_dim);
  c.q_units = units(c.q_items, kKindQ, a.head_dim);
  c.v_units = units(c.v_ctas, kKindV, a.head_dim);
  return c;
}

template <typename T, int D>
cudaError_t launch(const PrepassArgs& a, cudaStream_t stream) {
  const Counts c = counts(a);
  const Plan p{a,
               int(c.chunks),
               int(c.k_blocks),
               int(c.q_blocks),
               int(c.k_items),
               int(c.q_items),
               int(c.v_ctas),
               int(c.k_units),
               int(c.q_units)};
  if (c.ctas() > 0) {
    prepass_kernel<T, D><<<unsigned(c.ctas()), kThreads, 0, stream>>>(p);  // a multiple of the cluster
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  }
  if (int64_t(a.batch) * a.heads_k > 0) {
    // At least one tile: the first writes the descales (1 for no keys).
    const int tiles = a.seqlen_k > 0 ? (a.seqlen_k + kVTileKeys - 1) / kVTileKeys : 1;
    v_quant_kernel<T, D><<<dim3(tiles, a.heads_k, a.batch), kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dtype(const PrepassArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: return launch<T, 64>(a, stream);
    case 128: return launch<T, 128>(a, stream);
    case 256: return launch<T, 256>(a, stream);
    default: return cudaErrorNotSupported;
  }
}

// A tensor of `elements` values at p: none, or 16-byte aligned.
bool aligned(const void* p, int64_t elements) {
  return elements == 0 || (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0);
}

}  // namespace

bool prepass_supported(const PrepassArgs& a) {
  if (a.batch < 0 || a.seqlen_q < 0 || a.seqlen_k < 0 || a.heads < 0 || a.heads_k < 0) return false;
  if (a.head_dim != 64 && a.head_dim != 128 && a.head_dim != 256) return false;
  if (a.dtype != DType::kBFloat16 && a.dtype != DType::kFloat16) return false;
  if (a.batch > 65535 || a.heads_k > 65535) return false;  // launch 2's grid
  const Counts c = counts(a);
  if (c.ctas() > INT_MAX) return false;  // launch 1's grid
  const int64_t nq = int64_t(a.batch) * a.seqlen_q * a.heads * a.head_dim;
  const int64_t nk = int64_t(a.batch) * a.seqlen_k * a.heads_k * a.head_dim;
  return aligned(a.q, nq) && aligned(a.q8, nq) && aligned(a.k, nk) && aligned(a.k8, nk) &&
         aligned(a.v, nk) && aligned(a.v8, nk) && (c.q_items == 0 || a.q_descale != nullptr) &&
         (c.k_items == 0 || a.k_descale != nullptr) &&
         (int64_t(a.batch) * a.heads_k == 0 || a.v_descale != nullptr) &&
         (c.v_ctas == 0 || a.v_partial != nullptr);
}

cudaError_t prepass(const PrepassArgs& a, cudaStream_t stream) {
  if (!prepass_supported(a)) return cudaErrorNotSupported;
  return a.dtype == DType::kBFloat16 ? launch_dtype<__nv_bfloat16>(a, stream)
                                     : launch_dtype<__half>(a, stream);
}

}  // namespace jax_flash::fp8
