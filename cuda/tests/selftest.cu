// Standalone GPU self-test of the sm80 kernels (no JAX needed).
//
// For each case: random 16-bit Q, K, V, dO on the host; run_fwd and run_bwd on
// the GPU with every output poisoned (0xFF bytes = NaN) first; a float64 CPU
// reference computed from the same rounded inputs; a PASS/FAIL row with the
// max errors (relative to the largest reference magnitude; LSE absolute).
// Exit code 1 if any case fails.
//
// Build (from the repository root; sm_90 SASS for an H100/H200, add
// -gencode=arch=compute_80,code=sm_80 for an A100):
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90,code=sm_90 \
//     -Icuda/include -Icuda cuda/tests/selftest.cu cuda/sm80/dispatch.cu \
//     cuda/instantiations/*_sm80.cu -o selftest && ./selftest
// Options: ./selftest [filter-substring] [--quick]
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "jax_flash/params.h"
#include "sm80/launch.h"
#include "selftest_common.h"

using jax_flash::BwdParams;
using jax_flash::DType;
using jax_flash::FwdParams;

struct Case {
  std::string name;
  int B, T, S, H, Hk, D;
  bool causal = false;
  int wl = -1, wr = -1;
  bool segments = false;
  float softcap = 0.f;
  float scale_mul = 1.f;  // scale = scale_mul / sqrt(D)
  bool deterministic = false;
  bool fp16 = false;
  int pitch_pad = 0;      // extra elements per row (non-contiguous strides)
  float dropout = 0.f;    // attention dropout rate (threshold round(rate * 256))
  bool drop_broadcast = false;  // one mask for every (batch, head)
  bool sinks = false;           // learnable sinks: one random logit per (batch, head)
  int Dv = 0;                   // value head dim (v, o, dO, dV); 0: D
  int dv() const { return Dv > 0 ? Dv : D; }
};

// Max |got - ref| over the logical elements of a 16-bit tensor (NaN -> inf).
static double err16(const std::vector<uint16_t>& got, const Tensor& layout,
                    const std::vector<double>& ref, bool fp16, double* ref_max) {
  double e = 0, rm = 0;
  for (int b = 0; b < layout.B; ++b)
    for (int l = 0; l < layout.L; ++l)
      for (int h = 0; h < layout.H; ++h)
        for (int d = 0; d < layout.D; ++d) {
          const double r = ref[((size_t(b) * layout.L + l) * layout.H + h) * layout.D + d];
          const double g = from_bits(got[layout.idx(b, l, h, d)], fp16);
          const double diff = std::fabs(g - r);
          e = std::isnan(diff) ? INFINITY : std::max(e, diff);
          rm = std::max(rm, std::fabs(r));
        }
  *ref_max = rm;
  return e;
}

struct Row {
  std::string name;
  double o, lse, dq, dk, dv;
  bool det_ok;
  bool pass;
  bool skipped = false;  // cudaErrorNotSupported (e.g. too little shared memory)
};

static Row run_case(const Case& c, std::mt19937& rng) {
  const bool fp16 = c.fp16;
  const double scale = c.scale_mul / std::sqrt(double(c.D));
  Tensor q = make_tensor(c.B, c.T, c.H, c.D, c.pitch_pad, fp16, rng, 1.f);
  Tensor k = make_tensor(c.B, c.S, c.Hk, c.D, c.pitch_pad, fp16, rng, 1.f);
  Tensor v = make_tensor(c.B, c.S, c.Hk, c.dv(), c.pitch_pad, fp16, rng, 1.f);
  Tensor dout = make_tensor(c.B, c.T, c.H, c.dv(), c.pitch_pad, fp16, rng, 1.f);  // o's layout
  std::vector<int> qs, ks;
  if (c.segments) {  // runs of random length; q and kv use the same boundaries scaled
    std::uniform_int_distribution<int> len(1, 24);
    auto fill = [&](std::vector<int>& seg, int n) {
      seg.assign(size_t(c.B) * n, 0);
      for (int b = 0; b < c.B; ++b) {
        int id = 0, left = len(rng);
        for (int i = 0; i < n; ++i) {
          if (left-- == 0) {
            ++id;
            left = len(rng);
          }
          seg[size_t(b) * n + i] = id % 5;
        }
      }
    };
    fill(qs, c.T);
    fill(ks, c.S);
  }
  jax_flash::DropoutArgs drop_args = dropout_args(c.dropout, c.drop_broadcast);
  jax_flash::DropoutArgs host_drop = drop_args;
  host_drop.words = kDropoutWords;
  const jax_flash::Dropout drop_ref(host_drop);
  const std::vector<float> sinks = random_sinks(c.sinks, c.B, c.H, rng);
  const Reference ref = reference(c, q, k, v, &dout, qs, ks, scale,
                                  drop_args.enabled() ? &drop_ref : nullptr,
                                  c.sinks ? &sinks : nullptr);

  // ---- device buffers
  uint16_t *dq_in = upload(q), *dk_in = upload(k), *dv_in = upload(v), *ddo = upload(dout);
  uint16_t* d_o = dev_alloc<uint16_t>(dout.count());
  uint16_t *d_dq = dev_alloc<uint16_t>(q.count()), *d_dk = dev_alloc<uint16_t>(k.count()),
           *d_dv = dev_alloc<uint16_t>(v.count());
  const size_t nstat = size_t(c.B) * c.H * c.T;
  float* d_lse = dev_alloc<float>(nstat);
  float* d_delta = dev_alloc<float>(nstat);
  int32_t *d_qs = nullptr, *d_ks = nullptr;
  uint32_t* d_words = nullptr;
  float* d_sinks = upload(sinks);
  if (drop_args.enabled()) {
    d_words = dev_alloc<uint32_t>(std::size(kDropoutWords));
    CHECK_CUDA(cudaMemcpy(d_words, kDropoutWords, sizeof(kDropoutWords), cudaMemcpyHostToDevice));
    drop_args.words = d_words;
  }
  if (c.segments) {
    d_qs = dev_alloc<int32_t>(qs.size());
    d_ks = dev_alloc<int32_t>(ks.size());
    CHECK_CUDA(cudaMemcpy(d_qs, qs.data(), qs.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_ks, ks.data(), ks.size() * 4, cudaMemcpyHostToDevice));
  }
  std::vector<float> delta_f(nstat);
  for (size_t i = 0; i < nstat; ++i) delta_f[i] = float(ref.delta[i]);
  CHECK_CUDA(cudaMemcpy(d_delta, delta_f.data(), nstat * 4, cudaMemcpyHostToDevice));
  const int hd_round = jax_flash::rounded_head_dim(c.D, c.dv());
  const int tq_round = jax_flash::rounded_seqlen(c.T);
  const size_t nacc = size_t(c.B) * c.H * tq_round * hd_round;
  float* d_acc = dev_alloc<float>(nacc);

  // ---- forward
  FwdParams fp{};
  fp.q = dq_in;
  fp.k = dk_in;
  fp.v = dv_in;
  fp.o = d_o;
  fp.lse = d_lse;
  fp.q_batch_stride = q.batch_stride();
  fp.q_row_stride = q.row_stride();
  fp.q_head_stride = c.D;
  fp.k_batch_stride = k.batch_stride();
  fp.k_row_stride = k.row_stride();
  fp.k_head_stride = c.D;
  fp.v_batch_stride = v.batch_stride();
  fp.v_row_stride = v.row_stride();
  fp.v_head_stride = c.dv();
  fp.o_batch_stride = dout.batch_stride();
  fp.o_row_stride = dout.row_stride();
  fp.o_head_stride = c.dv();
  fp.batch = c.B;
  fp.seqlen_q = c.T;
  fp.seqlen_k = c.S;
  fp.num_heads = c.H;
  fp.num_heads_k = c.Hk;
  fp.head_dim = c.D;
  fp.head_dim_v = c.dv();
  fp.scale = float(scale);
  fp.softcap = c.softcap;
  fp.window_left = c.wl;
  fp.window_right = c.causal ? (c.wr < 0 ? 0 : std::min(c.wr, 0)) : c.wr;
  fp.q_segment = d_qs;
  fp.kv_segment = d_ks;
  fp.dtype = fp16 ? DType::kFloat16 : DType::kBFloat16;
  fp.dropout = drop_args;
  fp.sinks = d_sinks;
  CHECK_CUDA(cudaDeviceGetAttribute(&fp.num_sms, cudaDevAttrMultiProcessorCount, 0));

  CHECK_CUDA(cudaMemset(d_o, 0xFF, dout.count() * 2));
  CHECK_CUDA(cudaMemset(d_lse, 0xFF, nstat * 4));
  Row row{c.name, 0, 0, 0, 0, 0, true, true};
  auto free_all = [&] {
    for (void* ptr : std::initializer_list<void*>{dq_in, dk_in, dv_in, ddo, d_o, d_dq, d_dk, d_dv,
                                                  d_lse, d_delta, d_acc, d_qs, d_ks, d_words,
                                                  d_sinks})
      if (ptr) CHECK_CUDA(cudaFree(ptr));
  };
  cudaError_t launch_err = jax_flash::sm80::run_fwd(fp, 0);
  if (launch_err == cudaErrorNotSupported) {
    row.skipped = true;
    free_all();
    return row;
  }
  CHECK_CUDA(launch_err);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<uint16_t> o_bits(dout.count());
  std::vector<float> lse(nstat);
  CHECK_CUDA(cudaMemcpy(o_bits.data(), d_o, dout.count() * 2, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(lse.data(), d_lse, nstat * 4, cudaMemcpyDeviceToHost));

  double omax;
  row.o = err16(o_bits, dout, ref.o, fp16, &omax) / std::max(omax, 0.05);
  bool lse_ok = true;
  for (size_t i = 0; i < nstat; ++i) {
    const double r = ref.lse[i], g = lse[i];
    if (std::isinf(r) || std::isinf(g)) {
      if (!(std::isinf(r) && std::isinf(g) && r < 0 && g < 0)) lse_ok = false;
    } else {
      const double e = std::fabs(g - r);
      row.lse = std::isnan(e) ? INFINITY : std::max(row.lse, e);
    }
    if (std::isnan(g)) lse_ok = false;
  }
  if (!lse_ok) row.lse = INFINITY;

  // ---- backward (twice in deterministic mode: results must be bitwise equal)
  BwdParams bp{};
  static_cast<FwdParams&>(bp) = fp;
  bp.dout = ddo;
  bp.delta = d_delta;
  bp.dq = d_dq;
  bp.dk = d_dk;
  bp.dv = d_dv;
  bp.seqlen_q_rounded = tq_round;
  bp.seqlen_k_rounded = jax_flash::rounded_seqlen(c.S);
  bp.head_dim_rounded = hd_round;
  bp.dq_accum = d_acc;
  bp.dk_accum = nullptr;
  bp.dv_accum = nullptr;
  bp.deterministic = c.deterministic;
  std::vector<uint16_t> g_dq(q.count()), g_dk(k.count()), g_dv(v.count());
  std::vector<uint16_t> g_dq2, g_dk2, g_dv2;
  for (int rep = 0; rep < (c.deterministic ? 2 : 1); ++rep) {
    CHECK_CUDA(cudaMemset(d_dq, 0xFF, q.count() * 2));
    CHECK_CUDA(cudaMemset(d_dk, 0xFF, k.count() * 2));
    CHECK_CUDA(cudaMemset(d_dv, 0xFF, v.count() * 2));
    CHECK_CUDA(cudaMemset(d_acc, 0xFF, nacc * 4));  // the launcher must zero it
    launch_err = jax_flash::sm80::run_bwd(bp, 0);
    if (launch_err == cudaErrorNotSupported) {
      row.skipped = true;
      free_all();
      return row;
    }
    CHECK_CUDA(launch_err);
    CHECK_CUDA(cudaDeviceSynchronize());
    g_dq2 = g_dq;
    g_dk2 = g_dk;
    g_dv2 = g_dv;
    CHECK_CUDA(cudaMemcpy(g_dq.data(), d_dq, q.count() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(g_dk.data(), d_dk, k.count() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(g_dv.data(), d_dv, v.count() * 2, cudaMemcpyDeviceToHost));
  }
  if (c.deterministic) {
    auto same_logical = [](const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                           const Tensor& t) {
      for (int bb = 0; bb < t.B; ++bb)
        for (int l = 0; l < t.L; ++l)
          for (int h = 0; h < t.H; ++h)
            for (int d = 0; d < t.D; ++d)
              if (a[t.idx(bb, l, h, d)] != b[t.idx(bb, l, h, d)]) return false;
      return true;
    };
    row.det_ok = same_logical(g_dq, g_dq2, q) && same_logical(g_dk, g_dk2, k) &&
                 same_logical(g_dv, g_dv2, v);
  }
  Tensor klay = k;  // layouts for err16
  double m1, m2, m3;
  // Gradients: error relative to the largest reference magnitude, floored at
  // 0.05 (a case whose exact gradient is ~0, e.g. one visible key per row,
  // still gets an absolute check).
  row.dq = err16(g_dq, q, ref.dq, fp16, &m1) / std::max(m1, 0.05);
  row.dk = err16(g_dk, klay, ref.dk, fp16, &m2) / std::max(m2, 0.05);
  row.dv = err16(g_dv, v, ref.dv, fp16, &m3) / std::max(m3, 0.05);

  const double tol_o = fp16 ? 4e-3 : 2e-2, tol_g = fp16 ? 1e-2 : 4e-2, tol_lse = 2e-3;
  row.pass = row.o <= tol_o && row.lse <= tol_lse && row.dq <= tol_g && row.dk <= tol_g &&
             row.dv <= tol_g && row.det_ok;

  free_all();
  return row;
}

// The head dims of the per-head-dim cases: every bucket, and the head-dim
// pairs (v, o, dO and dV of their own width: DeepSeek MLA's 192 / 128).
struct HeadDims {
  int D, Dv;  // Dv 0: D
  std::string tag() const { return "d" + std::to_string(D) + (Dv ? "v" + std::to_string(Dv) : ""); }
};
constexpr HeadDims kHeadDims[] = {{64, 0}, {96, 0}, {128, 0}, {256, 0}, {192, 128}};

static std::vector<Case> all_cases(bool quick) {
  std::vector<Case> cs;
  for (const HeadDims hd : kHeadDims) {
    const int D = hd.D;
    const std::string d = hd.tag();
    // Every case of this head dim derives from base (or sets Dv itself).
    Case base{d + " plain", 2, 37, 53, 4, 2, D};
    base.Dv = hd.Dv;
    cs.push_back(base);
    Case c = base;
    c.name = d + " causal";
    c.causal = true;
    cs.push_back(c);
    c = base;
    c.name = d + " causal T>S (empty rows)";
    c.causal = true;
    c.T = 53;
    c.S = 37;
    cs.push_back(c);
    c = base;
    c.name = d + " window(7,3)";
    c.wl = 7;
    c.wr = 3;
    cs.push_back(c);
    c = base;
    c.name = d + " segments";
    c.segments = true;
    cs.push_back(c);
    c = base;
    c.name = d + " softcap 2 (scale x4)";
    c.softcap = 2.f;
    c.scale_mul = 4.f;
    cs.push_back(c);
    c = base;
    c.name = d + " causal deterministic";
    c.causal = true;
    c.deterministic = true;
    cs.push_back(c);
    c = base;
    c.name = d + " fp16 causal";
    c.causal = true;
    c.fp16 = true;
    cs.push_back(c);
    c = base;
    c.name = d + " sinks causal T>S (empty rows)";
    c.causal = true;
    c.T = 53;
    c.S = 37;
    c.sinks = true;
    cs.push_back(c);
    c = base;
    c.name = d + " sinks segments fp16";
    c.segments = true;
    c.fp16 = true;
    c.sinks = true;
    cs.push_back(c);
    if (!quick) {
      c = Case{d + " multiblock MQA causal", 1, 300, 517, 2, 1, D};
      c.causal = true;
      c.Dv = hd.Dv;
      cs.push_back(c);
      c = Case{d + " multiblock window+seg det", 1, 333, 290, 2, 2, D};
      c.wl = 100;
      c.wr = 20;
      c.segments = true;
      c.deterministic = true;
      c.Dv = hd.Dv;
      cs.push_back(c);
      c = Case{d + " multiblock plain strided", 2, 257, 259, 2, 1, D};
      c.pitch_pad = 8;
      c.Dv = hd.Dv;
      cs.push_back(c);
    }
  }
  // Attention dropout: the mask must be the generator's bit for bit (the
  // reference draws Dropout::keep per element), with every mask option.
  for (const HeadDims hd : kHeadDims) {
    const int D = hd.D;
    const std::string d = hd.tag();
    Case base{d + " dropout 0.1", 2, 37, 53, 4, 2, D};
    base.dropout = 0.1f;
    base.Dv = hd.Dv;
    cs.push_back(base);
    Case c = base;
    c.name = d + " dropout 0.5 causal T>S";
    c.dropout = 0.5f;
    c.causal = true;
    c.T = 53;
    c.S = 37;
    cs.push_back(c);
    c = base;
    c.name = d + " dropout 0.5 causal det";
    c.dropout = 0.5f;
    c.causal = true;
    c.deterministic = true;
    cs.push_back(c);
    if (!quick) {
      c = base;
      c.name = d + " dropout window(7,3) fp16";
      c.wl = 7;
      c.wr = 3;
      c.fp16 = true;
      cs.push_back(c);
      c = base;
      c.name = d + " dropout segments";
      c.segments = true;
      cs.push_back(c);
      c = base;
      c.name = d + " dropout softcap 2";
      c.softcap = 2.f;
      c.scale_mul = 4.f;
      cs.push_back(c);
      c = base;
      c.name = d + " dropout 0.5 broadcast";
      c.dropout = 0.5f;
      c.drop_broadcast = true;
      cs.push_back(c);
      c = Case{d + " dropout multiblock MQA causal", 1, 300, 517, 2, 1, D};
      c.causal = true;
      c.dropout = 0.2f;
      c.Dv = hd.Dv;
      cs.push_back(c);
      c = Case{d + " dropout multiblock win+seg det", 1, 333, 290, 2, 2, D};
      c.wl = 100;
      c.wr = 20;
      c.segments = true;
      c.deterministic = true;
      c.dropout = 0.3f;
      c.Dv = hd.Dv;
      cs.push_back(c);
    }
  }
  {
    Case c{"d200 (bucket 256) dropout strided", 2, 70, 45, 2, 1, 200};
    c.dropout = 0.25f;
    c.pitch_pad = 8;
    cs.push_back(c);
    c = Case{"tiny T=1 S=1 dropout 0.9", 1, 1, 1, 1, 1, 64};
    c.dropout = 0.9f;
    cs.push_back(c);
  }
  // Head dims served by a larger bucket (zero-filled columns).
  cs.push_back(Case{"d40 (bucket 64)", 2, 37, 53, 4, 2, 40});
  cs.push_back(Case{"d80 (bucket 96) strided", 2, 37, 53, 4, 4, 80, false, -1, -1, false, 0.f, 1.f,
                    false, false, 8});
  Case c{"d200 (bucket 256) causal det", 2, 37, 53, 2, 1, 200};
  c.causal = true;
  c.deterministic = true;
  cs.push_back(c);
  cs.push_back(Case{"tiny T=1 S=1", 1, 1, 1, 1, 1, 64});
  c = Case{"window(0,0) diag only", 1, 70, 70, 2, 1, 128};
  c.wl = 0;
  c.wr = 0;
  cs.push_back(c);
  c = Case{"left window only 16", 1, 150, 150, 2, 1, 64};
  c.wl = 16;
  cs.push_back(c);
  return cs;
}

int main(int argc, char** argv) {
  std::string filter;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--quick")
      quick = true;
    else
      filter = argv[i];
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  std::mt19937 rng(1234);
  int failed = 0, run = 0, skipped = 0;
  std::printf("%-40s %9s %9s %9s %9s %9s %4s  %s\n", "case", "O", "LSE", "dQ", "dK", "dV", "det",
              "result");
  for (const Case& c : all_cases(quick)) {
    if (!filter.empty() && c.name.find(filter) == std::string::npos) continue;
    const Row r = run_case(c, rng);
    if (r.skipped) {
      ++skipped;
      std::printf("%-40s %9s %9s %9s %9s %9s %4s  %s\n", r.name.c_str(), "-", "-", "-", "-", "-",
                  "-", "SKIP (not supported on this GPU)");
      continue;
    }
    ++run;
    failed += !r.pass;
    std::printf("%-40s %9.2e %9.2e %9.2e %9.2e %9.2e %4s  %s\n", r.name.c_str(), r.o, r.lse, r.dq,
                r.dk, r.dv, r.det_ok ? "ok" : "DIFF", r.pass ? "PASS" : "FAIL");
    std::fflush(stdout);
  }
  std::printf("%d passed, %d failed, %d skipped\n", run - failed, failed, skipped);
  return failed ? 1 : 0;
}
