// The FP8 pre-pass kernels (quantize.h: what they compute, the two launches
// and the workspace rule). Arithmetic as quantize.py: float32 throughout, IEEE
// divisions for the scales (not the fast-math approximation),
// round-to-nearest-even e4m3 after clipping to +-448.
//
// Launch 1 (prepass_kernel): a 1-D grid of V CTAs, then K CTAs, then Q CTAs
// (the longest first):
//   V: CTA (chunk c, head, batch) covers keys [c L, (c + 1) L), L =
//      ceil(seqlen_k / v_chunks), and writes their per-channel max |v| to
//      v_partial[batch, head, c, :];
//   K, Q: CTA (block, head, batch) quantises fp8_k_block(D) (K) or 64 (Q)
//      rows of a head: rotation, block amax, descale, e4m3.
// Launch 2 (v_quant_kernel): CTA (256 keys, head, batch) takes the max of the
// v_chunks partial rows of its (batch, head), writes the descales (the CTA of
// keys 0..255) and quantises its keys: each thread 16 channels of a key row,
// two 16-byte loads and one 16-byte store.
#include "quantize.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <climits>
#include <cstring>

#include "jax_flash/fp8_scheme.h"

namespace jax_flash::fp8 {
namespace {

constexpr float kE4M3Max = 448.f;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr int kVTileKeys = 256;   // keys per CTA of launch 2
constexpr int kVUnroll = 4;       // key rows in flight per thread (V)

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

__device__ __forceinline__ uint32_t e4m3(float x) {
  x = fminf(fmaxf(x, -kE4M3Max), kE4M3Max);
  return uint32_t(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
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

// N consecutive 16-bit values at src (aligned to 2 N bytes) as floats, one load.
template <typename T, int N>
__device__ __forceinline__ void load_floats(const T* src, float (&v)[N]) {
  static_assert(N == 2 || N == 4 || N == 8, "N");
  uint32_t w[N / 2];
  if constexpr (N == 2) {
    w[0] = *reinterpret_cast<const uint32_t*>(src);
  } else if constexpr (N == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(src);
    w[0] = u.x;
    w[1] = u.y;
  } else {
    const uint4 u = *reinterpret_cast<const uint4*>(src);
    w[0] = u.x;
    w[1] = u.y;
    w[2] = u.z;
    w[3] = u.w;
  }
#pragma unroll
  for (int i = 0; i < N / 2; ++i) unpack2<T>(w[i], v[2 * i], v[2 * i + 1]);
}

// e4m3(v[i] * inv) for N consecutive bytes at dst (aligned to N), one store.
template <int N>
__device__ __forceinline__ void store_e4m3(uint8_t* dst, const float (&v)[N], float inv) {
  static_assert(N == 2 || N == 4 || N == 8, "N");
  uint32_t w[(N + 3) / 4] = {};
#pragma unroll
  for (int i = 0; i < N; ++i) w[i / 4] |= e4m3(v[i] * inv) << (8 * (i % 4));
  if constexpr (N == 2) {
    *reinterpret_cast<uint16_t*>(dst) = uint16_t(w[0]);
  } else if constexpr (N == 4) {
    *reinterpret_cast<uint32_t*>(dst) = w[0];
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  }
}

// Walsh-Hadamard transform (Sylvester order, unnormalised) of a row held as
// E consecutive elements per lane (element d = E * lane + e): butterflies of
// stride < E inside the thread, the others across lanes.
template <int E>
__device__ __forceinline__ void fwht(float (&v)[E], int lane) {
#pragma unroll
  for (int h = 1; h < E; h *= 2)
#pragma unroll
    for (int i = 0; i < E; ++i)
      if ((i & h) == 0) {
        const float a = v[i], b = v[i + h];
        v[i] = a + b;
        v[i + h] = a - b;
      }
#pragma unroll
  for (int m = 1; m < 32; m *= 2) {
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float o = __shfl_xor_sync(kFull, v[e], m);
      v[e] = upper ? o - v[e] : v[e] + o;
    }
  }
}

// What launch 1 needs beyond the arguments: the CTA counts of each kind.
struct Plan {
  PrepassArgs a;
  int chunks;                  // v_chunks(seqlen_k)
  int k_blocks, q_blocks;      // row blocks per head
  int v_ctas, k_ctas, q_ctas;  // launch 1: V, then K, then Q CTAs
};

// BLOCK rows of head h of x [batch, n, heads, D] from row blk * BLOCK: warp w
// holds rows w, w + 8, ... (R of them), each lane E consecutive elements.
template <typename T, int D, int BLOCK>
__device__ __forceinline__ void rows_cta(const T* __restrict__ x, uint8_t* __restrict__ x8,
                                         float* __restrict__ descale_out, const float* signs, int n,
                                         int heads, int blk, int h, int b) {
  constexpr int E = D / 32;
  constexpr int R = BLOCK / kWarps;
  constexpr float kNorm = D == 64 ? 0.125f : D == 128 ? 0.08838834764831845f : 0.0625f;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool rotate = signs != nullptr;
  float sg[E];
#pragma unroll
  for (int e = 0; e < E; ++e) sg[e] = rotate ? signs[E * lane + e] : 1.f;

  const int64_t stride = int64_t(heads) * D;  // between rows
  const int64_t first = (int64_t(b) * n * heads + h) * D + E * lane;
  const int row0 = blk * BLOCK + warp;
  float v[R][E];
  float amax = 0.f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + r * kWarps;
    if (row < n) {
      load_floats<T, E>(x + first + row * stride, v[r]);
      if (rotate) {
#pragma unroll
        for (int e = 0; e < E; ++e) v[r][e] *= sg[e];
        fwht(v[r], lane);
#pragma unroll
        for (int e = 0; e < E; ++e) v[r][e] *= kNorm;
      }
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) v[r][e] = 0.f;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(v[r][e]));
  }
  __shared__ float warp_amax[kWarps];
  amax = warp_max(amax);
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads();
  amax = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) amax = fmaxf(amax, warp_amax[w]);
  float descale, inv;
  scales(amax, descale, inv);
  if (threadIdx.x == 0) {
    const int nb = (n + BLOCK - 1) / BLOCK;
    descale_out[(int64_t(b) * heads + h) * nb + blk] = descale;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = row0 + r * kWarps;
    if (row >= n) continue;
    store_e4m3<E>(x8 + first + row * stride, v[r], inv);
  }
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
__global__ void __launch_bounds__(kThreads) prepass_kernel(const __grid_constant__ Plan p) {
  const PrepassArgs& a = p.a;
  int idx = blockIdx.x;
  if (idx < p.v_ctas) {
    const int bh = idx / p.chunks;
    v_amax_cta<T, D>(a, p.chunks, idx % p.chunks, bh % a.heads_k, bh / a.heads_k);
    return;
  }
  idx -= p.v_ctas;
  if (idx < p.k_ctas) {
    const int bh = idx / p.k_blocks;
    rows_cta<T, D, fp8_k_block(D)>(static_cast<const T*>(a.k), static_cast<uint8_t*>(a.k8), a.k_descale,
                            a.signs, a.seqlen_k, a.heads_k, idx % p.k_blocks, bh % a.heads_k,
                            bh / a.heads_k);
    return;
  }
  idx -= p.k_ctas;
  const int bh = idx / p.q_blocks;
  rows_cta<T, D, kFp8QBlock>(static_cast<const T*>(a.q), static_cast<uint8_t*>(a.q8), a.q_descale,
                          a.signs, a.seqlen_q, a.heads, idx % p.q_blocks, bh % a.heads,
                          bh / a.heads);
}

// Launch 2: V's descales and e4m3 values; CTA (tile, h, b) quantises keys
// [256 tile, 256 (tile + 1)) of (b, h).
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) v_quant_kernel(const __grid_constant__ Plan p) {
  constexpr int kLanes = VThreads<D>::kLanes, kRows = VThreads<D>::kRows;
  constexpr int kSteps = kVTileKeys / kRows;  // 4, 8, 16
  constexpr int kGroups = kThreads / D;       // threads per channel in the reduction
  static_assert(kSteps % kVUnroll == 0 && kThreads % D == 0, "tiling");
  const PrepassArgs& a = p.a;
  const int tile = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
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
#pragma unroll
  for (int s0 = 0; s0 < kSteps; s0 += kVUnroll) {
    uint4 raw[kVUnroll][2];
#pragma unroll
    for (int u = 0; u < kVUnroll; ++u) {
      const int key = key0 + (s0 + u) * kRows;
      if (key < a.seqlen_k) load16(src + key * row_stride, raw[u]);
    }
#pragma unroll
    for (int u = 0; u < kVUnroll; ++u) {
      const int key = key0 + (s0 + u) * kRows;
      if (key >= a.seqlen_k) continue;
      float x[16];
      unpack16<T>(raw[u], x);
      uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int i = 0; i < 16; ++i) w[i / 4] |= e4m3(x[i] * inv[i]) << (8 * (i % 4));
      *reinterpret_cast<uint4*>(dst + key * row_stride) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
}

// CTA counts of launch 1 (int64: checked against the grid's limit).
struct Counts {
  int64_t chunks, k_blocks, q_blocks, v_ctas, k_ctas, q_ctas;
};

Counts counts(const PrepassArgs& a) {
  Counts c;
  c.chunks = v_chunks(a.seqlen_k);
  const int k_block = fp8_k_block(a.head_dim);  // prepass_supported: one of the scheme's head dims
  c.k_blocks = (int64_t(a.seqlen_k) + k_block - 1) / k_block;
  c.q_blocks = (int64_t(a.seqlen_q) + kFp8QBlock - 1) / kFp8QBlock;
  c.v_ctas = int64_t(a.batch) * a.heads_k * c.chunks;
  c.k_ctas = int64_t(a.batch) * a.heads_k * c.k_blocks;
  c.q_ctas = int64_t(a.batch) * a.heads * c.q_blocks;
  return c;
}

template <typename T, int D>
cudaError_t launch(const PrepassArgs& a, cudaStream_t stream) {
  const Counts c = counts(a);
  const Plan p{a,
               int(c.chunks),
               int(c.k_blocks),
               int(c.q_blocks),
               int(c.v_ctas),
               int(c.k_ctas),
               int(c.q_ctas)};
  const int64_t ctas = c.v_ctas + c.k_ctas + c.q_ctas;
  if (ctas > 0) {
    prepass_kernel<T, D><<<unsigned(ctas), kThreads, 0, stream>>>(p);
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
  if (c.v_ctas + c.k_ctas + c.q_ctas > INT_MAX) return false;  // launch 1's grid
  const int64_t nq = int64_t(a.batch) * a.seqlen_q * a.heads * a.head_dim;
  const int64_t nk = int64_t(a.batch) * a.seqlen_k * a.heads_k * a.head_dim;
  return aligned(a.q, nq) && aligned(a.q8, nq) && aligned(a.k, nk) && aligned(a.k8, nk) &&
         aligned(a.v, nk) && aligned(a.v8, nk) && (c.q_ctas == 0 || a.q_descale != nullptr) &&
         (c.k_ctas == 0 || a.k_descale != nullptr) &&
         (int64_t(a.batch) * a.heads_k == 0 || a.v_descale != nullptr) &&
         (c.v_ctas == 0 || a.v_partial != nullptr);
}

cudaError_t prepass(const PrepassArgs& a, cudaStream_t stream) {
  if (!prepass_supported(a)) return cudaErrorNotSupported;
  return a.dtype == DType::kBFloat16 ? launch_dtype<__nv_bfloat16>(a, stream)
                                     : launch_dtype<__half>(a, stream);
}

}  // namespace jax_flash::fp8
