// The FP8 pre-pass kernels (quantize.h). Arithmetic as quantize.py: float32
// throughout, IEEE divisions for the scales (not the fast-math approximation),
// round-to-nearest-even e4m3 after clipping to +-448.
#include "quantize.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace jax_flash::fp8 {
namespace {

constexpr float kE4M3Max = 448.f;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

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

// One CTA per (block of BLOCK rows, head, batch); warp w holds rows w, w + 8, ...
template <typename T, int D, int BLOCK>
__global__ void __launch_bounds__(kThreads) rows_kernel(RowsArgs a) {
  constexpr int E = D / 32;
  constexpr int R = BLOCK / kWarps;
  constexpr float kNorm = D == 64 ? 0.125f : D == 128 ? 0.08838834764831845f : 0.0625f;
  const int blk = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* x = static_cast<const T*>(a.x);
  const bool rotate = a.signs != nullptr;
  float sg[E];
#pragma unroll
  for (int e = 0; e < E; ++e) sg[e] = rotate ? a.signs[E * lane + e] : 1.f;

  float v[R][E];
  float amax = 0.f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = blk * BLOCK + r * kWarps + warp;
    if (row < a.n) {
      const T* src = x + ((int64_t(b) * a.n + row) * a.heads + h) * D + E * lane;
#pragma unroll
      for (int e = 0; e < E; ++e) v[r][e] = to_float(src[e]);
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
    const int nb = (a.n + BLOCK - 1) / BLOCK;
    a.descale[(int64_t(b) * a.heads + h) * nb + blk] = descale;
  }
  uint8_t* out = static_cast<uint8_t*>(a.x8);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int row = blk * BLOCK + r * kWarps + warp;
    if (row >= a.n) continue;
    uint8_t* dst = out + ((int64_t(b) * a.n + row) * a.heads + h) * D + E * lane;
#pragma unroll
    for (int e0 = 0; e0 < E; e0 += 2) {
      const uint32_t pair = e4m3(v[r][e0] * inv) | (e4m3(v[r][e0 + 1] * inv) << 8);
      *reinterpret_cast<uint16_t*>(dst + e0) = uint16_t(pair);
    }
  }
}

// Per-channel amax of V over the sequence: one CTA per (256 keys, head,
// batch), atomicMax on the (non-negative) float bits.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) v_amax_kernel(ChannelsArgs a) {
  constexpr int E = D / 32;
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* v = static_cast<const T*>(a.v);
  float m[E] = {};
  for (int i = 0; i < 256 / kWarps; ++i) {
    const int key = blockIdx.x * 256 + i * kWarps + warp;
    if (key >= a.s) break;
    const T* src = v + ((int64_t(b) * a.s + key) * a.heads + h) * D + E * lane;
#pragma unroll
    for (int e = 0; e < E; ++e) m[e] = fmaxf(m[e], fabsf(to_float(src[e])));
  }
  __shared__ float part[kWarps][D];
#pragma unroll
  for (int e = 0; e < E; ++e) part[warp][E * lane + e] = m[e];
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float x = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) x = fmaxf(x, part[w][d]);
    atomicMax(a.amax + (int64_t(b) * a.heads + h) * D + d, __float_as_uint(x));
  }
}

// Physical key (within a group of 32) at logical position k (scheme.py).
__device__ __forceinline__ int v_key(int k) {
  return 16 * (k / 16) + 8 * ((k % 4) / 2) + 2 * ((k % 16) / 4) + k % 2;
}

// V quantised per channel and written transposed with permuted keys: one CTA
// per (128 keys, head, batch); the tile goes through shared memory.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) v_quant_kernel(ChannelsArgs a) {
  constexpr int E = D / 32;
  constexpr int kKeys = 128;
  constexpr int kPitch = D + 4;  // bytes per key row (spreads the column reads over banks)
  __shared__ uint8_t tile[kKeys * kPitch];
  __shared__ float inv_s[D];
  const int h = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t bh = int64_t(b) * a.heads + h;
  for (int d = threadIdx.x; d < D; d += kThreads) {
    float descale, inv;
    scales(__uint_as_float(a.amax[bh * D + d]), descale, inv);
    inv_s[d] = inv;
    if (blockIdx.x == 0) a.descale[bh * D + d] = descale;
  }
  __syncthreads();
  const int key0 = blockIdx.x * kKeys;
  const T* v = static_cast<const T*>(a.v);
  for (int i = 0; i < kKeys / kWarps; ++i) {
    const int r = i * kWarps + warp, key = key0 + r;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int d = E * lane + e;
      const float x = key < a.s ? to_float(v[((int64_t(b) * a.s + key) * a.heads + h) * D + d]) : 0.f;
      tile[r * kPitch + d] = uint8_t(e4m3(x * inv_s[d]));
    }
  }
  __syncthreads();
  const int quads = min(kKeys, a.s_pad - key0) / 4;  // s_pad % 32 == 0
  uint8_t* out = static_cast<uint8_t*>(a.vt8);
  for (int idx = threadIdx.x; idx < D * quads; idx += kThreads) {
    const int d = idx / quads, k0 = 4 * (idx % quads);
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int k = k0 + j;
      word |= uint32_t(tile[(32 * (k / 32) + v_key(k % 32)) * kPitch + d]) << (8 * j);
    }
    *reinterpret_cast<uint32_t*>(out + (bh * D + d) * a.s_pad + key0 + k0) = word;
  }
}

template <typename T, int D>
cudaError_t rows_launch(const RowsArgs& a, cudaStream_t stream) {
  const dim3 grid((a.n + a.block - 1) / a.block, a.heads, a.batch);
  if (a.block == 64) {
    rows_kernel<T, D, 64><<<grid, kThreads, 0, stream>>>(a);
  } else {
    rows_kernel<T, D, 128><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t rows_dtype(const RowsArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: return rows_launch<T, 64>(a, stream);
    case 128: return rows_launch<T, 128>(a, stream);
    case 256: return rows_launch<T, 256>(a, stream);
    default: return cudaErrorNotSupported;
  }
}

template <typename T, int D>
cudaError_t v_launch(const ChannelsArgs& a, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(a.amax, 0, sizeof(uint32_t) * size_t(a.batch) * a.heads * D, stream);
  if (err != cudaSuccess) return err;
  if (a.s > 0) {
    v_amax_kernel<T, D><<<dim3((a.s + 255) / 256, a.heads, a.batch), kThreads, 0, stream>>>(a);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  const int blocks = a.s_pad > 0 ? (a.s_pad + 127) / 128 : 1;  // block 0 writes the descales
  v_quant_kernel<T, D><<<dim3(blocks, a.heads, a.batch), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t v_dtype(const ChannelsArgs& a, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: return v_launch<T, 64>(a, stream);
    case 128: return v_launch<T, 128>(a, stream);
    case 256: return v_launch<T, 256>(a, stream);
    default: return cudaErrorNotSupported;
  }
}

bool dims_ok(int batch, int n, int heads, int head_dim) {
  return batch >= 0 && n >= 0 && heads >= 0 && (head_dim == 64 || head_dim == 128 || head_dim == 256) &&
         batch <= 65535 && heads <= 65535;
}

}  // namespace

bool quantize_rows_supported(const RowsArgs& a) {
  return dims_ok(a.batch, a.n, a.heads, a.head_dim) && (a.block == 64 || a.block == 128) &&
         (a.dtype == DType::kBFloat16 || a.dtype == DType::kFloat16) && a.x != nullptr &&
         a.x8 != nullptr && a.descale != nullptr;
}

cudaError_t quantize_rows(const RowsArgs& a, cudaStream_t stream) {
  if (!quantize_rows_supported(a)) return cudaErrorNotSupported;
  if (a.batch == 0 || a.heads == 0 || a.n == 0) return cudaSuccess;
  return a.dtype == DType::kBFloat16 ? rows_dtype<__nv_bfloat16>(a, stream) : rows_dtype<__half>(a, stream);
}

bool quantize_v_supported(const ChannelsArgs& a) {
  return dims_ok(a.batch, a.s, a.heads, a.head_dim) && a.s_pad >= a.s && a.s_pad % 32 == 0 &&
         (a.dtype == DType::kBFloat16 || a.dtype == DType::kFloat16) && a.v != nullptr &&
         a.vt8 != nullptr && a.descale != nullptr && a.amax != nullptr;
}

cudaError_t quantize_v(const ChannelsArgs& a, cudaStream_t stream) {
  if (!quantize_v_supported(a)) return cudaErrorNotSupported;
  if (a.batch == 0 || a.heads == 0) return cudaSuccess;
  return a.dtype == DType::kBFloat16 ? v_dtype<__nv_bfloat16>(a, stream) : v_dtype<__half>(a, stream);
}

}  // namespace jax_flash::fp8
