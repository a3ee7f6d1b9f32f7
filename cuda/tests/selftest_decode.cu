// Self-test of the decoding kernels (cuda/decode): split-KV, pack-GQA, paged
// and contiguous caches, learnable sinks, against a float64 reference; and
// the append kernel (decode_append.h) that writes new tokens before them.
//
// For each case: random 16-bit Q and cache on the host, every cache slot that
// no sequence may read (past its length, unused pages) NaN, a shuffled page
// table; outputs and split partials poisoned (0xFF bytes = NaN) before the
// launch; O (relative to the largest reference magnitude) and LSE (absolute)
// against float64. Exit code 1 if any case fails.
//
// GPU build (repository root; ~1 minute on one core):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90,code=sm_90 \
//     -Icuda/include -Icuda cuda/tests/selftest_decode.cu cuda/decode/*.cu -o selftest_decode
// On the CPU: cuda/tests/emu/build_emu.sh builds it as selftest_decode_emu.
// Options: ./selftest_decode [filter-substring] [--quick]
//   ./selftest_decode --bench [shape filter] [--iters N] [--rounds N]
//   [--splits 8,16,33]: time per call of the bf16 cache (production, each
//   combine kernel, and the extra split counts), the FP8 cache and the
//   kernel variants (decode_bench.h; GPU only).
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "decode/decode.h"
#include "decode/decode_append.h"
#include "decode/decode_plan.h"
#include "decode_variants.cuh"
#include "host_utils.h"
#ifndef JAX_FLASH_HOST_EMULATION
#include "decode_bench.h"
#endif

using jax_flash::DType;
using jax_flash::decode::DecodeParams;

namespace {

struct Case {
  std::string name;
  int B, T, H, Hk, D;
  int page_size;  // 0: contiguous cache [B_cache, S_max, Hk, D]
  int capacity;   // keys per sequence the cache can hold
  std::vector<int> seqlens;
  int splits = 1;
  int wl = -1, wr = -1;  // causal: wr = 0
  float softcap = 0.f;
  bool fp16 = false;
  bool fp8 = false;  // an e4m3 cache with a descale per (key, head)
  // Learnable sinks: random [B, H] logits ~ N(sink_mean, 2^2) (jax_flash/sinks.h).
  bool sinks = false;
  float sink_mean = 0.f;
  // The last T keys of each sequence arrive as k_new / v_new, written by the
  // append kernel (decode_append.h) before the decode, which reads the
  // lengths it writes; seqlens are the lengths after them (past the
  // capacity: the tokens there are dropped). 16-bit caches.
  bool append = false;
  bool identity_rows = false;  // contiguous, row b = sequence b: the append reads no table
};

// Per-key e4m3 quantisation of one row of D values (descale = amax / 448,
// 1 for a zero row); returns the dequantised values.
double quantize_row(const float* x, int D, uint8_t* out, float* descale) {
  float amax = 0.f;
  for (int d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float ds = amax > 0.f ? amax / 448.f : 1.f;
  *descale = ds;
  for (int d = 0; d < D; ++d)
    out[d] = __nv_cvt_float_to_fp8(x[d] / ds, __NV_SATFINITE, __NV_E4M3);
  return ds;
}
double fp8_value(uint8_t b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw(b, __NV_E4M3);
  __half hh;
  std::memcpy(&hh, &h, 2);
  return __half2float(hh);
}

template <typename T>
T* dev_alloc(size_t n) {
  T* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

struct Result {
  double o = 0, lse = 0;
  bool pass = false, launch_ok = false;
};

using Launcher = cudaError_t (*)(const DecodeParams&, cudaStream_t);

Result run_case(const Case& c, std::mt19937& rng, Launcher launch = jax_flash::decode::run_decode) {
  const int G = c.H / c.Hk, D = c.D;
  const int ps = c.page_size > 0 ? c.page_size : c.capacity;
  const int max_pages = c.page_size > 0 ? (c.capacity + ps - 1) / ps : 1;
  const int num_pages = c.B * max_pages + 3;  // spare pages nobody maps: NaN
  std::normal_distribution<float> nd(0.f, 1.f);
  const uint16_t kNaN = 0x7FFF;

  // Page table: a random permutation of the pages (contiguous: shuffled rows).
  std::vector<int> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  if (!c.identity_rows) std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<int32_t> table(size_t(c.B) * max_pages);
  for (size_t i = 0; i < table.size(); ++i) table[i] = perm[i];

  // Cache: NaN everywhere (FP8: a large finite e4m3 value, and NaN
  // descales), then each sequence's valid keys.
  const size_t page_elems = size_t(ps) * c.Hk * D;
  const int elem_bytes = c.fp8 ? 1 : 2;
  std::vector<uint8_t> k_bytes(num_pages * page_elems * elem_bytes), v_bytes;
  if (c.fp8) {
    std::fill(k_bytes.begin(), k_bytes.end(), uint8_t(0x7E));
  } else {
    for (size_t i = 0; i < k_bytes.size(); i += 2) { k_bytes[i] = 0xFF; k_bytes[i + 1] = 0x7F; }
  }
  v_bytes = k_bytes;
  std::vector<float> k_desc(size_t(num_pages) * c.Hk * ps, NAN), v_desc(k_desc);
  std::vector<double> kval(size_t(c.B) * c.capacity * c.Hk * D), vval(kval.size());
  auto slot = [&](int b, int j, int hk, int d) {
    const int page = table[size_t(b) * max_pages + j / ps];
    return size_t(page) * page_elems + (size_t(j % ps) * c.Hk + hk) * D + d;
  };
  auto desc_slot = [&](int b, int j, int hk) {
    const int page = table[size_t(b) * max_pages + j / ps];
    return (size_t(page) * c.Hk + hk) * ps + j % ps;
  };
  // Appended tokens: k_new / v_new [B, T, Hk, D] (1.0 where a token is
  // dropped: it must reach no slot), and the caches expected after the append.
  std::vector<uint8_t> knew_bytes, vnew_bytes, k_expect, v_expect;
  if (c.append) {
    knew_bytes.resize(size_t(c.B) * c.T * c.Hk * D * 2);
    for (size_t i = 0; i < knew_bytes.size(); i += 2) { knew_bytes[i] = 0x80; knew_bytes[i + 1] = 0x3F; }
    vnew_bytes = knew_bytes;
  }
  auto before = [&](int b) { return c.append ? c.seqlens[b] - c.T : c.seqlens[b]; };
  std::vector<float> row(D);
  std::vector<uint8_t> q8(D);
  for (int b = 0; b < c.B; ++b)
    for (int j = 0; j < std::min(c.seqlens[b], c.capacity); ++j)
      for (int hk = 0; hk < c.Hk; ++hk)
        for (int t = 0; t < 2; ++t) {  // K, then V
          const bool is_new = j >= before(b);
          std::vector<uint8_t>& bytes =
              is_new ? (t ? vnew_bytes : knew_bytes) : (t ? v_bytes : k_bytes);
          std::vector<double>& val = t ? vval : kval;
          const size_t at = ((size_t(b) * c.capacity + j) * c.Hk + hk) * D;
          for (int d = 0; d < D; ++d) row[d] = nd(rng) * (d == 3 ? 6.f : 1.f);  // an outlier column
          if (c.fp8) {
            float ds;
            quantize_row(row.data(), D, q8.data(), &ds);
            (t ? v_desc : k_desc)[desc_slot(b, j, hk)] = ds;
            for (int d = 0; d < D; ++d) {
              bytes[slot(b, j, hk, d)] = q8[d];
              val[at + d] = fp8_value(q8[d]) * double(ds);
            }
          } else {
            for (int d = 0; d < D; ++d) {
              const uint16_t bits = to_bits(row[d], c.fp16);
              const size_t new_at = ((size_t(b) * c.T + j - before(b)) * c.Hk + hk) * D + d;
              std::memcpy(&bytes[(is_new ? new_at : slot(b, j, hk, d)) * 2], &bits, 2);
              val[at + d] = from_bits(bits, c.fp16);
            }
          }
        }
  if (c.append) {  // the new tokens in their slots, the rest as it was
    k_expect = k_bytes;
    v_expect = v_bytes;
    for (int b = 0; b < c.B; ++b)
      for (int j = before(b); j < std::min(c.seqlens[b], c.capacity); ++j)
        for (int hk = 0; hk < c.Hk; ++hk) {
          const size_t new_at = ((size_t(b) * c.T + j - before(b)) * c.Hk + hk) * D;
          std::memcpy(&k_expect[slot(b, j, hk, 0) * 2], &knew_bytes[new_at * 2], size_t(D) * 2);
          std::memcpy(&v_expect[slot(b, j, hk, 0) * 2], &vnew_bytes[new_at * 2], size_t(D) * 2);
        }
  }
  std::vector<uint16_t> q_bits(size_t(c.B) * c.T * c.H * D);
  std::vector<double> qval(q_bits.size());
  for (size_t i = 0; i < q_bits.size(); ++i) {
    q_bits[i] = to_bits(nd(rng), c.fp16);
    qval[i] = from_bits(q_bits[i], c.fp16);
  }

  std::vector<float> sinks;
  if (c.sinks) {
    sinks.resize(size_t(c.B) * c.H);
    for (float& x : sinks) x = c.sink_mean + 2.f * nd(rng);
  }

  // float64 reference: e^{sink} joins each row's denominator; a row that sees
  // no key has O = 0 and LSE = the sink.
  const double scale = 1.0 / std::sqrt(double(D));
  std::vector<double> ref_o(q_bits.size(), 0.0), ref_lse(size_t(c.B) * c.H * c.T, -INFINITY);
  for (int b = 0; b < c.B; ++b) {
    const int L = std::max(0, std::min(c.seqlens[b], c.capacity));
    for (int t = 0; t < c.T; ++t)
      for (int h = 0; h < c.H; ++h) {
        const int hk = h / G;
        const int64_t pos = int64_t(t) + L - c.T;
        std::vector<double> s(L, -INFINITY);
        double m = -INFINITY;
        for (int j = 0; j < L; ++j) {
          if (c.wl >= 0 && j < pos - c.wl) continue;
          if (c.wr >= 0 && j > pos + c.wr) continue;
          double acc = 0;
          for (int d = 0; d < D; ++d)
            acc += qval[((size_t(b) * c.T + t) * c.H + h) * D + d] *
                   kval[((size_t(b) * c.capacity + j) * c.Hk + hk) * D + d];
          acc *= scale;
          if (c.softcap > 0) acc = c.softcap * std::tanh(acc / c.softcap);
          s[j] = acc;
          m = std::max(m, acc);
        }
        const double sink = c.sinks ? double(sinks[size_t(b) * c.H + h]) : -INFINITY;
        if (m == -INFINITY) {
          ref_lse[(size_t(b) * c.H + h) * c.T + t] = sink;
          continue;
        }
        m = std::max(m, sink);
        double l = c.sinks ? std::exp(sink - m) : 0.0;
        for (int j = 0; j < L; ++j) l += s[j] == -INFINITY ? 0.0 : std::exp(s[j] - m);
        ref_lse[(size_t(b) * c.H + h) * c.T + t] = m + std::log(l);
        for (int d = 0; d < D; ++d) {
          double acc = 0;
          for (int j = 0; j < L; ++j)
            if (s[j] != -INFINITY)
              acc += std::exp(s[j] - m) / l * vval[((size_t(b) * c.capacity + j) * c.Hk + hk) * D + d];
          ref_o[((size_t(b) * c.T + t) * c.H + h) * D + d] = acc;
        }
      }
  }

  // Device buffers, outputs and partials poisoned.
  uint16_t* dq = dev_alloc<uint16_t>(q_bits.size());
  uint8_t* dk = dev_alloc<uint8_t>(k_bytes.size());
  uint8_t* dv = dev_alloc<uint8_t>(v_bytes.size());
  float* d_kdesc = dev_alloc<float>(k_desc.size());
  float* d_vdesc = dev_alloc<float>(v_desc.size());
  uint16_t* d_o = dev_alloc<uint16_t>(q_bits.size());
  float* d_lse = dev_alloc<float>(ref_lse.size());
  int32_t* d_table = dev_alloc<int32_t>(table.size());
  int32_t* d_len = dev_alloc<int32_t>(c.B);
  const size_t rows = size_t(c.B) * c.H * c.T;
  float* d_op = dev_alloc<float>(size_t(c.splits) * rows * D);
  float* d_lp = dev_alloc<float>(size_t(c.splits) * rows);
  float* d_sinks = dev_alloc<float>(sinks.size());
  if (c.sinks) CHECK_CUDA(cudaMemcpy(d_sinks, sinks.data(), sinks.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dq, q_bits.data(), q_bits.size() * 2, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dk, k_bytes.data(), k_bytes.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dv, v_bytes.data(), v_bytes.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_kdesc, k_desc.data(), k_desc.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_vdesc, v_desc.data(), v_desc.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(d_len, c.seqlens.data(), c.B * 4, cudaMemcpyHostToDevice));
  uint8_t* d_knew = dev_alloc<uint8_t>(knew_bytes.size());
  uint8_t* d_vnew = dev_alloc<uint8_t>(vnew_bytes.size());
  int32_t* d_len_out = dev_alloc<int32_t>(c.B);
  int32_t* const d_len_own = d_len_out;  // freed below, whatever d_len_out becomes
  if (c.append) {
    std::vector<int32_t> held(c.B);
    for (int b = 0; b < c.B; ++b) held[b] = before(b);
    CHECK_CUDA(cudaMemcpy(d_len, held.data(), c.B * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_knew, knew_bytes.data(), knew_bytes.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_vnew, vnew_bytes.data(), vnew_bytes.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(d_len_out, 0xFF, c.B * 4));
  }
  CHECK_CUDA(cudaMemset(d_o, 0xFF, q_bits.size() * 2));
  CHECK_CUDA(cudaMemset(d_lse, 0xFF, ref_lse.size() * 4));
  CHECK_CUDA(cudaMemset(d_op, 0xFF, size_t(c.splits) * rows * D * 4));
  CHECK_CUDA(cudaMemset(d_lp, 0xFF, size_t(c.splits) * rows * 4));

  DecodeParams p{};
  p.q = dq;
  p.o = d_o;
  p.lse = d_lse;
  p.q_head_stride = p.o_head_stride = D;
  p.q_row_stride = p.o_row_stride = int64_t(c.H) * D;
  p.q_batch_stride = p.o_batch_stride = int64_t(c.T) * c.H * D;
  p.k = dk;
  p.v = dv;
  p.kv_head_stride = D;
  p.kv_row_stride = int64_t(c.Hk) * D;
  p.kv_page_stride = int64_t(ps) * c.Hk * D;
  p.page_table = d_table;
  p.seqlens = d_len;
  p.batch = c.B;
  p.seqlen_q = c.T;
  p.num_heads = c.H;
  p.num_heads_k = c.Hk;
  p.head_dim = D;
  p.num_pages = num_pages;
  p.page_size = ps;
  p.max_pages = max_pages;
  p.window_left = c.wl;
  p.window_right = c.wr;
  p.sm = jax_flash::make_softmax_scale(c.fp8 ? 1.f : float(scale), c.softcap);
  p.kv_fp8 = c.fp8;
  p.q_scale = float(scale);
  p.k_descale = d_kdesc;
  p.v_descale = d_vdesc;
  p.dtype = c.fp16 ? DType::kFloat16 : DType::kBFloat16;
  p.sinks = c.sinks ? d_sinks : nullptr;
  p.num_splits = c.splits;
  p.o_partial = d_op;
  p.lse_partial = d_lp;
  Result r;
  bool appended = true;
  if (c.append) {
    jax_flash::decode::AppendParams ap{};
    ap.k = dk;
    ap.v = dv;
    ap.k_new = d_knew;
    ap.v_new = d_vnew;
    ap.page_table = c.identity_rows ? nullptr : d_table;
    ap.seqlens = d_len;
    // The production call updates its cache index in place: the identity-rows
    // case writes the lengths over the ones it reads.
    if (c.identity_rows) d_len_out = d_len;
    ap.seqlens_out = d_len_out;
    ap.batch = c.B;
    ap.seqlen_new = c.T;
    ap.num_heads_k = c.Hk;
    ap.head_dim = D;
    ap.num_pages = num_pages;
    ap.page_size = ps;
    ap.max_pages = c.identity_rows ? 1 : max_pages;
    r.launch_ok = jax_flash::decode::run_append(ap, nullptr) == cudaSuccess;
    p.seqlens = d_len_out;
  }
  r.launch_ok = launch(p, nullptr) == cudaSuccess && (!c.append || r.launch_ok);
  CHECK_CUDA(cudaDeviceSynchronize());
  if (c.append) {  // the caches bit for bit, and the lengths after the append
    std::vector<uint8_t> k_after(k_bytes.size()), v_after(v_bytes.size());
    std::vector<int32_t> len_after(c.B);
    CHECK_CUDA(cudaMemcpy(k_after.data(), dk, k_after.size(), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(v_after.data(), dv, v_after.size(), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(len_after.data(), d_len_out, c.B * 4, cudaMemcpyDeviceToHost));
    appended = k_after == k_expect && v_after == v_expect;
    for (int b = 0; b < c.B; ++b)
      appended = appended && len_after[b] == std::max(0, std::min(c.seqlens[b], c.capacity));
  }
  std::vector<uint16_t> o_bits(q_bits.size());
  std::vector<float> lse(ref_lse.size());
  CHECK_CUDA(cudaMemcpy(o_bits.data(), d_o, o_bits.size() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(lse.data(), d_lse, lse.size() * 4, cudaMemcpyDeviceToHost));
  double ref_max = 0;
  for (size_t i = 0; i < ref_o.size(); ++i) {
    const double diff = std::fabs(from_bits(o_bits[i], c.fp16) - ref_o[i]);
    r.o = std::isnan(diff) ? INFINITY : std::max(r.o, diff);
    ref_max = std::max(ref_max, std::fabs(ref_o[i]));
  }
  r.o /= std::max(ref_max, 1e-6);
  for (size_t i = 0; i < lse.size(); ++i) {
    const bool both_empty = ref_lse[i] == -INFINITY && lse[i] == -INFINITY;
    const double diff = both_empty ? 0.0 : std::fabs(double(lse[i]) - ref_lse[i]);
    r.lse = std::isnan(diff) ? INFINITY : std::max(r.lse, diff);
  }
  const double tol_o = c.fp16 ? 4e-3 : 2e-2;
  r.pass = r.launch_ok && appended && r.o <= tol_o && r.lse <= 2e-3;
  CHECK_CUDA(cudaFree(d_len_own));
  for (void* ptr : {(void*)dq, (void*)dk, (void*)dv, (void*)d_o, (void*)d_lse, (void*)d_table,
                    (void*)d_len, (void*)d_op, (void*)d_lp, (void*)d_kdesc, (void*)d_vdesc,
                    (void*)d_sinks, (void*)d_knew, (void*)d_vnew})
    CHECK_CUDA(cudaFree(ptr));
  return r;
}

std::vector<Case> all_cases(bool quick) {
  std::vector<Case> cs;
  // name, B, T, H, Hk, D, page_size, capacity, seqlens
  Case c{"mqa decode contiguous", 2, 1, 4, 1, 128, 0, 200, {200, 37}};
  cs.push_back(c);
  c = Case{"gqa4 paged16 split3 ragged", 3, 1, 8, 2, 128, 16, 300, {0, 1, 299}};
  c.splits = 3;
  cs.push_back(c);
  c = Case{"gqa8 causal T5 paged64 split2", 2, 5, 8, 1, 64, 64, 260, {260, 70}};
  c.wr = 0;
  c.splits = 2;
  cs.push_back(c);
  c = Case{"hdim96 window paged100 split4", 2, 3, 4, 2, 96, 100, 333, {333, 150}};
  c.wl = 40;
  c.wr = 0;
  c.splits = 4;
  cs.push_back(c);
  c = Case{"hdim256 softcap fp16 split2", 1, 2, 2, 1, 256, 32, 190, {190}};
  c.softcap = 20.f;
  c.fp16 = true;
  c.splits = 2;
  c.wr = 0;
  cs.push_back(c);
  c = Case{"hdim40 rows>16 T8 gqa4 causal", 1, 8, 4, 1, 40, 0, 150, {150}};
  c.wr = 0;
  cs.push_back(c);
  c = Case{"32-row tiles T8 gqa4 paged64 split3", 2, 8, 8, 2, 128, 64, 300, {300, 77}};
  c.wr = 0;
  c.splits = 3;
  cs.push_back(c);
  c = Case{"rows>32 T12 gqa4 window fp16", 1, 12, 4, 1, 64, 0, 140, {140}};
  c.wl = 30;
  c.wr = 0;
  c.fp16 = true;
  cs.push_back(c);
  c = Case{"hdim256 rows>16 stays 16-row tiles", 1, 6, 4, 1, 256, 32, 100, {100}};
  c.wr = 0;
  cs.push_back(c);
  // The new tokens appended by the append kernel first (lengths after them;
  // 98 > 96: two of the three tokens fall past the capacity, dropped).
  c = Case{"append T1 mha identity rows split2", 3, 1, 4, 4, 128, 0, 200, {200, 1, 57}};
  c.append = true;
  c.identity_rows = true;
  cs.push_back(c);
  c = Case{"append T4 gqa2 contiguous shuffled rows", 2, 4, 4, 2, 64, 0, 100, {100, 4}};
  c.append = true;
  c.wr = 0;
  cs.push_back(c);
  c = Case{"append T1 mha contiguous split2", 3, 1, 4, 4, 128, 0, 200, {200, 1, 57}};
  c.append = true;
  c.splits = 2;
  c.wr = 0;
  cs.push_back(c);
  c = Case{"append T3 gqa2 paged16 causal drop", 2, 3, 4, 2, 64, 16, 96, {98, 3}};
  c.append = true;
  c.wr = 0;
  cs.push_back(c);
  c = Case{"append T2 fp16 hdim256 paged32 split3", 2, 2, 2, 1, 256, 32, 100, {2, 77}};
  c.append = true;
  c.fp16 = true;
  c.splits = 3;
  c.wr = 0;
  cs.push_back(c);
  c = Case{"fp8 cache gqa4 paged16 split3", 3, 1, 8, 2, 128, 16, 300, {0, 1, 299}};
  c.fp8 = true;
  c.splits = 3;
  cs.push_back(c);
  c = Case{"fp8 cache T8 32-row causal window", 2, 8, 8, 2, 64, 0, 260, {260, 77}};
  c.fp8 = true;
  c.wl = 100;
  c.wr = 0;
  c.splits = 2;
  cs.push_back(c);
  c = Case{"fp8 cache hdim256 softcap fp16", 1, 2, 2, 1, 256, 32, 190, {190}};
  c.fp8 = true;
  c.fp16 = true;
  c.softcap = 20.f;
  c.wr = 0;
  cs.push_back(c);
  // 16-row FP8 CTAs take 128-key tiles, 32 keys per warp (decode_tile).
  c = Case{"fp8 cache 128-key tiles T3 window split3", 2, 3, 8, 2, 128, 0, 700, {700, 389}};
  c.fp8 = true;
  c.wl = 300;
  c.wr = 0;
  c.splits = 3;
  cs.push_back(c);
  c = Case{"fp8 cache hdim64 128-key tiles paged64 softcap", 2, 1, 4, 1, 64, 64, 520, {520, 131}};
  c.fp8 = true;
  c.softcap = 30.f;
  cs.push_back(c);
  c = Case{"paged1 (a key per page) split2 T3 causal", 2, 3, 4, 2, 64, 1, 150, {150, 71}};
  c.wr = 0;
  c.splits = 2;
  cs.push_back(c);
  c = Case{"more splits than tiles", 2, 1, 2, 2, 64, 16, 90, {90, 5}};
  c.splits = 7;
  cs.push_back(c);
  c = Case{"cache shorter than T causal", 1, 4, 2, 1, 64, 0, 64, {2}};
  c.wr = 0;
  c.splits = 2;
  cs.push_back(c);
  // Sinks: in the single split's finalize or once in the combine; empty
  // cache rows and rows that see no key get LSE = the sink.
  c = Case{"sinks mqa contiguous split1 empty row", 2, 1, 4, 1, 128, 0, 200, {200, 0}};
  c.sinks = true;
  cs.push_back(c);
  c = Case{"sinks gqa4 paged16 split3 ragged", 3, 1, 8, 2, 128, 16, 300, {0, 1, 299}};
  c.sinks = true;
  c.splits = 3;
  cs.push_back(c);
  c = Case{"sinks 32-row tiles T8 gqa4 paged64", 2, 8, 8, 2, 64, 64, 300, {300, 77}};
  c.sinks = true;
  c.wr = 0;
  cs.push_back(c);
  c = Case{"sinks dominant hdim96 window split4", 2, 3, 4, 2, 96, 100, 333, {333, 150}};
  c.sinks = true;
  c.sink_mean = 8.f;
  c.wl = 40;
  c.wr = 0;
  c.splits = 4;
  cs.push_back(c);
  c = Case{"sinks cache shorter than T split2", 1, 4, 2, 1, 64, 0, 64, {2}};
  c.sinks = true;
  c.wr = 0;
  c.splits = 2;
  cs.push_back(c);
  c = Case{"sinks fp8 cache gqa4 paged16 split3", 3, 1, 8, 2, 128, 16, 300, {0, 1, 299}};
  c.sinks = true;
  c.fp8 = true;
  c.splits = 3;
  cs.push_back(c);
  c = Case{"sinks fp8 cache softcap fp16 split1", 1, 2, 2, 1, 256, 32, 190, {190}};
  c.sinks = true;
  c.fp8 = true;
  c.fp16 = true;
  c.softcap = 20.f;
  c.wr = 0;
  cs.push_back(c);
  // Many splits: the CTA-per-row combine (decode_combine_kind), with splits
  // that see no key (ragged lengths, windows), sinks, head dims whose float4
  // columns leave lanes idle (40) or take two column groups (256).
  c = Case{"cta combine split33 paged16 sinks ragged", 2, 1, 8, 2, 128, 16, 2100, {2100, 517}};
  c.splits = 33;
  c.sinks = true;
  cs.push_back(c);
  c = Case{"cta combine split9 hdim40 T3 window", 2, 3, 4, 1, 40, 0, 700, {700, 3}};
  c.splits = 9;
  c.wl = 200;
  c.wr = 0;
  cs.push_back(c);
  c = Case{"cta combine split20 hdim256 fp16 softcap", 1, 2, 4, 2, 256, 32, 1300, {1300}};
  c.splits = 20;
  c.fp16 = true;
  c.softcap = 20.f;
  c.wr = 0;
  cs.push_back(c);
  c = Case{"cta combine split128 > tiles mqa", 1, 1, 4, 1, 64, 64, 2000, {1999}};
  c.splits = 128;
  cs.push_back(c);
  c = Case{"cta combine split12 fp8 T8 32-row", 2, 8, 8, 2, 128, 0, 900, {900, 100}};
  c.fp8 = true;
  c.splits = 12;
  c.wr = 0;
  c.sinks = true;
  cs.push_back(c);
  if (!quick) {
    c = Case{"gqa4 T16 paged32 split5 window", 2, 16, 8, 2, 128, 32, 400, {400, 211}};
    c.wl = 100;
    c.wr = 0;
    c.splits = 5;
    cs.push_back(c);
    c = Case{"fp16 mha hdim128 split1 long", 1, 1, 2, 2, 128, 256, 1100, {1037}};
    c.fp16 = true;
    cs.push_back(c);
  }
  return cs;
}

// Cases for every variant (decode_variants.cuh), in the variant's cache
// (bf16 or FP8): bf16 Q, no softcap;
// ragged and empty sequences, pages that split a tile, windows, more splits
// than tiles, and rows past 16 (16-row variants: several row blocks).
std::vector<Case> variant_cases() {
  std::vector<Case> cs;
  Case c{"gqa4 paged16 split3", 3, 1, 8, 2, 128, 16, 300, {0, 1, 299}};
  c.fp8 = true;
  c.splits = 3;
  cs.push_back(c);
  c = Case{"T3 window split3", 2, 3, 8, 2, 128, 0, 700, {700, 389}};
  c.fp8 = true;
  c.wl = 300;
  c.wr = 0;
  c.splits = 3;
  cs.push_back(c);
  c = Case{"paged64 odd lengths split1", 2, 1, 8, 2, 128, 64, 520, {517, 131}};
  c.fp8 = true;
  cs.push_back(c);
  c = Case{"T8 gqa4 causal paged32 split2 sinks", 2, 8, 8, 2, 128, 32, 260, {260, 77}};
  c.fp8 = true;
  c.wr = 0;
  c.splits = 2;
  c.sinks = true;
  cs.push_back(c);
  c = Case{"mqa split7 > tiles", 2, 1, 4, 1, 128, 0, 200, {200, 5}};
  c.fp8 = true;
  c.splits = 7;
  cs.push_back(c);
  return cs;
}

// The split policy on the shapes it is meant for (H200: 132 SMs, 228 KB):
// 16-bit caches run two 128-head-dim CTAs per SM (264 slots), FP8 caches
// three (396 slots) with 64-key tiles; one wave fills the slots.
bool check_plan() {
  using jax_flash::decode::decode_num_splits;
  struct P { int64_t bh; int T, G, S, D; bool fp8; int want_min, want_max; };
  const P ps[] = {{8 * 8, 1, 4, 32768, 128, false, 4, 4},     // B=8, 8 KV heads: 256 of 264 slots
                  {1 * 8, 1, 4, 131072, 128, false, 33, 33},  // B=1: 264 CTAs
                  {64 * 8, 1, 4, 4096, 128, false, 1, 1},     // the batch fills the GPU
                  {8 * 8, 8, 4, 32768, 128, false, 4, 4},     // 32 rows: one CTA per KV head
                  {8, 1, 4, 64, 128, false, 1, 1},            // one tile
                  {8 * 8, 1, 4, 32768, 128, true, 6, 6},      // FP8: 384 of 396 slots
                  {1 * 8, 1, 4, 131072, 128, true, 49, 49},   // FP8 B=1: 392 CTAs
                  {8, 1, 4, 64, 128, true, 1, 1}};            // FP8: one 64-key tile
  bool ok = true;
  for (const P& x : ps) {
    const int s = decode_num_splits(x.bh, x.T, x.G, x.S, x.D, 132, 228 * 1024, x.fp8);
    const bool good = s >= x.want_min && s <= x.want_max;
    std::printf("plan: B*H_kv %lld, T %d, group %d, S %d%s -> %d splits %s\n", (long long)x.bh, x.T,
                x.G, x.S, x.fp8 ? " fp8" : "", s, good ? "ok" : "UNEXPECTED");
    ok &= good;
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  std::string filter;
  bool quick = false, bench = false;
  int iters = 20, rounds = 7;
  std::vector<int> split_counts;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "--bench")
      bench = true;
    else if (a == "--iters" && i + 1 < argc)
      iters = std::atoi(argv[++i]);
    else if (a == "--rounds" && i + 1 < argc)
      rounds = std::atoi(argv[++i]);
    else if (a == "--splits" && i + 1 < argc) {
      std::stringstream list(argv[++i]);
      for (std::string n; std::getline(list, n, ',');) split_counts.push_back(std::atoi(n.c_str()));
    }
    else
      filter = argv[i];
  }
  if (bench) {
#ifndef JAX_FLASH_HOST_EMULATION
    return decode_bench::run(filter, iters, rounds, split_counts) ? 1 : 0;
#else
    std::printf("--bench needs a GPU\n");
    return 1;
#endif
  }
  std::mt19937 rng(4321);
  int failed = 0, run = 0;
  std::printf("%-36s %9s %9s  %s\n", "case", "O", "LSE", "result");
  auto report = [&](const std::string& name, const Result& r) {
    ++run;
    failed += !r.pass;
    std::printf("%-36s %9.2e %9.2e  %s\n", name.c_str(), r.o, r.lse,
                r.pass ? "PASS" : (r.launch_ok ? "FAIL" : "FAIL (launch)"));
    std::fflush(stdout);
  };
  for (const Case& c : all_cases(quick)) {
    if (!filter.empty() && c.name.find(filter) == std::string::npos) continue;
    report(c.name, run_case(c, rng));
  }
  // The FP8 tile variants (decode_variants.cuh) on their own cases; those
  // that need more shared memory than a CTA may have here are skipped.
  int smem_optin = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  for (const decode_variants::Variant& v : decode_variants::kVariants)
    for (Case c : variant_cases()) {
      c.fp8 = v.fp8;
      const std::string name = std::string(v.name) + ": " + c.name;
      if (!filter.empty() && name.find(filter) == std::string::npos) continue;
      if (v.smem_bytes > smem_optin) {
        std::printf("%-36s %9s %9s  SKIP (%d KB of shared memory)\n", name.c_str(), "-", "-",
                    v.smem_bytes / 1024);
        continue;
      }
      report(name, run_case(c, rng, v.launch));
    }
  // Refusals: the launcher declines what the kernels are not written for.
  {
    DecodeParams p{};
    p.dtype = DType::kBFloat16;
    p.batch = 1; p.seqlen_q = 1; p.num_heads = 3; p.num_heads_k = 2; p.head_dim = 64;
    p.page_size = 16; p.num_splits = 1;
    const bool refused = jax_flash::decode::run_decode(p, nullptr) == cudaErrorInvalidValue;
    std::printf("%-36s %9s %9s  %s\n", "refuses H % H_kv != 0", "-", "-", refused ? "PASS" : "FAIL");
    ++run;
    failed += !refused;
  }
  if (!check_plan()) ++failed;
  std::printf("%d passed, %d failed\n", run - failed, failed);
  return failed ? 1 : 0;
}
