// Standalone GPU self-test and benchmark of the sm90 (Hopper, FA3-style)
// forward, jax_flash::sm90::run_fwd. No JAX needed.
//
// Test mode: for each case, random 16-bit Q, K, V; O and LSE poisoned with
// NaN before every launch; run_fwd for the default schedule and, in builds
// with -DJAX_FLASH_SM90_ABLATION, for the four explicit schedules
// (sm90_variant 1..4: pingpong+overlap, overlap, pingpong, neither); a float64
// CPU reference from the same rounded inputs. One row per case: the worst O
// error over the variants (relative to the largest |O|, floored at 0.05), the
// worst LSE error (absolute; -inf must match exactly) and the variants that
// failed. Exit code 1 if any case fails.
//
// Bench mode (--bench): TF/s of B=2, T=S=8192 at (D=128, H=16), (D=64, H=32),
// (D=256, H=8), causal and not, for every compiled variant and for the sm80
// kernel (jax_flash::sm80::run_fwd): 20 back-to-back launches between two
// events, median of 5 repeats; FLOPs = 4 B H T S D (halved when causal). Also
// prints max |O_sm90 - O_sm80| as a sanity check at scale.
//
// Build: tools/build_sm90_tests.sh (see cuda/tests/README.md).
// Options: ./selftest_sm90 [filter-substring] [--quick] [--bench]
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "jax_flash/params.h"
#include "sm80/launch.h"
#include "sm90/launch.h"

using jax_flash::DType;
using jax_flash::FwdParams;

#define CHECK_CUDA(x)                                                                    \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, \
                   __LINE__, cudaGetErrorString(e_));                                    \
      std::exit(2);                                                                      \
    }                                                                                    \
  } while (0)

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
};

// ------------------------------------------------------------------ 16-bit helpers
static uint16_t to_bits(float x, bool fp16) {
  uint16_t b;
  if (fp16) {
    __half h = __float2half_rn(x);
    std::memcpy(&b, &h, 2);
  } else {
    __nv_bfloat16 h = __float2bfloat16_rn(x);
    std::memcpy(&b, &h, 2);
  }
  return b;
}
static float from_bits(uint16_t b, bool fp16) {
  if (fp16) {
    __half_raw r;
    r.x = b;
    return __half2float(__half(r));
  }
  __nv_bfloat16_raw r;
  r.x = b;
  return __bfloat162float(__nv_bfloat16(r));
}

// A [batch, seq, heads, D] tensor stored with row pitch heads*D + pad.
struct Tensor {
  int B, L, H, D, pad;
  std::vector<uint16_t> bits;  // storage, NaN in the padding
  std::vector<double> val;     // dense [B][L][H][D] values (rounded)
  int64_t row_stride() const { return int64_t(H) * D + pad; }
  int64_t batch_stride() const { return int64_t(L) * row_stride(); }
  int64_t idx(int b, int l, int h, int d) const {
    return b * batch_stride() + l * row_stride() + int64_t(h) * D + d;
  }
  size_t count() const { return size_t(B) * L * row_stride(); }
  double at(int b, int l, int h, int d) const {
    return val[((size_t(b) * L + l) * H + h) * D + d];
  }
};

static Tensor make_tensor(int B, int L, int H, int D, int pad, bool fp16, std::mt19937& rng) {
  Tensor t{B, L, H, D, pad, {}, {}};
  t.bits.assign(t.count(), 0x7FC0);
  t.val.assign(size_t(B) * L * H * D, 0.0);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int b = 0; b < B; ++b)
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          const uint16_t bits = to_bits(nd(rng), fp16);
          t.bits[t.idx(b, l, h, d)] = bits;
          t.val[((size_t(b) * L + l) * H + h) * D + d] = from_bits(bits, fp16);
        }
  return t;
}

// ------------------------------------------------------------------ reference
static bool visible(const Case& c, int i, int j, const std::vector<int>& qs,
                    const std::vector<int>& ks, int b) {
  const int off = c.S - c.T;
  int wl = c.wl, wr = c.wr;
  if (c.causal) wr = wr < 0 ? 0 : std::min(wr, 0);
  if (wl >= 0 && j < i + off - wl) return false;
  if (wr >= 0 && j > i + off + wr) return false;
  if (c.segments && qs[size_t(b) * c.T + i] != ks[size_t(b) * c.S + j]) return false;
  return true;
}

static void reference(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v,
                      const std::vector<int>& qs, const std::vector<int>& ks, double scale,
                      std::vector<double>& o, std::vector<double>& lse) {
  const int B = c.B, T = c.T, S = c.S, H = c.H, D = c.D, G = c.H / c.Hk;
  o.assign(size_t(B) * T * H * D, 0.0);
  lse.assign(size_t(B) * H * T, 0.0);
  std::vector<double> p(S);
  std::vector<char> vis(S);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int hk = h / G;
      for (int i = 0; i < T; ++i) {
        double m = -INFINITY;
        for (int j = 0; j < S; ++j) {
          vis[j] = visible(c, i, j, qs, ks, b);
          if (!vis[j]) continue;
          double acc = 0;
          for (int d = 0; d < D; ++d) acc += q.at(b, i, h, d) * k.at(b, j, hk, d);
          acc *= scale;
          p[j] = c.softcap > 0 ? c.softcap * std::tanh(acc / c.softcap) : acc;
          m = std::max(m, p[j]);
        }
        double l = 0;
        for (int j = 0; j < S; ++j) {
          p[j] = vis[j] ? std::exp(p[j] - m) : 0.0;
          l += p[j];
        }
        const size_t li = (size_t(b) * H + h) * T + i;
        if (l == 0) {
          lse[li] = -INFINITY;
          continue;
        }
        lse[li] = m + std::log(l);
        for (int d = 0; d < D; ++d) {
          double acc = 0;
          for (int j = 0; j < S; ++j)
            if (p[j] != 0) acc += p[j] * v.at(b, j, hk, d);
          o[((size_t(b) * T + i) * H + h) * D + d] = acc / l;
        }
      }
    }
}

// ------------------------------------------------------------------ device helpers
template <typename T>
static T* dev_alloc(size_t n) {
  T* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}
static uint16_t* upload(const Tensor& t) {
  uint16_t* p = dev_alloc<uint16_t>(t.count());
  CHECK_CUDA(cudaMemcpy(p, t.bits.data(), t.count() * 2, cudaMemcpyHostToDevice));
  return p;
}

static FwdParams make_params(const Case& c, const Tensor& q, const Tensor& k, const Tensor& v,
                             const void* dq, const void* dk, const void* dv, void* d_o, float* d_lse,
                             const int32_t* d_qs, const int32_t* d_ks, double scale) {
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
  fp.v_head_stride = c.D;
  fp.o_batch_stride = q.batch_stride();  // O has Q's layout
  fp.o_row_stride = q.row_stride();
  fp.o_head_stride = c.D;
  fp.batch = c.B;
  fp.seqlen_q = c.T;
  fp.seqlen_k = c.S;
  fp.num_heads = c.H;
  fp.num_heads_k = c.Hk;
  fp.head_dim = c.D;
  fp.scale = float(scale);
  fp.softcap = c.softcap;
  fp.window_left = c.wl;
  fp.window_right = c.causal ? (c.wr < 0 ? 0 : std::min(c.wr, 0)) : c.wr;
  fp.causal = c.causal;
  fp.q_segment = d_qs;
  fp.kv_segment = d_ks;
  fp.dtype = c.fp16 ? DType::kFloat16 : DType::kBFloat16;
  CHECK_CUDA(cudaDeviceGetAttribute(&fp.num_sms, cudaDevAttrMultiProcessorCount, 0));
  if (c.sms > 0) fp.num_sms = c.sms;
  return fp;
}

struct Row {
  double o = 0, lse = 0;
  std::string failed_variants;
  int variants_run = 0;
  bool pass = true;
  bool skipped = false;
};

static Row run_case(const Case& c, std::mt19937& rng) {
  const bool fp16 = c.fp16;
  const double scale = c.scale_mul / std::sqrt(double(c.D));
  Tensor q = make_tensor(c.B, c.T, c.H, c.D, c.pitch_pad, fp16, rng);
  Tensor k = make_tensor(c.B, c.S, c.Hk, c.D, c.pitch_pad, fp16, rng);
  Tensor v = make_tensor(c.B, c.S, c.Hk, c.D, c.pitch_pad, fp16, rng);
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
  std::vector<double> ref_o, ref_lse;
  reference(c, q, k, v, qs, ks, scale, ref_o, ref_lse);

  uint16_t *dq = upload(q), *dk = upload(k), *dv = upload(v);
  uint16_t* d_o = dev_alloc<uint16_t>(q.count());
  const size_t nstat = size_t(c.B) * c.H * c.T;
  float* d_lse = dev_alloc<float>(nstat);
  int32_t *d_qs = nullptr, *d_ks = nullptr;
  if (c.segments) {
    d_qs = dev_alloc<int32_t>(qs.size());
    d_ks = dev_alloc<int32_t>(ks.size());
    CHECK_CUDA(cudaMemcpy(d_qs, qs.data(), qs.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_ks, ks.data(), ks.size() * 4, cudaMemcpyHostToDevice));
  }
  FwdParams fp = make_params(c, q, k, v, dq, dk, dv, d_o, d_lse, d_qs, d_ks, scale);

  Row row;
  std::vector<uint16_t> o_bits(q.count());
  std::vector<float> lse(nstat);
  const double tol_o = fp16 ? 4e-3 : 2e-2, tol_lse = 2e-3;
  for (int variant = 0; variant < 5; ++variant) {
    fp.sm90_variant = variant;
    if (!jax_flash::sm90::fwd_supported(fp)) {
      if (variant == 0) {
        row.skipped = true;
        break;
      }
      continue;  // variant not compiled in this build
    }
    CHECK_CUDA(cudaMemset(d_o, 0xFF, q.count() * 2));
    CHECK_CUDA(cudaMemset(d_lse, 0xFF, nstat * 4));
    CHECK_CUDA(jax_flash::sm90::run_fwd(fp, 0));
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(o_bits.data(), d_o, q.count() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(lse.data(), d_lse, nstat * 4, cudaMemcpyDeviceToHost));
    ++row.variants_run;

    double e = 0, rm = 0;
    for (int b = 0; b < c.B; ++b)
      for (int t = 0; t < c.T; ++t)
        for (int h = 0; h < c.H; ++h)
          for (int d = 0; d < c.D; ++d) {
            const double r = ref_o[((size_t(b) * c.T + t) * c.H + h) * c.D + d];
            const double diff = std::fabs(from_bits(o_bits[q.idx(b, t, h, d)], fp16) - r);
            e = std::isnan(diff) ? INFINITY : std::max(e, diff);
            rm = std::max(rm, std::fabs(r));
          }
    // The row padding of O must stay untouched (0xFFFF): columns past head_dim
    // and rows past seqlen_q are clipped by the TMA store.
    bool pad_ok = true;
    for (size_t i = 0; i < o_bits.size(); ++i) {
      const int64_t rs = q.row_stride();
      if ((int64_t(i) % rs) >= int64_t(c.H) * c.D && o_bits[i] != 0xFFFF) pad_ok = false;
    }
    const double oerr = pad_ok ? e / std::max(rm, 0.05) : INFINITY;
    double lerr = 0;
    for (size_t i = 0; i < nstat; ++i) {
      const double r = ref_lse[i], g = lse[i];
      if (std::isinf(r) || std::isinf(g) || std::isnan(g)) {
        if (!(std::isinf(r) && std::isinf(g) && r < 0 && g < 0)) lerr = INFINITY;
      } else {
        lerr = std::max(lerr, std::fabs(g - r));
      }
    }
    row.o = std::max(row.o, oerr);
    row.lse = std::max(row.lse, lerr);
    if (!(oerr <= tol_o && lerr <= tol_lse)) {
      row.pass = false;
      row.failed_variants += (row.failed_variants.empty() ? "v" : ",v") + std::to_string(variant);
    }
  }
  for (void* ptr : std::initializer_list<void*>{dq, dk, dv, d_o, d_lse, d_qs, d_ks})
    if (ptr) CHECK_CUDA(cudaFree(ptr));
  return row;
}

static std::vector<Case> all_cases(bool quick) {
  std::vector<Case> cs;
  for (int D : {64, 96, 128, 256}) {
    const std::string d = "d" + std::to_string(D);
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
    c = Case{d + " persistent 3 CTAs plain strided", 2, 300, 517, 4, 2, D};
    c.pitch_pad = 8;
    c.sms = 3;
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
  return cs;
}

// ------------------------------------------------------------------ bench
static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static void bench() {
  struct Shape {
    int D, H;
  };
  const int B = 2, T = 8192, S = 8192;
  std::printf("bench: B=%d T=S=%d bf16, TF/s (20 launches between events, median of 5)\n", B, T);
  std::printf("%-5s %-4s %-7s %9s %9s %9s %9s %9s %9s  %s\n", "D", "H", "causal", "sm90 v0", "v1 pp+ov",
              "v2 ov", "v3 pp", "v4 none", "sm80", "max|O90-O80|");
  std::mt19937 rng(7);
  for (Shape sh : {Shape{128, 16}, Shape{64, 32}, Shape{256, 8}}) {
    const size_t n = size_t(B) * T * sh.H * sh.D;
    std::vector<uint16_t> h(n);
    std::normal_distribution<float> nd(0.f, 1.f);
    uint16_t *dq = dev_alloc<uint16_t>(n), *dk = dev_alloc<uint16_t>(n), *dv = dev_alloc<uint16_t>(n);
    for (uint16_t* p : {dq, dk, dv}) {
      for (auto& x : h) x = to_bits(nd(rng), false);
      CHECK_CUDA(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice));
    }
    uint16_t *d_o = dev_alloc<uint16_t>(n), *d_o80 = dev_alloc<uint16_t>(n);
    float* d_lse = dev_alloc<float>(size_t(B) * sh.H * T);
    for (bool causal : {false, true}) {
      FwdParams p{};
      p.q = dq;
      p.k = dk;
      p.v = dv;
      p.o = d_o;
      p.lse = d_lse;
      const int64_t rs = int64_t(sh.H) * sh.D;
      p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = rs;
      p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = sh.D;
      p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = rs * T;
      p.batch = B;
      p.seqlen_q = T;
      p.seqlen_k = S;
      p.num_heads = p.num_heads_k = sh.H;
      p.head_dim = sh.D;
      p.scale = float(1.0 / std::sqrt(double(sh.D)));
      p.window_left = -1;
      p.window_right = causal ? 0 : -1;
      p.causal = causal;
      p.dtype = DType::kBFloat16;
      CHECK_CUDA(cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, 0));
      const double flops = 4.0 * B * sh.H * double(T) * S * sh.D * (causal ? 0.5 : 1.0);
      cudaEvent_t e0, e1;
      CHECK_CUDA(cudaEventCreate(&e0));
      CHECK_CUDA(cudaEventCreate(&e1));
      auto time_it = [&](auto&& launch) -> double {
        if (launch() != cudaSuccess) return -1;
        CHECK_CUDA(cudaDeviceSynchronize());
        std::vector<double> reps;
        for (int r = 0; r < 5; ++r) {
          CHECK_CUDA(cudaEventRecord(e0));
          for (int i = 0; i < 20; ++i) launch();
          CHECK_CUDA(cudaEventRecord(e1));
          CHECK_CUDA(cudaEventSynchronize(e1));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
          reps.push_back(ms / 20);
        }
        CHECK_CUDA(cudaGetLastError());
        return flops / (median(reps) * 1e-3) / 1e12;
      };
      double tf[6];
      for (int variant = 0; variant < 5; ++variant) {
        p.sm90_variant = variant;
        p.o = d_o;
        tf[variant] = jax_flash::sm90::fwd_supported(p)
                          ? time_it([&] { return jax_flash::sm90::run_fwd(p, 0); })
                          : -1;
      }
      p.sm90_variant = 0;
      FwdParams p80 = p;
      p80.o = d_o80;
      tf[5] = time_it([&] { return jax_flash::sm80::run_fwd(p80, 0); });
      // O of the default sm90 variant (rerun) against sm80's.
      double maxdiff = -1;
      if (jax_flash::sm90::run_fwd(p, 0) == cudaSuccess && tf[5] > 0) {
        CHECK_CUDA(cudaDeviceSynchronize());
        std::vector<uint16_t> a(n), b(n);
        CHECK_CUDA(cudaMemcpy(a.data(), d_o, n * 2, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(b.data(), d_o80, n * 2, cudaMemcpyDeviceToHost));
        maxdiff = 0;
        for (size_t i = 0; i < n; ++i) {
          const double d = std::fabs(double(from_bits(a[i], false)) - from_bits(b[i], false));
          maxdiff = std::isnan(d) ? INFINITY : std::max(maxdiff, d);
        }
      }
      std::printf("%-5d %-4d %-7s", sh.D, sh.H, causal ? "yes" : "no");
      for (double x : tf) {
        if (x < 0)
          std::printf(" %9s", "-");
        else
          std::printf(" %9.1f", x);
      }
      std::printf("  %.3g\n", maxdiff);
      std::fflush(stdout);
      CHECK_CUDA(cudaEventDestroy(e0));
      CHECK_CUDA(cudaEventDestroy(e1));
    }
    for (void* ptr : std::initializer_list<void*>{dq, dk, dv, d_o, d_o80, d_lse}) CHECK_CUDA(cudaFree(ptr));
  }
}

int main(int argc, char** argv) {
  std::string filter;
  bool quick = false, do_bench = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "--bench")
      do_bench = true;
    else
      filter = a;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d), %d SMs\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  if (do_bench) {
    bench();
    return 0;
  }
  std::mt19937 rng(1234);
  int failed = 0, run = 0, skipped = 0;
  std::printf("%-40s %9s %9s %3s  %s\n", "case", "O", "LSE", "#v", "result");
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
    std::printf("%-40s %9.2e %9.2e %3d  %s%s\n", c.name.c_str(), r.o, r.lse, r.variants_run,
                r.pass ? "PASS" : "FAIL ", r.failed_variants.c_str());
    std::fflush(stdout);
  }
  std::printf("%d passed, %d failed, %d skipped\n", run - failed, failed, skipped);
  return (failed || run == 0) ? 1 : 0;
}
