// The FP8 pre-pass (cuda/fp8/quantize.cu) called directly, without JAX or
// XLA (no command buffers, no other kernel in the process): a small target
// for compute-sanitizer that tells a fault of the pre-pass's kernels from one
// of the stack around them. Shapes of tools/gpu/sanitize_case.py fp8_prepass
// plus one with several waves of clusters, D = 64, 128, 256, rotated and not.
// Outputs are poisoned first (e4m3 0x7f is NaN, which the saturating
// conversion never writes; descales NaN); every byte must be overwritten and
// every descale finite and > 0; without rotation the descales must equal
// amax / 448 of their block (Q, K) or channel (V), computed here.
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -lineinfo --use_fast_math -gencode=arch=compute_90a,code=sm_90a \
//     -Icuda/include -Icuda cuda/tests/fp8_prepass_probe.cu cuda/fp8/quantize.cu -o fp8_prepass_probe
//   timeout 300 compute-sanitizer --tool memcheck --error-exitcode 1 ./fp8_prepass_probe
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "fp8/quantize.h"
#include "jax_flash/fp8_scheme.h"

namespace {

#define CHECK_CUDA(x)                                                            \
  do {                                                                           \
    cudaError_t e_ = (x);                                                        \
    if (e_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                              \
    }                                                                            \
  } while (0)

template <typename T>
T* device_copy(const std::vector<T>& h) {
  T* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, std::max<size_t>(h.size(), 1) * sizeof(T)));
  if (!h.empty()) CHECK_CUDA(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
std::vector<T> host_copy(const T* d, size_t n) {
  std::vector<T> h(n);
  if (n) CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// amax / 448 over rows [r0, r1) of head h of x [batch, n, heads, D] (one
// channel d, or all when d < 0); 1 for an all-zero set.
float descale_of(const std::vector<uint16_t>& x, int n, int heads, int D, int b, int h, int r0, int r1,
                 int d) {
  float m = 0.f;
  for (int r = r0; r < r1 && r < n; ++r)
    for (int c = 0; c < D; ++c)
      if (d < 0 || c == d)
        m = std::fmax(m, std::fabs(bf16_to_float(x[((size_t(b) * n + r) * heads + h) * D + c])));
  return m > 0.f ? m / 448.f : 1.f;
}

// Failures of one call (0: all good).
int run(int B, int T, int S, int H, int Hk, int D, bool rotate, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  auto tensor = [&](size_t n) {
    std::vector<uint16_t> v(n);
    for (auto& x : v) {
      const __nv_bfloat16 b = __float2bfloat16(nd(rng));
      std::memcpy(&x, &b, 2);
    }
    return v;
  };
  const size_t nq = size_t(B) * T * H * D, nk = size_t(B) * S * Hk * D;
  const auto q = tensor(nq), k = tensor(nk), v = tensor(nk);
  std::vector<float> signs(D);
  for (auto& s : signs) s = (rng() & 1) ? 1.f : -1.f;
  const int kb = jax_flash::fp8_k_block(D), qb = jax_flash::kFp8QBlock;
  const size_t nqd = size_t(B) * H * ((T + qb - 1) / qb), nkd = size_t(B) * Hk * ((S + kb - 1) / kb),
               nvd = size_t(B) * Hk * D;
  const size_t nws = jax_flash::fp8::v_partial_elements(B, Hk, S, D);

  jax_flash::fp8::PrepassArgs a{};
  a.q = device_copy(q);
  a.k = device_copy(k);
  a.v = device_copy(v);
  a.dtype = jax_flash::DType::kBFloat16;
  float* d_signs = device_copy(signs);
  a.signs = rotate ? d_signs : nullptr;
  const std::vector<uint8_t> p8q(nq, 0x7f), p8k(nk, 0x7f);
  const std::vector<float> pq(nqd, NAN), pk(nkd, NAN), pv(nvd, NAN), pw(nws, NAN);
  a.q8 = device_copy(p8q);
  a.k8 = device_copy(p8k);
  a.v8 = device_copy(p8k);
  a.q_descale = device_copy(pq);
  a.k_descale = device_copy(pk);
  a.v_descale = device_copy(pv);
  a.v_partial = device_copy(pw);
  a.batch = B, a.seqlen_q = T, a.seqlen_k = S, a.heads = H, a.heads_k = Hk, a.head_dim = D;

  int bad = 0;
  if (!jax_flash::fp8::prepass_supported(a)) {
    std::printf("  not supported\n");
    ++bad;
  } else {
    CHECK_CUDA(jax_flash::fp8::prepass(a, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());
    auto count_poison = [](const std::vector<uint8_t>& x) {
      size_t c = 0;
      for (uint8_t b : x) c += (b & 0x7f) == 0x7f;
      return c;
    };
    const auto q8 = host_copy(static_cast<uint8_t*>(a.q8), nq), k8 = host_copy(static_cast<uint8_t*>(a.k8), nk),
               v8 = host_copy(static_cast<uint8_t*>(a.v8), nk);
    const size_t unwritten = count_poison(q8) + count_poison(k8) + count_poison(v8);
    if (unwritten) std::printf("  %zu e4m3 bytes not written\n", unwritten), ++bad;
    const auto qd = host_copy(a.q_descale, nqd), kd = host_copy(a.k_descale, nkd), vd = host_copy(a.v_descale, nvd);
    size_t nonpos = 0, wrong = 0;
    for (const auto* vec : {&qd, &kd, &vd})
      for (float x : *vec) nonpos += !(std::isfinite(x) && x > 0.f);
    if (!rotate) {
      for (int b = 0; b < B; ++b) {
        for (int h = 0; h < H; ++h)
          for (int i = 0; i * qb < T; ++i)
            wrong += qd[(size_t(b) * H + h) * ((T + qb - 1) / qb) + i] !=
                     descale_of(q, T, H, D, b, h, i * qb, (i + 1) * qb, -1);
        for (int h = 0; h < Hk; ++h) {
          for (int i = 0; i * kb < S; ++i)
            wrong += kd[(size_t(b) * Hk + h) * ((S + kb - 1) / kb) + i] !=
                     descale_of(k, S, Hk, D, b, h, i * kb, (i + 1) * kb, -1);
          for (int d = 0; d < D; ++d)
            wrong += vd[(size_t(b) * Hk + h) * D + d] != descale_of(v, S, Hk, D, b, h, 0, S, d);
        }
      }
    }
    if (nonpos) std::printf("  %zu descales not finite and > 0\n", nonpos), ++bad;
    if (wrong) std::printf("  %zu descales differ from amax / 448\n", wrong), ++bad;
  }
  for (const void* p : {a.q, a.k, a.v, static_cast<const void*>(d_signs), static_cast<const void*>(a.q8),
                        static_cast<const void*>(a.k8), static_cast<const void*>(a.v8),
                        static_cast<const void*>(a.q_descale), static_cast<const void*>(a.k_descale),
                        static_cast<const void*>(a.v_descale), static_cast<const void*>(a.v_partial)})
    CHECK_CUDA(cudaFree(const_cast<void*>(p)));
  return bad;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  struct Shape {
    int B, T, S, H, Hk;
  };
  // sanitize_case.py's (idle CTAs in launch 1's clusters at the second), then
  // more clusters than one wave, GQA.
  const Shape shapes[] = {{1, 200, 333, 2, 2}, {1, 545, 203, 1, 1}, {2, 1000, 2100, 8, 2}};
  int failed = 0;
  for (const Shape& s : shapes)
    for (int D : {64, 128, 256})
      for (bool rotate : {false, true}) {
        const int bad = run(s.B, s.T, s.S, s.H, s.Hk, D, rotate, rng);
        std::printf("B=%d T=%d S=%d H=%d Hk=%d D=%d rotate=%d: %s\n", s.B, s.T, s.S, s.H, s.Hk, D, rotate,
                    bad ? "FAILED" : "ok");
        failed += bad != 0;
      }
  std::printf("%s\n", failed ? "FAILED" : "all ok");
  return failed ? 1 : 0;
}
