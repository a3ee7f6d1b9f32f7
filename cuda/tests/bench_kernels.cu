// Kernel-level timing of the sm80 family without JAX: forward, backward (the
// whole run_bwd: dq_accum zeroing, main kernel, dQ conversion) and the
// deterministic backward, at the benchmark shapes. Used to tune the kernels
// and as the launch target for ncu; the user-facing figures come from
// benchmarks/bench_attention.py (through JAX, next to cuDNN).
//
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90,code=sm_90 \
//     -Icuda/include -Icuda cuda/tests/bench_kernels.cu cuda/sm80/dispatch.cu \
//     cuda/instantiations/*_sm80.cu -o bench_kernels
//   ./bench_kernels            # table
//   ./bench_kernels --once     # one fwd + one bwd at D=128 (for ncu)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "jax_flash/params.h"
#include "sm80/launch.h"

using jax_flash::BwdParams;
using jax_flash::DType;
using jax_flash::FwdParams;

#define CHECK_CUDA(x)                                                                     \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorName(e_), __FILE__, __LINE__); \
      std::exit(2);                                                                       \
    }                                                                                     \
  } while (0)

struct Shape {
  int B, T, S, H, D;
  bool causal;
};

// Random bf16 values (normal, stddev 1) uploaded to a new device buffer.
static void* random_bf16(size_t n, std::mt19937& rng) {
  std::vector<__nv_bfloat16> h(n);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : h) x = __float2bfloat16_rn(nd(rng));
  void* d = nullptr;
  CHECK_CUDA(cudaMalloc(&d, n * 2));
  CHECK_CUDA(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
  return d;
}

// Median over `repeats` of the mean time of `iters` back-to-back calls.
template <typename F>
static double time_ms(F&& f, int iters = 20, int repeats = 5) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) CHECK_CUDA(f());
  std::vector<double> ms;
  for (int r = 0; r < repeats; ++r) {
    CHECK_CUDA(cudaEventRecord(a));
    for (int i = 0; i < iters; ++i) CHECK_CUDA(f());
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t / iters);
  }
  std::sort(ms.begin(), ms.end());
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  return ms[ms.size() / 2];
}

static void run_shape(const Shape& s, bool once, std::mt19937& rng) {
  const size_t nq = size_t(s.B) * s.T * s.H * s.D, nk = size_t(s.B) * s.S * s.H * s.D;
  const size_t rows = size_t(s.B) * s.H * s.T;
  const int dr = jax_flash::rounded_head_dim(s.D);
  void *q = random_bf16(nq, rng), *k = random_bf16(nk, rng), *v = random_bf16(nk, rng);
  void *dout = random_bf16(nq, rng), *o, *dq, *dk, *dv;
  float *lse, *delta, *acc;
  CHECK_CUDA(cudaMalloc(&o, nq * 2));
  CHECK_CUDA(cudaMalloc(&dq, nq * 2));
  CHECK_CUDA(cudaMalloc(&dk, nk * 2));
  CHECK_CUDA(cudaMalloc(&dv, nk * 2));
  CHECK_CUDA(cudaMalloc(&lse, rows * 4));
  CHECK_CUDA(cudaMalloc(&delta, rows * 4));
  CHECK_CUDA(cudaMalloc(&acc, size_t(s.B) * s.H * jax_flash::rounded_seqlen(s.T) * dr * 4));

  BwdParams p{};
  p.q = q, p.k = k, p.v = v, p.o = o, p.lse = lse;
  const int64_t rs = int64_t(s.H) * s.D;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = rs;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = s.D;
  p.q_batch_stride = p.o_batch_stride = rs * s.T;
  p.k_batch_stride = p.v_batch_stride = rs * s.S;
  p.batch = s.B, p.seqlen_q = s.T, p.seqlen_k = s.S, p.num_heads = p.num_heads_k = s.H;
  p.head_dim = p.head_dim_v = s.D;
  p.scale = 1.f / std::sqrt(float(s.D));
  p.window_left = -1;
  p.window_right = s.causal ? 0 : -1;
  p.dtype = DType::kBFloat16;
  CHECK_CUDA(cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, 0));
  p.dout = dout, p.delta = delta, p.dq = dq, p.dk = dk, p.dv = dv;
  p.seqlen_q_rounded = jax_flash::rounded_seqlen(s.T);
  p.seqlen_k_rounded = jax_flash::rounded_seqlen(s.S);
  p.head_dim_rounded = dr;
  p.dq_accum = acc;

  // delta = rowsum(dO * O) from a real forward (values matter little for
  // speed, but keep them realistic).
  CHECK_CUDA(jax_flash::sm80::run_fwd(p, 0));
  {
    std::vector<__nv_bfloat16> ho(nq), hdo(nq);
    CHECK_CUDA(cudaMemcpy(ho.data(), o, nq * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(hdo.data(), dout, nq * 2, cudaMemcpyDeviceToHost));
    std::vector<float> hd(rows);
    for (int b = 0; b < s.B; ++b)
      for (int t = 0; t < s.T; ++t)
        for (int h = 0; h < s.H; ++h) {
          float sum = 0;
          const size_t base = ((size_t(b) * s.T + t) * s.H + h) * s.D;
          for (int d = 0; d < s.D; ++d)
            sum += __bfloat162float(ho[base + d]) * __bfloat162float(hdo[base + d]);
          hd[(size_t(b) * s.H + h) * s.T + t] = sum;
        }
    CHECK_CUDA(cudaMemcpy(delta, hd.data(), rows * 4, cudaMemcpyHostToDevice));
  }

  if (once) {
    CHECK_CUDA(jax_flash::sm80::run_fwd(p, 0));
    CHECK_CUDA(jax_flash::sm80::run_bwd(p, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
  } else {
    const double flops = 4.0 * s.B * s.H * double(s.T) * s.S * s.D * (s.causal ? 0.5 : 1.0);
    const double fwd = time_ms([&] { return jax_flash::sm80::run_fwd(p, 0); });
    p.deterministic = false;
    const double bwd = time_ms([&] { return jax_flash::sm80::run_bwd(p, 0); });
    p.deterministic = true;
    const double bwd_det = time_ms([&] { return jax_flash::sm80::run_bwd(p, 0); });
    p.deterministic = false;
    std::printf("B%d T%d S%d H%d D%d %-7s fwd %7.3f ms %6.1f TF/s | bwd %7.3f ms %6.1f TF/s | "
                "bwd det %7.3f ms %6.1f TF/s | fwd+bwd %6.1f TF/s\n",
                s.B, s.T, s.S, s.H, s.D, s.causal ? "causal" : "", fwd, flops / fwd * 1e-9, bwd,
                2.5 * flops / bwd * 1e-9, bwd_det, 2.5 * flops / bwd_det * 1e-9,
                3.5 * flops / (fwd + bwd) * 1e-9);
  }
  for (void* ptr : {q, k, v, dout, o, dq, dk, dv}) CHECK_CUDA(cudaFree(ptr));
  for (float* ptr : {lse, delta, acc}) CHECK_CUDA(cudaFree(ptr));
}

int main(int argc, char** argv) {
  const bool once = argc > 1 && std::string(argv[1]) == "--once";
  std::mt19937 rng(7);
  if (once) {
    run_shape({2, 8192, 8192, 16, 128, false}, true, rng);
    return 0;
  }
  for (bool causal : {false, true}) {
    run_shape({2, 8192, 8192, 16, 128, causal}, false, rng);
    run_shape({2, 8192, 8192, 32, 64, causal}, false, rng);
    run_shape({2, 8192, 8192, 8, 256, causal}, false, rng);
  }
  return 0;
}
