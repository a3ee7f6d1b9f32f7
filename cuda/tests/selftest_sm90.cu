// Standalone GPU self-test and benchmark of the sm90 (Hopper, FA3-style)
// forward. No JAX needed.
//
// Test mode: for each case, random 16-bit Q, K, V (V and O with a head dim of
// their own for the head-dim pair 192 / 128, DeepSeek MLA: the cases named
// "mla", filter `mla`); O and LSE poisoned with
// NaN before every launch; the production forward (jax_flash::sm90::run_fwd)
// and every ablation of the tuning target that exists for the case
// (sm90_fwd_ablation.h: without pingpong, without the intra-warpgroup
// overlap, without both, Q in shared memory, eager rescaling, the static
// scheduler, O staging toggled; bf16 only) against a float64 CPU reference
// from the same rounded inputs. One row per case: the worst O error over the
// configurations (relative to the largest |O|, floored at 0.05), the worst
// LSE error (absolute; -inf must match exactly) and the configurations that
// failed. Exit code 1 if any case fails. Softcap cases also print one line
// per configuration with the project's error criterion (tests/reference.py:
// max abs error <= 2 x that of same-dtype XLA attention + 1e-5, O and LSE),
// the XLA path emulated on the host (baseline_fwd). Configurations marked
// approximate (sc-mufu: tanh.approx.f32, relative error 2^-11) are held to
// O 0.1 and LSE softcap x 2^-8 in the PASS/FAIL column (still O(1) below a
// wrong mask or tile), and their criterion lines show how far they are from
// the standard.
// Attention dropout (the cases named
// "dropout", filter `dropout`; every bucket and the pair): rates 0.1-0.5,
// broadcast or not, at the nonzero call origin of kDropoutWords
// (selftest_common.h), the reference drawing Dropout::keep (philox.h) per
// element; they run the production dropout kernel and the dropout
// ablations (drop-alt: the keep mask drawn the other way, producer bit mask
// or consumer Philox), so a mask that differs from the generator's anywhere
// fails by O(1).
//
// Bench mode (--bench): TF/s of B=2, T=S=8192 at (D=128, H=16), (D=64, H=32),
// (D=256, H=8), (D=192, D_v=128, H=16: "mla"), causal and not, plus short
// causal shapes (B*T = 16k), for the production kernel, every ablation and the
// sm80 kernel (jax_flash::sm80::run_fwd): the configurations of a row are
// timed interleaved, round by round (10 back-to-back launches between two
// events, median of 7 rounds), because a fixed order showed up to 10% drift
// between identical kernels; FLOPs = 2 B H T S (D + D_v) (halved when
// causal). Also prints the worst max |O_c - O_default| over the
// configurations and sm80, rerun after the timing with O poisoned. A filter
// with --bench keeps the rows whose name contains it (--bench mla). The rows
// named "dropout" (--bench dropout): rate 0.1 at D = 64 / 128 / 256 and the
// pair, causal and not: the production dropout kernel, drop-alt, drop-qsm
// where it exists and sm80's (the same keep mask in every column: max|dO|
// is rounding only, 0 between configurations that differ only in where the
// mask is drawn).
//
// Build: tools/build/build_sm90_tests.sh (see cuda/tests/README.md).
// Options: ./selftest_sm90 [filter-substring] [--quick] [--list]
//                          [--bench [--launches=N] [--rows=N] [filter-substring]]
// (--list: the ablations and the (bucket, mask) where each exists;
// --launches=300 --rows=2: the D=128 rows with the GPU at its power cap, as in
// a sustained JAX run; the default 10 launches per round stay below it.)
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
#include "sm90/launch.h"
#include "gpu_wait.h"
#include "selftest_common.h"
#include "sm90_fwd_ablation.h"

using jax_flash::DType;
using jax_flash::FwdParams;
namespace abl = jax_flash::sm90::ablation;

struct Case {
  std::string name;
  int B, T, S, H, Hk, D;
  bool causal = false;
  int wl = -1, wr = -1;
  bool segments = false;
  float softcap = 0.f;
  float scale_mul = 1.f;  // scale = scale_mul / sqrt(D)
  bool fp16 = false;
  int pitch_pad = 0;  // extra elements per row (non-contiguous strides)
  int sms = 0;        // > 0: pretend the GPU has this many SMs (many tiles per CTA)
  // > 0: K row s scaled by 1 + k_ramp * (S - 1 - s) / (S - 1), so the scores
  // grow in the order the kernels visit the KV blocks (highest first): the
  // running row max keeps rising, and the lazy rescaling (every configuration
  // but "eager") must rescale O mid-row (a numpy model of the hdim-128 cases: about half
  // (x4, scale 1) / nearly all (x8, scale 2) of the warp x block steps
  // rescale; skipping those rescales gives O errors > 100x the tolerance).
  float k_ramp = 0.f;
  bool sinks = false;  // learnable sinks: one random logit per (batch, head)
  int Dv = 0;          // value head dim (v and o); 0: D
  float dropout = 0.f;          // attention dropout rate (selftest_common.h dropout_args)
  bool drop_broadcast = false;  // one mask for every (batch, head)
  int dv() const { return Dv > 0 ? Dv : D; }
};

// ------------------------------------------------------------------ device helpers
// The dynamic scheduler's per-call workspace (FwdParams::sm90_tile_counter):
// one device int, poisoned before each test launch (run_fwd must zero it).
static int32_t* tile_counter() {
  static int32_t* p = dev_alloc<int32_t>(1);
  return p;
}

// o: O's layout (q's rows with v's head dim).
static FwdParams make_params(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& o, const void* dq, const void* dk, const void* dv, void* d_o,
                             float* d_lse, const int32_t* d_qs, const int32_t* d_ks, double scale) {
  FwdParams fp{};
  fp.q = dq;
  fp.k = dk;
  fp.v = dv;
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
  fp.o_batch_stride = o.batch_stride();
  fp.o_row_stride = o.row_stride();
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
  fp.dtype = c.fp16 ? DType::kFloat16 : DType::kBFloat16;
  CHECK_CUDA(cudaDeviceGetAttribute(&fp.num_sms, cudaDevAttrMultiProcessorCount, 0));
  if (c.sms > 0) fp.num_sms = c.sms;
  fp.sm90_tile_counter = tile_counter();
  return fp;
}

// The baseline of the error criterion for the softcap report, as
// tests/reference.py dense_attention_jax computes it in the input dtype:
// float32 logits (float accumulation of the rounded inputs), softcap, mask and
// softmax in float32, P rounded to the input dtype, P V in float32, O rounded
// to the input dtype; the LSE in float32. o: dense [B][T][H][Dv].
static void baseline_fwd(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v,
                         const std::vector<int>& qs, const std::vector<int>& ks, double scale,
                         const std::vector<float>* sinks, std::vector<double>& o, std::vector<double>& lse) {
  const int G = c.H / c.Hk, Dv = v.D;
  o.assign(size_t(c.B) * c.T * c.H * Dv, 0.0);
  lse.assign(size_t(c.B) * c.H * c.T, -INFINITY);
  std::vector<float> sc(c.S), acc(Dv);
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < c.H; ++h)
      for (int i = 0; i < c.T; ++i) {
        float m = -INFINITY;
        for (int j = 0; j < c.S; ++j) {
          float x = 0.f;
          for (int d = 0; d < c.D; ++d) x += float(q.at(b, i, h, d)) * float(k.at(b, j, h / G, d));
          x *= float(scale);
          if (c.softcap > 0.f) x = c.softcap * std::tanh(x / c.softcap);
          sc[j] = visible(c, i, j, qs, ks, b) ? x : -INFINITY;
          m = std::max(m, sc[j]);
        }
        const float sink = sinks ? (*sinks)[size_t(b) * c.H + h] : -INFINITY;
        m = std::max(m, sink);
        if (m == -INFINITY) continue;  // no visible key, no sink: O = 0, LSE = -inf
        float l = sinks ? std::exp(sink - m) : 0.f;
        for (int j = 0; j < c.S; ++j) {
          sc[j] = std::exp(sc[j] - m);
          l += sc[j];
        }
        lse[(size_t(b) * c.H + h) * c.T + i] = std::log(l) + m;
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int j = 0; j < c.S; ++j) {
          const float pj = from_bits(to_bits(sc[j] / l, c.fp16), c.fp16);
          for (int d = 0; d < Dv; ++d) acc[d] += pj * float(v.at(b, j, h / G, d));
        }
        for (int d = 0; d < Dv; ++d)
          o[((size_t(b) * c.T + i) * c.H + h) * Dv + d] = from_bits(to_bits(acc[d], c.fp16), c.fp16);
      }
}

// max |x - ref| over the finite entries of ref.
static double max_abs_diff(const std::vector<double>& x, const std::vector<double>& ref) {
  double e = 0;
  for (size_t i = 0; i < ref.size(); ++i)
    if (std::isfinite(ref[i])) e = std::max(e, std::fabs(x[i] - ref[i]));
  return e;
}

struct Row {
  double o = 0, lse = 0;
  std::string report;  // softcap: one line per configuration (the error criterion)
  std::string failed;  // names of the configurations that failed
  int configs_run = 0;
  bool pass = true;
  bool skipped = false;
};

static Row run_case(const Case& c, std::mt19937& rng) {
  const bool fp16 = c.fp16;
  const double scale = c.scale_mul / std::sqrt(double(c.D));
  Tensor q = make_tensor(c.B, c.T, c.H, c.D, c.pitch_pad, fp16, rng, 1.f);
  Tensor k = make_tensor(c.B, c.S, c.Hk, c.D, c.pitch_pad, fp16, rng, 1.f);
  if (c.k_ramp > 0.f)
    for (int b = 0; b < c.B; ++b)
      for (int j = 0; j < c.S; ++j) {
        const float g = 1.f + c.k_ramp * float(c.S - 1 - j) / float(std::max(c.S - 1, 1));
        for (int h = 0; h < c.Hk; ++h)
          for (int d = 0; d < c.D; ++d) {
            const uint16_t bits = to_bits(float(k.at(b, j, h, d)) * g, fp16);
            k.bits[k.idx(b, j, h, d)] = bits;
            k.at(b, j, h, d) = from_bits(bits, fp16);
          }
      }
  Tensor v = make_tensor(c.B, c.S, c.Hk, c.dv(), c.pitch_pad, fp16, rng, 1.f);
  const Tensor o{c.B, c.T, c.H, c.dv(), c.pitch_pad, {}, {}};  // O's layout only
  std::vector<int> qs, ks;
  if (c.segments) {
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
  const std::vector<float> sinks = random_sinks(c.sinks, c.B, c.H, rng);
  // Dropout: the reference draws Dropout::keep per element with the same key
  // words (kDropoutWords: a nonzero origin), the kernels read a device copy.
  jax_flash::DropoutArgs drop_args = dropout_args(c.dropout, c.drop_broadcast);
  jax_flash::DropoutArgs host_drop = drop_args;
  host_drop.words = kDropoutWords;
  const jax_flash::Dropout drop_ref(host_drop);
  const Reference ref = reference(c, q, k, v, nullptr, qs, ks, scale, drop_args.enabled() ? &drop_ref : nullptr,
                                  c.sinks ? &sinks : nullptr);  // forward only
  uint32_t* d_words = nullptr;
  if (drop_args.enabled()) {
    d_words = dev_alloc<uint32_t>(std::size(kDropoutWords));
    CHECK_CUDA(cudaMemcpy(d_words, kDropoutWords, sizeof(kDropoutWords), cudaMemcpyHostToDevice));
    drop_args.words = d_words;
  }

  uint16_t *dq = upload(q), *dk = upload(k), *dv = upload(v);
  uint16_t* d_o = dev_alloc<uint16_t>(o.count());
  const size_t nstat = size_t(c.B) * c.H * c.T;
  float* d_lse = dev_alloc<float>(nstat);
  int32_t *d_qs = nullptr, *d_ks = nullptr;
  if (c.segments) {
    d_qs = dev_alloc<int32_t>(qs.size());
    d_ks = dev_alloc<int32_t>(ks.size());
    CHECK_CUDA(cudaMemcpy(d_qs, qs.data(), qs.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_ks, ks.data(), ks.size() * 4, cudaMemcpyHostToDevice));
  }
  FwdParams fp = make_params(c, q, k, v, o, dq, dk, dv, d_o, d_lse, d_qs, d_ks, scale);
  float* d_sinks = upload(sinks);
  fp.sinks = d_sinks;
  fp.dropout = drop_args;

  Row row;
  std::vector<uint16_t> o_bits(o.count());
  std::vector<float> lse(nstat);
  const double tol_o = fp16 ? 4e-3 : 2e-2, tol_lse = 2e-3;
  // Softcap: the criterion's baseline (same-dtype XLA) and its errors.
  double base_o = 0, base_lse = 0;
  if (c.softcap > 0.f) {
    std::vector<double> bo, blse;
    baseline_fwd(c, q, k, v, qs, ks, scale, c.sinks ? &sinks : nullptr, bo, blse);
    base_o = max_abs_diff(bo, ref.o);
    base_lse = max_abs_diff(blse, ref.lse);
    char line[160];
    std::snprintf(line, sizeof(line), "    %-10s O %.2e  LSE %.2e  (same-dtype XLA on the host; bounds 2x + 1e-5)\n",
                  "baseline", base_o, base_lse);
    row.report += line;
  }
  for (int a = 0; a < abl::kNumFwdAblations; ++a) {
    if (!abl::fwd_ablation_available(a, fp)) {
      if (a == 0) {
        row.skipped = true;
        break;
      }
      continue;  // this ablation does not exist for the case's bucket / mask / dtype
    }
    const char* name = abl::kFwdAblations[a].name;
    CHECK_CUDA(cudaMemset(d_o, 0xFF, o.count() * 2));
    CHECK_CUDA(cudaMemset(d_lse, 0xFF, nstat * 4));
    CHECK_CUDA(cudaMemset(fp.sm90_tile_counter, 0x55, 4));  // the launcher zeroes it when it needs it
    CHECK_CUDA(abl::fwd_ablation_run(a, fp, 0));
    sync_or_die(c.name + " " + name);
    CHECK_CUDA(cudaMemcpy(o_bits.data(), d_o, o.count() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(lse.data(), d_lse, nstat * 4, cudaMemcpyDeviceToHost));
    ++row.configs_run;

    double e = 0, rm = 0;
    for (int b = 0; b < c.B; ++b)
      for (int t = 0; t < c.T; ++t)
        for (int h = 0; h < c.H; ++h)
          for (int d = 0; d < o.D; ++d) {
            const double r = ref.o[((size_t(b) * c.T + t) * c.H + h) * o.D + d];
            const double diff = std::fabs(from_bits(o_bits[o.idx(b, t, h, d)], fp16) - r);
            e = std::isnan(diff) ? INFINITY : std::max(e, diff);
            rm = std::max(rm, std::fabs(r));
          }
    // The row padding of O must stay untouched (0xFFFF): columns past head_dim_v
    // and rows past seqlen_q are clipped by the TMA store.
    bool pad_ok = true;
    for (size_t i = 0; i < o_bits.size(); ++i) {
      const int64_t rs = o.row_stride();
      if ((int64_t(i) % rs) >= int64_t(c.H) * o.D && o_bits[i] != 0xFFFF) pad_ok = false;
    }
    const double oerr = pad_ok ? e / std::max(rm, 0.05) : INFINITY;
    const double o_abs = e;
    double lerr = 0;
    for (size_t i = 0; i < nstat; ++i) {
      const double r = ref.lse[i], g = lse[i];
      if (std::isinf(r) || std::isinf(g) || std::isnan(g)) {
        if (!(std::isinf(r) && std::isinf(g) && r < 0 && g < 0)) lerr = INFINITY;
      } else {
        lerr = std::max(lerr, std::fabs(g - r));
      }
    }
    row.o = std::max(row.o, oerr);
    row.lse = std::max(row.lse, lerr);
    const bool approx = abl::kFwdAblations[a].approximate;
    const double cfg_tol_o = approx ? 0.1 : tol_o;
    const double cfg_tol_lse = approx ? std::max(tol_lse, c.softcap * 0x1p-8) : tol_lse;
    if (c.softcap > 0.f) {
      const double bo = 2 * base_o + 1e-5, bl = 2 * base_lse + 1e-5;
      char line[160];
      std::snprintf(line, sizeof(line), "    %-10s O %.2e (%.2fx bound)  LSE %.2e (%.2fx bound)  %s\n", name, o_abs,
                    o_abs / bo, lerr, lerr / bl, o_abs <= bo && lerr <= bl ? "criterion ok" : "CRITERION OVER");
      row.report += line;
    }
    if (!(oerr <= cfg_tol_o && lerr <= cfg_tol_lse)) {
      row.pass = false;
      row.failed += (row.failed.empty() ? "" : ",") + std::string(name);
    }
  }
  for (void* ptr : std::initializer_list<void*>{dq, dk, dv, d_o, d_lse, d_qs, d_ks, d_sinks, d_words})
    if (ptr) CHECK_CUDA(cudaFree(ptr));
  return row;
}

// The buckets' head dims and the head-dim pair 192 / 128 (DeepSeek MLA).
struct HeadDims {
  int D, Dv;        // Dv 0: D
  const char* tag;  // case names start with it
};

static std::vector<Case> all_cases(bool quick) {
  std::vector<Case> cs;
  for (const HeadDims& hd : {HeadDims{64, 0, "d64"}, HeadDims{96, 0, "d96"}, HeadDims{128, 0, "d128"},
                             HeadDims{256, 0, "d256"}, HeadDims{192, 128, "mla d192v128"}}) {
    const int D = hd.D;
    const std::string d = hd.tag;
    const size_t first = cs.size();  // this head dim's cases get hd.Dv at the end
    Case base{d + " plain", 2, 37, 53, 4, 2, D};
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
    c.name = d + " fp16 causal";
    c.causal = true;
    c.fp16 = true;
    cs.push_back(c);
    c = Case{d + " multiblock causal T=1000 S=1531", 1, 1000, 1531, 2, 1, D};
    c.causal = true;
    cs.push_back(c);
    c = base;
    c.name = d + " sinks causal T>S (empty rows)";
    c.causal = true;
    c.T = 53;
    c.S = 37;
    c.sinks = true;
    cs.push_back(c);
    c = Case{d + " sinks persistent 2 CTAs window+seg fp16", 2, 300, 517, 4, 2, D};
    c.wl = 100;
    c.segments = true;
    c.fp16 = true;
    c.sms = 2;
    c.sinks = true;
    cs.push_back(c);
    c = Case{d + " persistent 3 CTAs plain strided", 2, 300, 517, 4, 2, D};
    c.pitch_pad = 8;
    c.sms = 3;
    cs.push_back(c);
    // Tiles without keys between tiles with keys, several tiles per CTA (the
    // O-in-V hand-off, the dynamic scheduler's index exchange).
    c = Case{d + " persistent 2 CTAs causal T=600 S=200", 2, 600, 200, 4, 2, D};
    c.causal = true;
    c.sms = 2;
    cs.push_back(c);
    c = Case{d + " persistent 1 CTA causal GQA", 1, 700, 700, 4, 2, D};
    c.causal = true;
    c.sms = 1;
    cs.push_back(c);
    // Gemma 2's attention softcap (50) at its scale (logits ~ N(0, 1): the
    // tanh near 0, where the forms differ most), at 16x the scale (every
    // tanh value, saturation), and past the softcap kernels' range (57.5 >
    // 52: only the production kernel).
    c = Case{d + " softcap 50 causal GQA", 1, 600, 900, 4, 2, D};
    c.causal = true;
    c.softcap = 50.f;
    cs.push_back(c);
    c = Case{d + " softcap 50 x16 window", 1, 500, 700, 2, 1, D};
    c.softcap = 50.f;
    c.scale_mul = 16.f;
    c.wl = 300;
    cs.push_back(c);
    c = Case{d + " softcap 57.5 x16 causal T<S", 1, 300, 517, 2, 1, D};
    c.softcap = 57.5f;
    c.scale_mul = 16.f;
    c.causal = true;
    cs.push_back(c);
    if (!quick) {
      cs.push_back(Case{d + " multiblock plain T=1000 S=1531", 1, 1000, 1531, 2, 2, D});
      c = Case{d + " multiblock MQA causal fp16", 1, 300, 517, 4, 1, D};
      c.causal = true;
      c.fp16 = true;
      cs.push_back(c);
      c = Case{d + " multiblock window+seg", 1, 333, 290, 2, 2, D};
      c.wl = 100;
      c.wr = 20;
      c.segments = true;
      cs.push_back(c);
      c = Case{d + " persistent 2 CTAs causal GQA", 2, 517, 300, 4, 2, D};
      c.causal = true;
      c.sms = 2;
      cs.push_back(c);
      c = Case{d + " multiblock softcap window", 1, 400, 400, 2, 1, D};
      c.softcap = 5.f;
      c.scale_mul = 2.f;
      c.wl = 150;
      cs.push_back(c);
    }
    for (size_t i = first; i < cs.size(); ++i) cs[i].Dv = hd.Dv;
  }
  // Head dims served by a larger bucket (TMA zero-fills the columns).
  cs.push_back(Case{"d40 (bucket 64)", 2, 37, 53, 4, 2, 40});
  cs.push_back(Case{"d80 (bucket 128) strided", 2, 37, 53, 4, 4, 80, false, -1, -1, false, 0.f, 1.f,
                    false, 8});
  Case c{"d200 (bucket 256) causal", 2, 37, 53, 2, 1, 200};
  c.causal = true;
  cs.push_back(c);
  cs.push_back(Case{"tiny T=1 S=1", 1, 1, 1, 1, 1, 64});
  c = Case{"window(0,0) diag only", 1, 70, 70, 2, 1, 128};
  c.wl = 0;
  c.wr = 0;
  cs.push_back(c);
  c = Case{"left window only 16", 1, 150, 150, 2, 1, 64};
  c.wl = 16;
  cs.push_back(c);
  c = Case{"causal T=S=1 many heads, 1 CTA", 3, 1, 1, 8, 8, 128};
  c.causal = true;
  c.sms = 1;
  cs.push_back(c);
  c = Case{"S=0 (no keys: O=0, LSE=-inf)", 1, 20, 0, 2, 1, 64};
  cs.push_back(c);
  // Rising row maxima (Case::k_ramp): the lazy rescaling's rescale
  // branch, mixed with skipped steps; then with causal T < S, whose first
  // visited KV block is fully masked for a tile's top rows (m = -inf until a
  // later block). Last in the list: the cases above keep their inputs.
  for (const HeadDims& hd : {HeadDims{64, 0, "d64"}, HeadDims{128, 0, "d128"}, HeadDims{256, 0, "d256"},
                             HeadDims{192, 128, "mla d192v128"}}) {
    const std::string d = hd.tag;
    c = Case{d + " K ramp x4 (lazy rescale)", 1, 1000, 1531, 2, 1, hd.D};
    c.k_ramp = 3.f;
    c.Dv = hd.Dv;
    cs.push_back(c);
    c = Case{d + " K ramp x8 s2 causal T<S (lazy)", 2, 1000, 1531, 2, 2, hd.D};
    c.k_ramp = 7.f;
    c.scale_mul = 2.f;
    c.causal = true;
    c.Dv = hd.Dv;
    cs.push_back(c);
  }
  // Attention dropout, every bucket and the pair (after the cases above, which
  // keep their inputs): the keep mask's positions (tails, the call origin,
  // broadcast), several tiles per CTA (the mask ring's phases across tiles,
  // tiles without keys, the dynamic scheduler's hand-off to the mask warps),
  // multi-block rows.
  for (const HeadDims& hd : {HeadDims{64, 0, "d64"}, HeadDims{128, 0, "d128"}, HeadDims{256, 0, "d256"},
                             HeadDims{192, 128, "mla d192v128"}}) {
    const std::string d = hd.tag;
    const size_t first = cs.size();
    c = Case{d + " dropout 0.1 GQA", 2, 37, 53, 4, 2, hd.D};
    c.dropout = 0.1f;
    cs.push_back(c);
    c.name = d + " dropout 0.5 causal T>S";
    c.dropout = 0.5f;
    c.causal = true;
    c.T = 53;
    c.S = 37;
    cs.push_back(c);
    c = Case{d + " dropout 0.3 persistent 2 CTAs causal T=600 S=200", 2, 600, 200, 4, 2, hd.D};
    c.dropout = 0.3f;
    c.causal = true;
    c.sms = 2;
    cs.push_back(c);
    c = Case{d + " dropout 0.2 persistent 1 CTA causal GQA fp16", 1, 700, 700, 4, 2, hd.D};
    c.dropout = 0.2f;
    c.causal = true;
    c.sms = 1;
    c.fp16 = true;
    cs.push_back(c);
    c = Case{d + " dropout 0.5 broadcast window+seg 3 CTAs", 2, 300, 517, 4, 2, hd.D};
    c.dropout = 0.5f;
    c.drop_broadcast = true;
    c.wl = 100;
    c.segments = true;
    c.sms = 3;
    cs.push_back(c);
    if (!quick) {
      c = Case{d + " dropout 0.1 multiblock plain T=1000 S=1531", 1, 1000, 1531, 2, 2, hd.D};
      c.dropout = 0.1f;
      cs.push_back(c);
      c = Case{d + " dropout 0.5 multiblock MQA causal", 1, 300, 517, 4, 1, hd.D};
      c.dropout = 0.5f;
      c.causal = true;
      cs.push_back(c);
    }
    for (size_t i = first; i < cs.size(); ++i) cs[i].Dv = hd.Dv;
  }
  return cs;
}

// ------------------------------------------------------------------ bench

// launches: back-to-back launches per round (10 keeps the GPU below its power cap;
// a few hundred make the figure the sustained, power-capped one); rows: only the first
// `rows` shapes (0 = all); filter: only the shapes whose name contains it.
// softcap > 0: every shape with that softcap (the production kernel, the
// softcap kernels and the other ablations), plus the production kernel
// without softcap ("nosc") in the same interleaved rounds: the cost of softcap.
static void bench(int launches, int rows, const std::string& filter, float softcap) {
  struct Shape {
    int D, H, B, T;
    bool causal;
    int Dv = 0;  // 0: D
    float dropout = 0.f;  // attention dropout rate
    int dv() const { return Dv > 0 ? Dv : D; }
    std::string name() const {
      return (Dv > 0 ? "mla d" + std::to_string(D) + "v" + std::to_string(Dv) : "d" + std::to_string(D)) +
             (dropout > 0.f ? " dropout" : "");
    }
  };
  // The reference shapes (B=2, T=S=8192), the short causal ones of the
  // sweep (B*T = 16k), where the tile schedule matters most, and DeepSeek
  // MLA's head-dim pair at the reference shape (H=16; tokamax's Mosaic
  // kernels: 598 TF/s, causal 625, bench_attention.py --preset mla).
  const Shape shapes[] = {
      {128, 16, 2, 8192, false}, {128, 16, 2, 8192, true}, {64, 32, 2, 8192, false},
      {64, 32, 2, 8192, true},   {256, 8, 2, 8192, false}, {256, 8, 2, 8192, true},
      {64, 32, 32, 512, true},   {64, 32, 16, 1024, true},  {128, 16, 16, 1024, true},
      {256, 8, 16, 1024, true},
      {128, 16, 8, 2048, true},  {256, 8, 8, 2048, true},   {192, 16, 2, 8192, false, 128},
      {192, 16, 2, 8192, true, 128},
      {128, 16, 2, 8192, false, 0, 0.1f}, {128, 16, 2, 8192, true, 0, 0.1f},
      {64, 32, 2, 8192, false, 0, 0.1f},  {64, 32, 2, 8192, true, 0, 0.1f},
      {256, 8, 2, 8192, false, 0, 0.1f},  {256, 8, 2, 8192, true, 0, 0.1f},
      {192, 16, 2, 8192, false, 128, 0.1f}, {192, 16, 2, 8192, true, 128, 0.1f}};
  uint32_t* d_words = dev_alloc<uint32_t>(std::size(kDropoutWords));
  CHECK_CUDA(cudaMemcpy(d_words, kDropoutWords, sizeof(kDropoutWords), cudaMemcpyHostToDevice));
  const int nv = abl::kNumFwdAblations;
  constexpr int kRounds = 7;
  const int kLaunches = launches;
  std::printf("bench: T=S bf16, TF/s (FLOPs 2 B H T S (D + D_v), halved when causal); each cell the median of\n"
              "%d rounds x %d back-to-back launches, the configurations of a row interleaved round by\n"
              "round (clock/power drift hits all alike); '-' = the ablation does not exist there (it would\n"
              "equal the default or an earlier column; --list). best = fastest sm90 configuration / default;\n"
              "max|dO| = worst max|O_c - O_default| over the configurations and sm80, rerun\n"
              "after the timing with O poisoned (inf/nan = a tile not written).\n",
              kRounds, kLaunches);
  if (softcap > 0.f)
    std::printf("softcap %g: every configuration with it; nosc = the default without softcap (same rounds);\n"
                "best/nosc = the fastest softcap configuration's speed over nosc (1 - cost).\n", softcap);
  std::printf("%-4s %-3s %-3s %-2s %-5s %-3s %-4s", "D", "D_v", "H", "B", "T", "cau", "drop");
  for (int v = 0; v < nv; ++v) std::printf(" %9s", abl::kFwdAblations[v].name);
  std::printf(" %7s", "sm80");
  if (softcap > 0.f) std::printf(" %7s %9s %9s", "nosc", "dflt/nosc", "best/nosc");
  std::printf("  %-16s %s\n", "best", "max|dO|");
  std::mt19937 rng(7);
  int row = 0;
  for (const Shape& sh : shapes) {
    if (!filter.empty() && sh.name().find(filter) == std::string::npos) continue;
    if (rows > 0 && row++ >= rows) break;
    const int B = sh.B, T = sh.T, S = sh.T, Dv = sh.dv();
    const size_t n = size_t(B) * T * sh.H * sh.D;  // q and k (T = S)
    const size_t n_v = size_t(B) * T * sh.H * Dv;  // v and o
    std::vector<uint16_t> h(std::max(n, n_v));
    std::normal_distribution<float> nd(0.f, 1.f);
    uint16_t *dq = dev_alloc<uint16_t>(n), *dk = dev_alloc<uint16_t>(n), *dv = dev_alloc<uint16_t>(n_v);
    for (uint16_t* ptr : {dq, dk, dv}) {
      for (auto& x : h) x = to_bits(nd(rng), false);
      CHECK_CUDA(cudaMemcpy(ptr, h.data(), (ptr == dv ? n_v : n) * 2, cudaMemcpyHostToDevice));
    }
    uint16_t *d_o = dev_alloc<uint16_t>(n_v), *d_o80 = dev_alloc<uint16_t>(n_v);
    float* d_lse = dev_alloc<float>(size_t(B) * sh.H * T);
    FwdParams p{};
    p.q = dq;
    p.k = dk;
    p.v = dv;
    p.o = d_o;
    p.lse = d_lse;
    const int64_t rs = int64_t(sh.H) * sh.D, rs_v = int64_t(sh.H) * Dv;
    p.q_row_stride = p.k_row_stride = rs;
    p.v_row_stride = p.o_row_stride = rs_v;
    p.q_head_stride = p.k_head_stride = sh.D;
    p.v_head_stride = p.o_head_stride = Dv;
    p.q_batch_stride = p.k_batch_stride = rs * T;
    p.v_batch_stride = p.o_batch_stride = rs_v * T;
    p.batch = B;
    p.seqlen_q = T;
    p.seqlen_k = S;
    p.num_heads = p.num_heads_k = sh.H;
    p.head_dim = sh.D;
    p.head_dim_v = Dv;
    p.scale = float(1.0 / std::sqrt(double(sh.D)));
    p.window_left = -1;
    p.window_right = sh.causal ? 0 : -1;
    p.softcap = softcap;
    p.dtype = DType::kBFloat16;
    CHECK_CUDA(cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, 0));
    p.sm90_tile_counter = tile_counter();  // one stream: launches never overlap
    p.dropout = dropout_args(sh.dropout, false);
    if (p.dropout.enabled()) p.dropout.words = d_words;
    const double flops = 2.0 * B * sh.H * double(T) * S * (sh.D + Dv) * (sh.causal ? 0.5 : 1.0);

    // Configurations: the sm90 ablations 0..nv-1 (those that exist here), then sm80.
    std::vector<int> cfg;  // ablation index of each configuration
    std::vector<int> idx(nv + 1, -1);
    for (int v = 0; v < nv; ++v) {
      if (abl::fwd_ablation_available(v, p)) {
        idx[v] = int(cfg.size());
        cfg.push_back(v);
      }
    }
    FwdParams p80 = p;
    p80.o = d_o80;
    FwdParams p_nosc = p;  // softcap > 0: the default without it, into sm80's O buffer
    p_nosc.o = d_o80;
    p_nosc.softcap = 0.f;
    const int i80 = int(cfg.size()), inosc = softcap > 0.f ? i80 + 1 : -1;
    auto launch = [&](int c) {
      return c == inosc ? jax_flash::sm90::run_fwd(p_nosc, 0)
             : c == i80 ? jax_flash::sm80::run_fwd(p80, 0)
                        : abl::fwd_ablation_run(cfg[c], p, 0);
    };
    const int ncfg = int(cfg.size()) + (softcap > 0.f ? 2 : 1);
    idx[nv] = i80;
    std::vector<bool> ok(ncfg, true);
    const std::string where = "bench D/H/B/T " + std::to_string(sh.D) + "/" + std::to_string(sh.H) + "/" + std::to_string(B) + "/" + std::to_string(T) + (sh.causal ? " causal" : "");
    for (int c = 0; c < ncfg; ++c) {  // warm-up, one configuration at a time
      ok[c] = launch(c) == cudaSuccess;
      sync_or_die(where + " config " + std::to_string(c));
    }
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    std::vector<std::vector<double>> ms(ncfg);
    for (int r = 0; r < kRounds; ++r)
      for (int c = 0; c < ncfg; ++c) {
        if (!ok[c]) continue;
        CHECK_CUDA(cudaEventRecord(e0));
        for (int i = 0; i < kLaunches; ++i) launch(c);
        CHECK_CUDA(cudaEventRecord(e1));
        wait_or_die([&] { return cudaEventQuery(e1); }, where + " config " + std::to_string(c));
        CHECK_CUDA(cudaEventSynchronize(e1));
        float t = 0;
        CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
        ms[c].push_back(t / kLaunches);
      }
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaEventDestroy(e0));
    CHECK_CUDA(cudaEventDestroy(e1));
    std::vector<double> tf(ncfg, -1);
    for (int c = 0; c < ncfg; ++c)
      if (ok[c]) tf[c] = flops / (median(ms[c]) * 1e-3) / 1e12;

    // O of every configuration (after the timing: the dynamic scheduler's
    // counter has been zeroed and reused many times) against the default's,
    // and the default's against sm80's.
    double worst = 0;
    std::vector<uint16_t> ref(n_v), got(n_v);
    auto run_poisoned = [&](int c, uint16_t* out, std::vector<uint16_t>& host) {
      CHECK_CUDA(cudaMemset(out, 0xFF, n_v * 2));
      if (launch(c) != cudaSuccess) return false;
      sync_or_die(where + " check config " + std::to_string(c));
      CHECK_CUDA(cudaMemcpy(host.data(), out, n_v * 2, cudaMemcpyDeviceToHost));
      return true;
    };
    auto maxdiff = [&](const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
      double m = 0;
      for (size_t i = 0; i < n_v; ++i) {
        const double d = std::fabs(double(from_bits(a[i], false)) - from_bits(b[i], false));
        m = std::isnan(d) ? INFINITY : std::max(m, d);
      }
      return m;
    };
    if (idx[0] >= 0 && run_poisoned(idx[0], d_o, ref)) {
      for (int v = 1; v < nv; ++v)
        if (idx[v] >= 0 && run_poisoned(idx[v], d_o, got)) worst = std::max(worst, maxdiff(ref, got));
      if (ok[i80] && run_poisoned(i80, d_o80, got)) worst = std::max(worst, maxdiff(ref, got));
    } else {
      worst = INFINITY;
    }

    std::printf("%-4d %-3d %-3d %-2d %-5d %-3s %-4.2g", sh.D, Dv, sh.H, B, T, sh.causal ? "yes" : "no",
                double(sh.dropout));
    int best = -1;
    for (int v = 0; v <= nv; ++v) {
      const double x = idx[v] >= 0 ? tf[idx[v]] : -1;
      if (x < 0)
        std::printf(v < nv ? " %9s" : " %7s", "-");
      else
        std::printf(v < nv ? " %9.1f" : " %7.1f", x);
      if (v < nv && x > 0 && (best < 0 || x > tf[idx[best]])) best = v;
    }
    if (softcap > 0.f) {
      const double nosc = ok[inosc] ? tf[inosc] : -1;
      const double dflt = idx[0] >= 0 ? tf[idx[0]] : -1;
      const double top = best >= 0 ? tf[idx[best]] : -1;
      std::printf(" %7.1f %9.3f %9.3f", nosc, nosc > 0 ? dflt / nosc : 0., nosc > 0 ? top / nosc : 0.);
    }
    char best_s[40] = "-";
    if (best >= 0 && idx[0] >= 0 && tf[idx[0]] > 0)
      std::snprintf(best_s, sizeof(best_s), "%s %.3fx", abl::kFwdAblations[best].name,
                    tf[idx[best]] / tf[idx[0]]);
    std::printf("  %-16s %.3g\n", best_s, worst);
    std::fflush(stdout);
    for (void* ptr : std::initializer_list<void*>{dq, dk, dv, d_o, d_o80, d_lse}) CHECK_CUDA(cudaFree(ptr));
  }
  CHECK_CUDA(cudaFree(d_words));
  std::printf("configurations: see selftest_sm90 --list\n");
}

// The ablations and the (bucket or pair, mask) where each exists.
static void list_ablations() {
  std::printf("sm90 forward configurations (cuda/tests/sm90_fwd_ablation.h), bf16; x = compiled,\n"
              "- = equal to the default or to an earlier row there (not compiled twice). Columns: head-dim bucket\n"
              "or pair (192v128: DeepSeek MLA), mask (plain = no causal-like bound, causal = right bound without\n"
              "a left one).\n");
  std::printf("%-9s  d64:plain causal  d128:plain causal  d256:plain causal  192v128:plain causal  what\n",
              "name");
  const int shapes[][2] = {{64, 64}, {128, 128}, {256, 256}, {192, 128}};
  for (int a = 0; a < abl::kNumFwdAblations; ++a) {
    std::printf("%-9s ", abl::kFwdAblations[a].name);
    for (const auto& shape : shapes) {
      for (bool causal : {false, true}) {
        FwdParams p{};
        p.head_dim = shape[0];
        p.head_dim_v = shape[1];
        p.dtype = DType::kBFloat16;
        p.window_left = -1;
        p.window_right = causal ? 0 : -1;
        p.softcap = abl::kFwdAblations[a].dropout ? 0.f : 30.f;  // the softcap kernels exist for softcap calls only
        p.dropout.threshold = abl::kFwdAblations[a].dropout ? 26u : 0u;  // a dropout ablation: a dropout call
        std::printf(" %6s", abl::fwd_ablation_launcher(a, p) != nullptr ? "x" : "-");
      }
      std::printf(shape[0] == shape[1] ? "   " : "      ");
    }
    std::printf("%s\n", abl::kFwdAblations[a].what);
  }
}

int main(int argc, char** argv) {
  std::string filter;
  bool quick = false, do_bench = false, do_list = false;
  int launches = 10, rows = 0;
  float softcap = 0.f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "--bench")
      do_bench = true;
    else if (a == "--list" || a == "--help")
      do_list = true;
    else if (a.rfind("--launches=", 0) == 0)
      launches = std::max(1, std::atoi(a.c_str() + 11));
    else if (a.rfind("--softcap=", 0) == 0)
      softcap = float(std::atof(a.c_str() + 10));
    else if (a.rfind("--rows=", 0) == 0)
      rows = std::atoi(a.c_str() + 7);
    else
      filter = a;
  }
  if (do_list) {
    list_ablations();
    return 0;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d), %d SMs\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  if (do_bench) {
    bench(launches, rows, filter, softcap);
    return 0;
  }
  std::mt19937 rng(1234);
  int failed = 0, run = 0, skipped = 0;
  std::printf("%-40s %9s %9s %3s  %s\n", "case", "O", "LSE", "#c", "result");
  for (const Case& c : all_cases(quick)) {
    if (!filter.empty() && c.name.find(filter) == std::string::npos) continue;
    const Row r = run_case(c, rng);
    if (r.skipped) {
      ++skipped;
      std::printf("%-40s %9s %9s %3s  %s\n", c.name.c_str(), "-", "-", "-", "SKIP (fwd_supported false)");
      continue;
    }
    ++run;
    failed += !r.pass;
    std::printf("%-40s %9.2e %9.2e %3d  %s%s\n", c.name.c_str(), r.o, r.lse, r.configs_run,
                r.pass ? "PASS" : "FAIL ", r.failed.c_str());
    std::printf("%s", r.report.c_str());
    std::fflush(stdout);
  }
  std::printf("%d passed, %d failed, %d skipped\n", run - failed, failed, skipped);
  return (failed || run == 0) ? 1 : 0;
}
