// Unit tests of the sm90 building blocks, one at a time, so that one GPU run
// says which piece is wrong: TMA loads (2-d, 3-d, the kernel's own 4-d
// [batch, seq, heads, head_dim] maps) into 128B-swizzled shared memory with
// out-of-bounds zero fill, TMA store with clipping, wgmma SS (K-major A and B,
// the S = Q K^T shapes; also with A read into registers by ldmatrix and fed
// to wgmma RS, the forward's Q in registers), wgmma RS with an MN-major B (the
// O = P V shapes), the accumulator -> A-fragment conversion (S -> P -> O
// chain), an mbarrier ring driven by TMA over several phases, and
// named-barrier turn taking between two warpgroups after setmaxnreg.
//
// Inputs are quarter-integers: every product and sum is exact in fp32 and the
// 16-bit roundings are deterministic, so results must match the CPU exactly.
//
// Build (repository root; or tools/build/build_sm90_tests.sh):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a
//        -Icuda/include -Icuda cuda/tests/sm90_primitives.cu -o sm90_primitives
// Run: ./sm90_primitives [filter]; exit code 1 on any failure.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "sm90/fwd/fwd_named_barriers.h"  // the pingpong test uses the forward's barrier ids
#include "sm90/common/tma_desc.h"  // encode_bshd, tensor_map_encoder
#include "sm90/ptx/barrier.cuh"
#include "sm90/ptx/mbarrier.cuh"
#include "sm90/ptx/tma.cuh"
#include "sm90/ptx/wgmma.cuh"
#include "sm90/common/smem_layout.cuh"
#include "host_utils.h"

using namespace jax_flash;
using namespace jax_flash::sm90;
using namespace jax_flash::sm90::ptx;

// ------------------------------------------------------------------ host helpers
// CHECK_CUDA, to_bits / from_bits(.., fp16): host_utils.h; here by element type.
template <typename E>
static uint16_t to_bits(float x) {
  return to_bits(x, std::is_same<E, __half>::value);
}
template <typename E>
static float from_bits(uint16_t b) {
  return from_bits(b, std::is_same<E, __half>::value);
}

// Quarter-integers in [-2, 2].
static std::vector<float> quarter_ints(size_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> d(-8, 8);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng) * 0.25f;
  return v;
}

template <typename T>
static T* to_device(const std::vector<T>& h) {
  T* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(h.size(), 1) * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}
template <typename T>
static std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Generic pointer of a shared-window address inside the dynamic smem array.
__device__ __forceinline__ char* smem_ptr(char* raw, uint32_t addr) {
  return raw + (addr - smem_u32(raw));
}

// ================================================================== TMA load
// Loads one box into (1 KB-aligned) shared memory that was poisoned first, and
// copies the raw bytes out.
__global__ void k_tma_load(const __grid_constant__ CUtensorMap map, int rank, int c0, int c1, int c2,
                           int c3, uint32_t bytes, uint32_t* out) {
  extern __shared__ __align__(1024) char raw[];
  const uint32_t base = (smem_u32(raw) + 1023u) & ~1023u;
  const uint32_t bar = base + 65536;
  uint32_t* tile = reinterpret_cast<uint32_t*>(smem_ptr(raw, base));
  for (uint32_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) tile[i] = 0xDEADBEEFu;
  fence_proxy_async_smem();  // generic writes before the async-proxy (TMA) writes
  if (threadIdx.x == 0) {
    mbar_init(bar, 1);
    mbar_fence_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbar_arrive_expect_tx(bar, bytes);
    if (rank == 2) tma_load_2d(&map, bar, base, c0, c1);
    if (rank == 3) tma_load_3d(&map, bar, base, c0, c1, c2);
    if (rank == 4) tma_load_4d(&map, bar, base, c0, c1, c2, c3);
  }
  mbar_wait(bar, 0);
  for (uint32_t i = threadIdx.x; i < bytes / 4; i += blockDim.x) out[i] = tile[i];
}

struct Result {
  bool pass;
  std::string detail;
};

static CUtensorMap encode_plain(int rank, void* ptr, const cuuint64_t* dims, const cuuint64_t* strides,
                                const cuuint32_t* box) {
  CUtensorMap map;
  cuuint32_t es[5] = {1, 1, 1, 1, 1};
  const CUresult r = tensor_map_encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, ptr, dims,
                                          strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                          CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", int(r));
    std::exit(2);
  }
  return map;
}

// Compares a loaded box (box_rows x 64 elements) with expect(r, c) (0 when
// out of bounds) at the 128B-swizzle position.
static Result check_box(const std::vector<uint32_t>& got32, int box_rows,
                        const std::function<uint16_t(int, int)>& expect) {
  const uint16_t* got = reinterpret_cast<const uint16_t*>(got32.data());
  int bad = 0, oob_bad = 0;
  char first[160] = "";
  for (int r = 0; r < box_rows; ++r)
    for (int c = 0; c < 64; ++c) {
      const uint16_t e = expect(r, c);
      const uint16_t g = got[sw128_offset<64>(r, c) / 2];  // one 64-column block
      if (g != e) {
        if (bad == 0)
          std::snprintf(first, sizeof(first), "first bad (r=%d,c=%d): got %04x want %04x", r, c, g, e);
        ++bad;
        if (e == 0) ++oob_bad;
      }
    }
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%d mismatches (%d in zero-fill) %s", bad, oob_bad, first);
  return {bad == 0, buf};
}

static Result test_tma_2d() {
  // 100 x 72 matrix, row pitch 80 elements; box 64 x 64 at (col 64, row 64):
  // cols 72..127 and rows 100..127 are out of bounds.
  const int R = 100, C = 72, P = 80;
  std::vector<uint16_t> g(size_t(R) * P, 0x7FC0);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) g[size_t(r) * P + c] = uint16_t(r * 131 + c + 1);
  uint16_t* dg = to_device(g);
  cuuint64_t dims[2] = {cuuint64_t(C), cuuint64_t(R)}, strides[1] = {cuuint64_t(P) * 2};
  cuuint32_t box[2] = {64, 64};
  CUtensorMap map = encode_plain(2, dg, dims, strides, box);
  uint32_t* dout;
  CHECK_CUDA(cudaMalloc(&dout, 8192));
  CHECK_CUDA(cudaFuncSetAttribute(k_tma_load, cudaFuncAttributeMaxDynamicSharedMemorySize, 70000));
  k_tma_load<<<1, 128, 70000>>>(map, 2, 64, 64, 0, 0, 8192, dout);
  CHECK_CUDA(cudaDeviceSynchronize());
  auto out = to_host(dout, 2048);
  CHECK_CUDA(cudaFree(dg));
  CHECK_CUDA(cudaFree(dout));
  return check_box(out, 64, [&](int r, int c) -> uint16_t {
    const int gr = 64 + r, gc = 64 + c;
    return (gr < R && gc < C) ? g[size_t(gr) * P + gc] : 0;
  });
}

static Result test_tma_3d() {
  // [3][50][64] with row pitch 72 and batch pitch 50*72+8; box {64, 32, 1} at
  // (0, row 32, batch 2): rows 50..63 out of bounds.
  const int B = 3, R = 50, C = 64, P = 72, BP = R * P + 8;
  std::vector<uint16_t> g(size_t(B) * BP, 0x7FC0);
  for (int b = 0; b < B; ++b)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) g[size_t(b) * BP + r * P + c] = uint16_t(b * 7919 + r * 67 + c + 1);
  uint16_t* dg = to_device(g);
  cuuint64_t dims[3] = {cuuint64_t(C), cuuint64_t(R), cuuint64_t(B)};
  cuuint64_t strides[2] = {cuuint64_t(P) * 2, cuuint64_t(BP) * 2};
  cuuint32_t box[3] = {64, 32, 1};
  CUtensorMap map = encode_plain(3, dg, dims, strides, box);
  uint32_t* dout;
  CHECK_CUDA(cudaMalloc(&dout, 4096));
  k_tma_load<<<1, 128, 70000>>>(map, 3, 0, 32, 2, 0, 4096, dout);
  CHECK_CUDA(cudaDeviceSynchronize());
  auto out = to_host(dout, 1024);
  CHECK_CUDA(cudaFree(dg));
  CHECK_CUDA(cudaFree(dout));
  return check_box(out, 32, [&](int r, int c) -> uint16_t {
    const int gr = 32 + r;
    return gr < R ? g[size_t(2) * BP + gr * P + c] : 0;
  });
}

// The kernel's own map builder: [B=2][T=37][H=3][D=40], row pitch H*D + 8,
// box {64, 64}: rows >= 37 and columns >= 40 must come back as 0, and the
// (batch 1, head 2) slice must be the one loaded.
static Result test_tma_4d_bshd() {
  const int B = 2, T = 37, H = 3, D = 40, RS = H * D + 8;
  const int64_t BS = int64_t(T) * RS;
  std::vector<uint16_t> g(size_t(B) * BS, 0x7FC0);
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) g[b * BS + t * RS + h * D + d] = uint16_t(1 + b * 4001 + t * 97 + h * 41 + d);
  uint16_t* dg = to_device(g);
  CUtensorMap map;
  if (!encode_bshd(&map, DType::kBFloat16, dg, D, T, H, B, RS, D, BS, 64))
    return {false, "encode_bshd failed"};
  uint32_t* dout;
  CHECK_CUDA(cudaMalloc(&dout, 8192));
  k_tma_load<<<1, 128, 70000>>>(map, 4, 0, 0, 2, 1, 8192, dout);
  CHECK_CUDA(cudaDeviceSynchronize());
  auto out = to_host(dout, 2048);
  CHECK_CUDA(cudaFree(dg));
  CHECK_CUDA(cudaFree(dout));
  return check_box(out, 64, [&](int r, int c) -> uint16_t {
    return (r < T && c < D) ? g[1 * BS + r * RS + 2 * D + c] : 0;
  });
}

// ================================================================== TMA store
// Fills a 64 x 64 swizzled tile with value(r, c) = r * 64 + c + 1 and stores it
// with the 4-d map at (0, 0, head 2, batch 1) of [2][37][3][40]: only rows < 37,
// columns < 40 of that slice may change.
__global__ void k_tma_store(const __grid_constant__ CUtensorMap map) {
  extern __shared__ __align__(1024) char raw[];
  const uint32_t base = (smem_u32(raw) + 1023u) & ~1023u;
  for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x) {
    const int r = i / 64, c = i % 64;
    *reinterpret_cast<uint16_t*>(smem_ptr(raw, base + sw128_offset<64>(r, c))) = uint16_t(r * 64 + c + 1);
  }
  fence_proxy_async_smem();
  __syncthreads();
  if (threadIdx.x == 0) {
    tma_store_4d(&map, base, 0, 0, 2, 1);
    bulk_commit();
    bulk_wait<0>();
  }
}

static Result test_tma_store() {
  const int B = 2, T = 37, H = 3, D = 40, RS = H * D + 8;
  const int64_t BS = int64_t(T) * RS;
  const size_t n = size_t(B) * BS;
  uint16_t* dg;
  CHECK_CUDA(cudaMalloc(&dg, n * 2));
  CHECK_CUDA(cudaMemset(dg, 0xFF, n * 2));
  CUtensorMap map;
  if (!encode_bshd(&map, DType::kBFloat16, dg, D, T, H, B, RS, D, BS, 64))
    return {false, "encode_bshd failed"};
  CHECK_CUDA(cudaFuncSetAttribute(k_tma_store, cudaFuncAttributeMaxDynamicSharedMemorySize, 70000));
  k_tma_store<<<1, 128, 70000>>>(map);
  CHECK_CUDA(cudaDeviceSynchronize());
  auto got = to_host(dg, n);
  CHECK_CUDA(cudaFree(dg));
  int bad = 0;
  for (int b = 0; b < B; ++b)
    for (int t = 0; t < T; ++t)
      for (int x = 0; x < RS; ++x) {
        const int h = x / D, d = x % D;
        const bool inside = b == 1 && h == 2 && x < H * D;
        const uint16_t want = inside ? uint16_t(t * 64 + d + 1) : 0xFFFF;
        bad += got[b * BS + t * RS + x] != want;
      }
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%d wrong elements (written or clobbered)", bad);
  return {bad == 0, buf};
}

// ================================================================== wgmma
// Writes a rows x cols row-major 16-bit matrix into a [cols/64][rows][64]
// swizzled tile at `base` (all threads of the block).
template <int kRows>
__device__ void fill_tile(char* raw, uint32_t base, const uint16_t* m, int cols) {
  for (int i = threadIdx.x; i < kRows * cols; i += blockDim.x) {
    const int r = i / cols, c = i % cols;
    *reinterpret_cast<uint16_t*>(smem_ptr(raw, base + sw128_offset<kRows>(r, c))) = m[i];
  }
}

template <int kRows>
struct KMajorStep {
  __device__ uint32_t operator()(int kk) const { return (kk / 4) * kRows * 128 + (kk % 4) * 32; }
};
struct MNMajorStep {
  __device__ uint32_t operator()(int kk) const { return kk * 16 * 128; }
};

// Stores a 64 x N accumulator fragment (documented layout) row-major.
template <int NR>
__device__ void store_acc(const float (&d)[NR], float* out, int n) {
  const int w = (threadIdx.x % 128) / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < NR / 4; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 2; ++e) out[(16 * w + g + 8 * h) * n + 8 * j + 2 * t + e] = d[4 * j + 2 * h + e];
}

// D[64 x N] = A[a_row0 : a_row0 + 64, :K] * B[N x K]^T; A tile has MA rows
// (the kernel's Q tile with a warpgroup's row offset), both K-major.
// A (MA x K) and B (N x K) as K-major swizzled tiles at sa = the 1 KB-aligned
// base and sb = right after A, visible to wgmma (the setup of both S = Q K^T
// tests below).
template <int N, int K, int MA>
__device__ void fill_a_b_kmajor(char* raw, const uint16_t* A, const uint16_t* B, uint32_t& sa,
                                uint32_t& sb) {
  sa = (smem_u32(raw) + 1023u) & ~1023u;
  sb = sa + MA * K * 2;
  fill_tile<MA>(raw, sa, A, K);
  fill_tile<N>(raw, sb, B, K);
  fence_proxy_async_smem();
  __syncthreads();
}

template <typename E, int N, int K, int MA>
__global__ void k_wgmma_ss(const uint16_t* A, int a_row0, const uint16_t* B, float* D) {
  extern __shared__ __align__(1024) char raw[];
  uint32_t sa, sb;
  fill_a_b_kmajor<N, K, MA>(raw, A, B, sa, sb);
  float d[N / 2];
  wgmma_fence();
  gemm_ss<E, N, 0, K / 16>(d, make_desc(kDescKMajor, sa + a_row0 * 128), make_desc(kDescKMajor, sb),
                           KMajorStep<MA>{}, KMajorStep<N>{}, true);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(d);
  store_acc(d, D, N);
}

// O[64 x N] = P[64 x K] * V[K x N]; P from registers (A fragments built from
// global memory with the documented layout), V MN-major in shared memory.
template <typename E, int N, int K>
__global__ void k_wgmma_rs(const uint16_t* P, const uint16_t* V, float* O) {
  extern __shared__ __align__(1024) char raw[];
  const uint32_t base = (smem_u32(raw) + 1023u) & ~1023u;
  fill_tile<K>(raw, base, V, N);
  fence_proxy_async_smem();
  __syncthreads();
  const int w = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  uint32_t a[K / 16][4];
  auto pair = [&](int r, int c) { return uint32_t(P[r * K + c]) | (uint32_t(P[r * K + c + 1]) << 16); };
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const int r = 16 * w + g, c = 16 * kk + 2 * t;
    a[kk][0] = pair(r, c);
    a[kk][1] = pair(r + 8, c);
    a[kk][2] = pair(r, c + 8);
    a[kk][3] = pair(r + 8, c + 8);
  }
  float o[N / 2];
  fence_regs(a);
  wgmma_fence();
  gemm_rs<E, N, 1, K / 16>(o, a, make_desc(desc_mn_major<K>(), base), MNMajorStep{}, true);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(o);
  fence_regs(a);
  store_acc(o, O, N);
}

// D[64 x N] = A[a_row0 : a_row0 + 64, :K] * B[N x K]^T as k_wgmma_ss, but A's
// fragments read from the swizzled tile by load_a_sw128 (ldmatrix) and fed to
// wgmma RS with a K-major B: the forward's Q-in-registers S = Q K^T
// (FwdTuning::q_in_regs).
template <typename E, int N, int K, int MA>
__global__ void k_wgmma_rs_ldsm(const uint16_t* A, int a_row0, const uint16_t* B, float* D) {
  extern __shared__ __align__(1024) char raw[];
  uint32_t sa, sb;
  fill_a_b_kmajor<N, K, MA>(raw, A, B, sa, sb);
  uint32_t a[K / 16][4];
  load_a_sw128<MA>(a, sa, a_row0);
  float d[N / 2];
  wgmma_fence();
  gemm_rs<E, N, 0, K / 16>(d, a, make_desc(kDescKMajor, sb), KMajorStep<N>{}, true);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(d);
  fence_regs(a);
  store_acc(d, D, N);
}

// S = Q K^T (SS), P = acc_to_a(S) (16-bit), O = P V (RS): the forward's chain
// without the softmax. Also writes S.
template <typename E, int BN, int HD>
__global__ void k_chain(const uint16_t* Q, const uint16_t* Kt, const uint16_t* V, float* S, float* O) {
  extern __shared__ __align__(1024) char raw[];
  const uint32_t base = (smem_u32(raw) + 1023u) & ~1023u;
  const uint32_t sq = base, sk = sq + 64 * HD * 2, sv = sk + BN * HD * 2;
  fill_tile<64>(raw, sq, Q, HD);
  fill_tile<BN>(raw, sk, Kt, HD);
  fill_tile<BN>(raw, sv, V, HD);
  fence_proxy_async_smem();
  __syncthreads();
  float s[BN / 2];
  wgmma_fence();
  gemm_ss<E, BN, 0, HD / 16>(s, make_desc(kDescKMajor, sq), make_desc(kDescKMajor, sk), KMajorStep<64>{},
                             KMajorStep<BN>{}, true);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(s);
  store_acc(s, S, BN);
  uint32_t p[BN / 16][4];
  acc_to_a<E>(s, p);
  float o[HD / 2];
  fence_regs(p);
  wgmma_fence();
  gemm_rs<E, HD, 1, BN / 16>(o, p, make_desc(desc_mn_major<BN>(), sv), MNMajorStep{}, true);
  wgmma_commit();
  wgmma_wait<0>();
  fence_regs(o);
  fence_regs(p);
  store_acc(o, O, HD);
}

// Exact arithmetic is expected; the relative 1e-6 only forgives a tensor-core
// accumulator narrower than fp32 (a layout bug gives errors of order 1).
static Result compare(const std::vector<float>& got, const std::vector<double>& want) {
  double e = 0, wmax = 1;
  int bad = 0, first = -1;
  for (double w : want) wmax = std::max(wmax, std::fabs(w));
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::fabs(double(got[i]) - want[i]);
    if (!(d <= 1e-6 * wmax)) {
      if (first < 0) first = int(i);
      ++bad;
    }
    e = std::isnan(d) ? INFINITY : std::max(e, d);
  }
  char buf[160];
  if (bad)
    std::snprintf(buf, sizeof(buf), "%d mismatches, max err %.3g; first at %d: got %g want %g", bad, e,
                  first, got[first], want[first]);
  else
    std::snprintf(buf, sizeof(buf), "exact (%zu values)", want.size());
  return {bad == 0, buf};
}

template <typename E, int N, int K, int MA, bool kRsLdsm = false>
static Result test_wgmma_ss(int a_row0) {
  std::mt19937 rng(N * 1000 + K + MA + a_row0);
  auto af = quarter_ints(size_t(MA) * K, rng), bf = quarter_ints(size_t(N) * K, rng);
  std::vector<uint16_t> a(af.size()), b(bf.size());
  for (size_t i = 0; i < af.size(); ++i) a[i] = to_bits<E>(af[i]);
  for (size_t i = 0; i < bf.size(); ++i) b[i] = to_bits<E>(bf[i]);
  std::vector<double> want(64 * N);
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n) {
      double acc = 0;
      for (int k = 0; k < K; ++k) acc += double(af[(a_row0 + m) * K + k]) * bf[n * K + k];
      want[m * N + n] = acc;
    }
  uint16_t *da = to_device(a), *db = to_device(b);
  float* dd;
  CHECK_CUDA(cudaMalloc(&dd, 64 * N * 4));
  CHECK_CUDA(cudaMemset(dd, 0xFF, 64 * N * 4));
  const int smem = (MA + N) * K * 2 + 1024;
  auto kernel = k_wgmma_ss<E, N, K, MA>;
  if constexpr (kRsLdsm) kernel = k_wgmma_rs_ldsm<E, N, K, MA>;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<1, 128, smem>>>(da, a_row0, db, dd);
  CHECK_CUDA(cudaDeviceSynchronize());
  auto got = to_host(dd, 64 * N);
  CHECK_CUDA(cudaFree(da));
  CHECK_CUDA(cudaFree(db));
  CHECK_CUDA(cudaFree(dd));
  return compare(got, want);
}

template <typename E, int N, int K>
static Result test_wgmma_rs() {
  std::mt19937 rng(N * 77 + K);
  auto pf = quarter_ints(size_t(64) * K, rng), vf = quarter_ints(size_t(K) * N, rng);
  std::vector<uint16_t> p(pf.size()), v(vf.size());
  for (size_t i = 0; i < pf.size(); ++i) p[i] = to_bits<E>(pf[i]);
  for (size_t i = 0; i < vf.size(); ++i) v[i] = to_bits<E>(vf[i]);
  std::vector<double> want(64 * N);
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n) {
      double acc = 0;
      for (int k = 0; k < K; ++k) acc += double(pf[m * K + k]) * vf[k * N + n];
      want[m * N + n] = acc;
    }
  uint16_t *dp = to_device(p), *dv = to_device(v);
  float* dd;
  CHECK_CUDA(cudaMalloc(&dd, 64 * N * 4));
  CHECK_CUDA(cudaMemset(dd, 0xFF, 64 * N * 4));
  const int smem = K * N * 2 + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(k_wgmma_rs<E, N, K>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k_wgmma_rs<E, N, K><<<1, 128, smem>>>(dp, dv, dd);
  CHECK_CUDA(cudaDeviceSynchronize());
  auto got = to_host(dd, 64 * N);
  CHECK_CUDA(cudaFree(dp));
  CHECK_CUDA(cudaFree(dv));
  CHECK_CUDA(cudaFree(dd));
  return compare(got, want);
}

template <typename E, int BN, int HD>
static Result test_chain() {
  std::mt19937 rng(BN * 31 + HD);
  auto qf = quarter_ints(size_t(64) * HD, rng), kf = quarter_ints(size_t(BN) * HD, rng),
       vf = quarter_ints(size_t(BN) * HD, rng);
  std::vector<uint16_t> q(qf.size()), k(kf.size()), v(vf.size());
  for (size_t i = 0; i < qf.size(); ++i) q[i] = to_bits<E>(qf[i]);
  for (size_t i = 0; i < kf.size(); ++i) k[i] = to_bits<E>(kf[i]);
  for (size_t i = 0; i < vf.size(); ++i) v[i] = to_bits<E>(vf[i]);
  std::vector<double> want_s(64 * BN), want_o(64 * HD, 0.0);
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < BN; ++n) {
      double acc = 0;
      for (int d = 0; d < HD; ++d) acc += double(qf[m * HD + d]) * kf[n * HD + d];
      want_s[m * BN + n] = acc;
    }
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < BN; ++n) {
      const double p16 = from_bits<E>(to_bits<E>(float(want_s[m * BN + n])));  // exact S, rounded once
      for (int d = 0; d < HD; ++d) want_o[m * HD + d] += p16 * vf[n * HD + d];
    }
  uint16_t *dq = to_device(q), *dk = to_device(k), *dv = to_device(v);
  float *ds, *dout;
  CHECK_CUDA(cudaMalloc(&ds, 64 * BN * 4));
  CHECK_CUDA(cudaMalloc(&dout, 64 * HD * 4));
  const int smem = (64 + 2 * BN) * HD * 2 + 1024;
  CHECK_CUDA(cudaFuncSetAttribute(k_chain<E, BN, HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k_chain<E, BN, HD><<<1, 128, smem>>>(dq, dk, dv, ds, dout);
  CHECK_CUDA(cudaDeviceSynchronize());
  auto gs = to_host(ds, 64 * BN), go = to_host(dout, 64 * HD);
  for (void* ptr : {(void*)dq, (void*)dk, (void*)dv, (void*)ds, (void*)dout}) CHECK_CUDA(cudaFree(ptr));
  Result rs = compare(gs, want_s), ro = compare(go, want_o);
  return {rs.pass && ro.pass, "S: " + rs.detail + "; O: " + ro.detail};
}

// ================================================================== mbarrier ring
// One producer thread streams kIters 64 x 64 tiles through a ring of kStages
// slots with TMA; 4 consumer warps check every element of every tile and
// release the slot (one arrival per warp), like the forward's K/V pipeline.
constexpr int kRingStages = 3, kRingIters = 20;
__global__ void k_ring(const __grid_constant__ CUtensorMap map, int* errors, int* order) {
  extern __shared__ __align__(1024) char raw[];
  const uint32_t base = (smem_u32(raw) + 1023u) & ~1023u;
  const uint32_t bars = base + kRingStages * 8192;
  auto full = [&](int s) { return bars + 8 * s; };
  auto empty = [&](int s) { return bars + 8 * (kRingStages + s); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kRingStages; ++s) {
      mbar_init(full(s), 1);
      mbar_init(empty(s), 4);
    }
    mbar_fence_init();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 4) {  // producer
    if (lane == 0) {
      PipeState<kRingStages> st;
      for (int i = 0; i < kRingIters; ++i) {
        mbar_wait(empty(st.index), st.phase ^ 1u);
        mbar_arrive_expect_tx(full(st.index), 8192);
        tma_load_2d(&map, full(st.index), base + st.index * 8192, 0, 64 * i);
        st.advance();
      }
    }
  } else {
    PipeState<kRingStages> st;
    for (int i = 0; i < kRingIters; ++i) {
      mbar_wait(full(st.index), st.phase);
      const char* tile = smem_ptr(raw, base + st.index * 8192);
      int bad = 0;
      for (int e = threadIdx.x; e < 4096; e += 128) {
        const int r = e / 64, c = e % 64;
        const uint16_t v = *reinterpret_cast<const uint16_t*>(tile + sw128_offset<64>(r, c));
        bad += v != uint16_t((64 * i + r) * 64 + c);
      }
      if (bad) atomicAdd(errors, bad);
      if (threadIdx.x == 0) order[i] = st.index * 2 + int(st.phase);
      __syncwarp();
      if (lane == 0) mbar_arrive(empty(st.index));
      st.advance();
    }
  }
}

static Result test_ring() {
  const int R = 64 * kRingIters;
  std::vector<uint16_t> g(size_t(R) * 64);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 64; ++c) g[size_t(r) * 64 + c] = uint16_t(r * 64 + c);
  uint16_t* dg = to_device(g);
  cuuint64_t dims[2] = {64, cuuint64_t(R)}, strides[1] = {128};
  cuuint32_t box[2] = {64, 64};
  CUtensorMap map = encode_plain(2, dg, dims, strides, box);
  int *derr, *dorder;
  CHECK_CUDA(cudaMalloc(&derr, 4));
  CHECK_CUDA(cudaMalloc(&dorder, 4 * kRingIters));
  CHECK_CUDA(cudaMemset(derr, 0, 4));
  const int smem = kRingStages * 8192 + 1024 + 256;
  CHECK_CUDA(cudaFuncSetAttribute(k_ring, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k_ring<<<1, 160, smem>>>(map, derr, dorder);
  CHECK_CUDA(cudaDeviceSynchronize());
  const int err = to_host(derr, 1)[0];
  auto order = to_host(dorder, kRingIters);
  CHECK_CUDA(cudaFree(dg));
  CHECK_CUDA(cudaFree(derr));
  CHECK_CUDA(cudaFree(dorder));
  int bad_order = 0;
  for (int i = 0; i < kRingIters; ++i)
    bad_order += order[i] != (i % kRingStages) * 2 + (i / kRingStages) % 2;
  char buf[128];
  std::snprintf(buf, sizeof(buf), "%d wrong elements, %d wrong (slot, phase) over %d iterations x %d stages",
                err, bad_order, kRingIters, kRingStages);
  return {err == 0 && bad_order == 0, buf};
}

// ================================================================== pingpong
// 384 threads: WG0 setmaxnreg.dec<24> (and idles), WG1/WG2 setmaxnreg.inc<240>
// and take turns through the forward's scheduler barriers (ids kBarSched + wg,
// 256 threads, the first turn given by WG1 to itself). Each turn appends the
// WG's number to a log; it must read 1 2 1 2 ...
constexpr int kTurns = 16;
__global__ void __launch_bounds__(384, 1) k_pingpong(int* log) {
  __shared__ int slog[2 * kTurns];
  __shared__ int count;
  if (threadIdx.x == 0) count = 0;
  __syncthreads();
  const int warp = warp_id_uniform();
  if (warp < 4) {
    setmaxnreg_dec<24>();
  } else {
    setmaxnreg_inc<240>();
    const int wg = warp / 4 - 1;
    if (wg == 0) named_bar_arrive(kBarSched + 0, 256);
    for (int i = 0; i < kTurns; ++i) {
      named_bar_sync(kBarSched + wg, 256);
      if (threadIdx.x % 128 == 0) {
        const int c = count;  // only the turn holder touches count
        slog[c] = wg + 1;
        count = c + 1;
        __threadfence_block();
      }
      named_bar_arrive(kBarSched + (wg == 0 ? 1 : 0), 256);
    }
    named_bar_sync(kBarEpilogue, 256);  // both consumer WGs done
    if (threadIdx.x == 128)
      for (int i = 0; i < 2 * kTurns; ++i) log[i] = slog[i];
  }
}

static Result test_pingpong() {
  int* dlog;
  CHECK_CUDA(cudaMalloc(&dlog, 4 * 2 * kTurns));
  CHECK_CUDA(cudaMemset(dlog, 0, 4 * 2 * kTurns));
  k_pingpong<<<1, 384>>>(dlog);
  CHECK_CUDA(cudaDeviceSynchronize());
  auto log = to_host(dlog, 2 * kTurns);
  CHECK_CUDA(cudaFree(dlog));
  std::string s;
  int bad = 0;
  for (int i = 0; i < 2 * kTurns; ++i) {
    s += char('0' + log[i]);
    bad += log[i] != 1 + (i % 2);
  }
  return {bad == 0, "turns " + s};
}

// ================================================================== main
int main(int argc, char** argv) {
  const std::string filter = argc > 1 ? argv[1] : "";
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  if (prop.major != 9 || prop.minor != 0) {
    std::printf("needs an sm_90 GPU (the tests are built for sm_90a)\n");
    return 1;
  }
  struct T {
    const char* name;
    std::function<Result()> fn;
  };
  const std::vector<T> tests = {
      {"tma_load_2d swizzle128 + OOB", test_tma_2d},
      {"tma_load_3d swizzle128 + OOB", test_tma_3d},
      {"tma_load_4d encode_bshd (T,D tails)", test_tma_4d_bshd},
      {"tma_store_4d encode_bshd clipping", test_tma_store},
      {"wgmma_ss bf16 m64n64  K=128", [] { return test_wgmma_ss<__nv_bfloat16, 64, 128, 64>(0); }},
      {"wgmma_ss bf16 m64n128 K=128", [] { return test_wgmma_ss<__nv_bfloat16, 128, 128, 64>(0); }},
      {"wgmma_ss bf16 m64n80  K=256", [] { return test_wgmma_ss<__nv_bfloat16, 80, 256, 64>(0); }},
      {"wgmma_ss bf16 m64n176 K=128", [] { return test_wgmma_ss<__nv_bfloat16, 176, 128, 64>(0); }},
      {"wgmma_ss bf16 m64n192 K=64", [] { return test_wgmma_ss<__nv_bfloat16, 192, 64, 64>(0); }},
      {"wgmma_ss bf16 n128 A rows 64..127", [] { return test_wgmma_ss<__nv_bfloat16, 128, 128, 128>(64); }},
      {"wgmma_ss bf16 n128 A rows 128..191", [] { return test_wgmma_ss<__nv_bfloat16, 128, 64, 192>(128); }},
      {"wgmma_ss fp16 m64n128 K=64", [] { return test_wgmma_ss<__half, 128, 64, 64>(0); }},
      {"wgmma_rs ldsm-A bf16 n128 K128 r64..127",
       [] { return test_wgmma_ss<__nv_bfloat16, 128, 128, 128, true>(64); }},
      {"wgmma_rs ldsm-A fp16 n64 K256 r0..63",
       [] { return test_wgmma_ss<__half, 64, 256, 64, true>(0); }},
      {"wgmma_rs bf16 N=64  K=128 (tnspB)", [] { return test_wgmma_rs<__nv_bfloat16, 64, 128>(); }},
      {"wgmma_rs bf16 N=128 K=128 (tnspB)", [] { return test_wgmma_rs<__nv_bfloat16, 128, 128>(); }},
      {"wgmma_rs bf16 N=256 K=80  (tnspB)", [] { return test_wgmma_rs<__nv_bfloat16, 256, 80>(); }},
      {"wgmma_rs fp16 N=128 K=128 (tnspB)", [] { return test_wgmma_rs<__half, 128, 128>(); }},
      {"chain S=QK^T->P->O=PV bf16 128x128", [] { return test_chain<__nv_bfloat16, 128, 128>(); }},
      {"chain S=QK^T->P->O=PV fp16 128x64", [] { return test_chain<__half, 128, 64>(); }},
      {"chain S=QK^T->P->O=PV bf16 80x256", [] { return test_chain<__nv_bfloat16, 80, 256>(); }},
      {"mbarrier ring 3 stages x 20 (TMA)", test_ring},
      {"setmaxnreg + named-barrier pingpong", test_pingpong},
  };
  int failed = 0, run = 0;
  for (const T& t : tests) {
    if (!filter.empty() && std::string(t.name).find(filter) == std::string::npos) continue;
    const Result r = t.fn();
    ++run;
    failed += !r.pass;
    std::printf("%-40s %s  %s\n", t.name, r.pass ? "PASS" : "FAIL", r.detail.c_str());
    std::fflush(stdout);
  }
  std::printf("%d passed, %d failed\n", run - failed, failed);
  return failed ? 1 : 0;
}
