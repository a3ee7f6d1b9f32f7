// selftest_decode --bench: the decode kernels' time per call on the
// benchmark's shapes (bf16 Q, D=128; benchmarks/bench_decode.py's four with
// 32 query heads on 8 KV heads, and two more head layouts: 64 on 8, and 32
// on 4 with T_new = 4; every cache full; contiguous, or pages of 64 keys
// shuffled), for the bf16 cache as production runs it, the same kernels
// merged by each combine kernel, at each split count of --splits, the FP8
// cache as production runs it, and every variant (decode_variants.cuh),
// each with its own split plan. GPU only. Timing: warm-up, then rounds of
// `iters` back-to-back calls between two events, the entries interleaved
// round by round (alternating order), median over the rounds. Bandwidth
// counts the cache bytes read: 2 bytes per element (bf16), 1 plus a float
// descale per key and head (FP8). A launch that fails is reported and counts
// as a failure.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "decode/decode.h"
#include "decode/decode_plan.h"
#include "decode_variants.cuh"
#include "host_utils.h"

namespace decode_bench {

using jax_flash::decode::DecodeParams;

struct Shape {
  const char* name;
  int B, S, T;
  int page;  // 0: contiguous
  int H, Hk;
};

struct Entry {
  std::string name;
  bool fp8;
  int splits;
  cudaError_t (*launch)(const DecodeParams&, cudaStream_t);
  std::vector<float> us;
};

inline int run(const std::string& filter, int iters, int rounds, const std::vector<int>& split_counts) {
  constexpr int D = 128;
  const Shape shapes[] = {
      {"b8_s32k_t1", 8, 32768, 1, 0, 32, 8},           {"b1_s128k_t1", 1, 131072, 1, 0, 32, 8},
      {"b64_s4k_t1", 64, 4096, 1, 0, 32, 8},           {"b8_s32k_t8", 8, 32768, 8, 0, 32, 8},
      {"b16_h64_s16k_t1", 16, 16384, 1, 0, 64, 8},     {"b4_kv4_s64k_t4", 4, 65536, 4, 0, 32, 4},
      {"b8_s32k_t1_paged64", 8, 32768, 1, 64, 32, 8},  {"b1_s128k_t1_paged64", 1, 131072, 1, 64, 32, 8},
      {"b8_s32k_t8_paged64", 8, 32768, 8, 64, 32, 8},  {"b16_h64_s16k_t1_paged64", 16, 16384, 1, 64, 64, 8},
      {"b4_kv4_s64k_t4_paged64", 4, 65536, 4, 64, 32, 4},
      // One layer of examples/generate.py's decoding step (16 heads, MHA).
      {"b8_h16kv16_s4k_t1", 8, 4096, 1, 0, 16, 16}};
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount, smem = int(prop.sharedMemPerMultiprocessor);
  std::printf("device %s: %d SMs, %d KB shared memory per SM; iters %d, rounds %d\n", prop.name, sms,
              smem / 1024, iters, rounds);
  std::printf("%-24s %-28s %6s %9s %9s %8s\n", "shape", "kernel", "splits", "us", "GB/s", "vs bf16");
  int failed = 0;
  for (const Shape& sh : shapes) {
    const int H = sh.H, Hk = sh.Hk;
    if (!filter.empty() && std::string(sh.name).find(filter) == std::string::npos) continue;
    const int ps = sh.page > 0 ? sh.page : sh.S;
    const int max_pages = sh.S / ps, num_pages = sh.B * max_pages;
    const size_t elems = size_t(num_pages) * ps * Hk * D;
    const size_t rows = size_t(sh.B) * H * sh.T;
    std::vector<int32_t> table(size_t(sh.B) * max_pages);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(7));
    // Values do not change the time: bf16 0x3C3C (~0.011), e4m3 0x38 (1.0),
    // descales 0x3F3F3F3F (~0.75).
    void *k16, *v16, *k8, *v8, *q, *o, *kds, *vds, *op, *lp, *tab, *len;
    CHECK_CUDA(cudaMalloc(&k16, elems * 2));
    CHECK_CUDA(cudaMalloc(&v16, elems * 2));
    CHECK_CUDA(cudaMalloc(&k8, elems));
    CHECK_CUDA(cudaMalloc(&v8, elems));
    CHECK_CUDA(cudaMalloc(&kds, elems / D * 4));
    CHECK_CUDA(cudaMalloc(&vds, elems / D * 4));
    CHECK_CUDA(cudaMalloc(&q, rows * D * 2));
    CHECK_CUDA(cudaMalloc(&o, rows * D * 2));
    CHECK_CUDA(cudaMalloc(&op, size_t(jax_flash::decode::kDecodeMaxSplits) * rows * D * 4));
    CHECK_CUDA(cudaMalloc(&lp, size_t(jax_flash::decode::kDecodeMaxSplits) * rows * 4));
    CHECK_CUDA(cudaMalloc(&tab, table.size() * 4));
    CHECK_CUDA(cudaMalloc(&len, sh.B * 4));
    CHECK_CUDA(cudaMemset(k16, 0x3C, elems * 2));
    CHECK_CUDA(cudaMemset(v16, 0x3C, elems * 2));
    CHECK_CUDA(cudaMemset(k8, 0x38, elems));
    CHECK_CUDA(cudaMemset(v8, 0x38, elems));
    CHECK_CUDA(cudaMemset(kds, 0x3F, elems / D * 4));
    CHECK_CUDA(cudaMemset(vds, 0x3F, elems / D * 4));
    CHECK_CUDA(cudaMemset(q, 0x3C, rows * D * 2));
    CHECK_CUDA(cudaMemcpy(tab, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    std::vector<int32_t> lens(sh.B, sh.S);
    CHECK_CUDA(cudaMemcpy(len, lens.data(), sh.B * 4, cudaMemcpyHostToDevice));

    DecodeParams base{};
    base.q = q;
    base.o = o;
    base.q_head_stride = base.o_head_stride = D;
    base.q_row_stride = base.o_row_stride = int64_t(H) * D;
    base.q_batch_stride = base.o_batch_stride = int64_t(sh.T) * H * D;
    base.kv_head_stride = D;
    base.kv_row_stride = int64_t(Hk) * D;
    base.kv_page_stride = int64_t(ps) * Hk * D;
    base.page_table = static_cast<int32_t*>(tab);
    base.seqlens = static_cast<int32_t*>(len);
    base.batch = sh.B;
    base.seqlen_q = sh.T;
    base.num_heads = H;
    base.num_heads_k = Hk;
    base.head_dim = D;
    base.num_pages = num_pages;
    base.page_size = ps;
    base.max_pages = max_pages;
    base.window_left = -1;
    base.window_right = sh.T > 1 ? 0 : -1;
    base.dtype = jax_flash::DType::kBFloat16;
    base.o_partial = static_cast<float*>(op);
    base.lse_partial = static_cast<float*>(lp);
    float* lse_final = nullptr;
    CHECK_CUDA(cudaMalloc(&lse_final, rows * 4));
    base.lse = lse_final;

    const int64_t bh = int64_t(sh.B) * Hk;
    using jax_flash::decode::CombineKind;
    const int bf16_splits = jax_flash::decode::decode_num_splits(bh, sh.T, H / Hk, sh.S, D, sms, smem, false);
    std::vector<Entry> entries;
    entries.push_back({"bf16 (production)", false, bf16_splits, jax_flash::decode::run_decode, {}});
    if (bf16_splits > 1) {
      entries.push_back({"bf16 combine warp/row", false, bf16_splits,
                         decode_variants::launch_with_combine<CombineKind::kWarpPerRow>, {}});
      entries.push_back({"bf16 combine cta/row", false, bf16_splits,
                         decode_variants::launch_with_combine<CombineKind::kCtaPerRow>, {}});
    }
    for (int n : split_counts) {
      if (n == bf16_splits || n < 1 || n > jax_flash::decode::kDecodeMaxSplits) continue;
      entries.push_back({"bf16 splits " + std::to_string(n), false, n, jax_flash::decode::run_decode, {}});
      if (n > 1)
        entries.push_back({"bf16 splits " + std::to_string(n) + " cta/row", false, n,
                           decode_variants::launch_with_combine<CombineKind::kCtaPerRow>, {}});
    }
    entries.push_back({"fp8 (production)", true,
                       jax_flash::decode::decode_num_splits(bh, sh.T, H / Hk, sh.S, D, sms, smem, true),
                       jax_flash::decode::run_decode, {}});
    for (const decode_variants::Variant& v : decode_variants::kVariants)
      entries.push_back({v.name, v.fp8,
                         decode_variants::variant_num_splits(v, bh, sh.T, H / Hk, sh.S, sms, smem), v.launch,
                         {}});
    auto params = [&](const Entry& e) {
      DecodeParams p = base;
      p.kv_fp8 = e.fp8;
      p.k = e.fp8 ? k8 : k16;
      p.v = e.fp8 ? v8 : v16;
      p.kv_page_stride = int64_t(ps) * Hk * D;  // elements: bytes for e4m3
      p.k_descale = static_cast<float*>(kds);
      p.v_descale = static_cast<float*>(vds);
      p.q_scale = 1.f / std::sqrt(float(D));
      p.sm = jax_flash::make_softmax_scale(e.fp8 ? 1.f : 1.f / std::sqrt(float(D)), 0.f);
      p.num_splits = e.splits;
      return p;
    };
    std::vector<bool> ok(entries.size(), true);
    for (size_t i = 0; i < entries.size(); ++i)  // warm-up, and the launch check
      for (int w = 0; w < 3; ++w) ok[i] = ok[i] && entries[i].launch(params(entries[i]), nullptr) == cudaSuccess;
    CHECK_CUDA(cudaDeviceSynchronize());
    cudaEvent_t t0, t1;
    CHECK_CUDA(cudaEventCreate(&t0));
    CHECK_CUDA(cudaEventCreate(&t1));
    for (int r = 0; r < rounds; ++r)
      for (size_t n = 0; n < entries.size(); ++n) {
        const size_t i = r % 2 ? entries.size() - 1 - n : n;
        if (!ok[i]) continue;
        const DecodeParams p = params(entries[i]);
        CHECK_CUDA(cudaEventRecord(t0));
        for (int it = 0; it < iters; ++it) entries[i].launch(p, nullptr);
        CHECK_CUDA(cudaEventRecord(t1));
        CHECK_CUDA(cudaEventSynchronize(t1));
        float ms = 0.f;
        CHECK_CUDA(cudaEventElapsedTime(&ms, t0, t1));
        entries[i].us.push_back(ms * 1000.f / iters);
      }
    CHECK_CUDA(cudaGetLastError());
    const double keys = double(sh.B) * sh.S * Hk;
    float bf16_us = 0.f;
    for (size_t i = 0; i < entries.size(); ++i) {
      Entry& e = entries[i];
      if (!ok[i]) {
        std::printf("%-24s %-28s %6d %9s %9s %8s\n", sh.name, e.name.c_str(), e.splits, "-", "-", "FAILED");
        ++failed;
        continue;
      }
      std::sort(e.us.begin(), e.us.end());
      const float us = e.us[e.us.size() / 2];
      if (i == 0) bf16_us = us;
      const double bytes = e.fp8 ? keys * 2 * (D + 4) : keys * 2 * D * 2;
      std::printf("%-24s %-28s %6d %9.1f %9.0f %7.2fx\n", sh.name, e.name.c_str(), e.splits, us,
                  bytes / (us * 1e3), bf16_us / us);
    }
    std::fflush(stdout);
    CHECK_CUDA(cudaEventDestroy(t0));
    CHECK_CUDA(cudaEventDestroy(t1));
    for (void* ptr : {k16, v16, k8, v8, kds, vds, q, o, op, lp, tab, len, (void*)lse_final}) CHECK_CUDA(cudaFree(ptr));
  }
  return failed;
}

}  // namespace decode_bench
