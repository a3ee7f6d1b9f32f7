// Host side of the standalone kernel self-tests (selftest.cu for sm80,
// selftest_sm90.cu, selftest_sm90_bwd.cu): 16-bit conversions, strided
// [batch, seq, heads, D] test tensors with NaN-poisoned padding, the float64
// attention reference (forward and backward, every mask option), device
// allocation / upload and the CUDA error check. Each test keeps its own Case
// type; the reference reads the fields it needs from it.
#pragma once

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

#include "host_utils.h"  // CHECK_CUDA, to_bits / from_bits
#include "jax_flash/philox.h"  // Dropout: the reference's keep decisions

// The dropout key of every case: key words and a nonzero origin (the call
// as one shard of a larger request, a block of ring attention: batch0,
// head0, row0, col0 with col0 a multiple of 64), so that all enter the
// positions.
constexpr uint32_t kDropoutWords[6] = {0x9E3779B9u, 0x243F6A88u, 3u, 5u, 77u, 192u};

// A case's dropout arguments for `rate` (threshold round(rate * 256), at
// most 255; none for rate 0), without key words: the host reference points
// them at kDropoutWords, the kernels at a device copy.
inline jax_flash::DropoutArgs dropout_args(float rate, bool broadcast) {
  jax_flash::DropoutArgs a{};
  if (rate > 0.f) {
    a.threshold = std::min(uint32_t(std::lround(rate * 256.f)), 255u);
    a.broadcast = broadcast;
  }
  return a;
}

// A [batch, seq, heads, D] tensor stored with row pitch heads*D + pad.
struct Tensor {
  int B, L, H, D, pad;
  std::vector<uint16_t> bits;  // storage, poisoned padding
  std::vector<double> val;     // dense [B][L][H][D] values (rounded)
  int64_t row_stride() const { return int64_t(H) * D + pad; }
  int64_t batch_stride() const { return int64_t(L) * row_stride(); }
  int64_t idx(int b, int l, int h, int d) const {
    return b * batch_stride() + l * row_stride() + int64_t(h) * D + d;
  }
  size_t count() const { return size_t(B) * L * row_stride(); }
  double& at(int b, int l, int h, int d) { return val[((size_t(b) * L + l) * H + h) * D + d]; }
  double at(int b, int l, int h, int d) const {
    return val[((size_t(b) * L + l) * H + h) * D + d];
  }
};

inline Tensor make_tensor(int B, int L, int H, int D, int pad, bool fp16, std::mt19937& rng,
                          float stddev) {
  Tensor t{B, L, H, D, pad, {}, {}};
  t.bits.assign(t.count(), 0x7FC0);  // NaN in padding: must never be read into results
  t.val.assign(size_t(B) * L * H * D, 0.0);
  std::normal_distribution<float> nd(0.f, stddev);
  for (int b = 0; b < B; ++b)
    for (int l = 0; l < L; ++l)
      for (int h = 0; h < H; ++h)
        for (int d = 0; d < D; ++d) {
          const uint16_t bits = to_bits(nd(rng), fp16);
          t.bits[t.idx(b, l, h, d)] = bits;
          t.at(b, l, h, d) = from_bits(bits, fp16);
        }
  return t;
}

// ------------------------------------------------------------------ reference
struct Reference {
  std::vector<double> o, lse, dq, dk, dv, delta;  // dense layouts
};

template <typename CaseT>
inline bool visible(const CaseT& c, int i, int j, const std::vector<int>& qs,
                    const std::vector<int>& ks, int b) {
  const int off = c.S - c.T;
  int wl = c.wl, wr = c.wr;
  if (c.causal) wr = wr < 0 ? 0 : std::min(wr, 0);
  if (wl >= 0 && j < i + off - wl) return false;
  if (wr >= 0 && j > i + off + wr) return false;
  if (c.segments && qs[size_t(b) * c.T + i] != ks[size_t(b) * c.S + j]) return false;
  return true;
}

// Forward (o, lse) and, with `dout`, backward (delta, dq, dk, dv) of the
// case in float64 from the rounded inputs. Case fields used: B, T, S, H, Hk,
// D, causal, wl, wr (bottom-right aligned), segments, softcap. The value head
// dim is v's (v.D; dout, o and dv have it too), q's and k's is c.D.
// With `drop` (host key words): attention dropout, one Dropout::keep per
// element: LSE of the undropped P, O = (P * Z * keep_scale) V, delta from
// that O, dS = P (Z keep_scale dP - delta), dV = (P Z keep_scale)^T dO.
// With `sinks` ([B, H] logits, jax_flash/sinks.h): e^{sink} joins each row's
// denominator (and the LSE); a row without a visible key has LSE = sink.
template <typename CaseT>
Reference reference(const CaseT& c, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor* dout, const std::vector<int>& qs, const std::vector<int>& ks,
                    double scale, const jax_flash::Dropout* drop = nullptr,
                    const std::vector<float>* sinks = nullptr) {
  const int B = c.B, T = c.T, S = c.S, H = c.H, D = c.D, Dv = v.D, G = c.H / c.Hk;
  Reference r;
  r.o.assign(size_t(B) * T * H * Dv, 0.0);
  r.dq.assign(size_t(B) * T * H * D, 0.0);
  r.dk.assign(size_t(B) * S * c.Hk * D, 0.0);
  r.dv.assign(size_t(B) * S * c.Hk * Dv, 0.0);
  r.lse.assign(size_t(B) * H * T, 0.0);
  r.delta.assign(size_t(B) * H * T, 0.0);
  std::vector<double> raw(S), p(S), dp(S), zs(S, 1.0);  // zs: Z * keep_scale
  std::vector<char> vis(S);
  const double keep_scale = drop ? 256.0 / (256.0 - drop->threshold) : 1.0;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      const int hk = h / G;
      for (int i = 0; i < T; ++i) {
        double m = -INFINITY;
        for (int j = 0; j < S; ++j) {
          double acc = 0;
          for (int d = 0; d < D; ++d) acc += q.at(b, i, h, d) * k.at(b, j, hk, d);
          raw[j] = acc * scale;
          const double s = c.softcap > 0 ? c.softcap * std::tanh(raw[j] / c.softcap) : raw[j];
          vis[j] = visible(c, i, j, qs, ks, b);
          p[j] = s;
          if (vis[j]) m = std::max(m, s);
        }
        const double sink = sinks ? double((*sinks)[size_t(b) * H + h]) : -INFINITY;
        const size_t li = (size_t(b) * H + h) * T + i;
        if (m == -INFINITY) {  // no visible key
          r.lse[li] = sink;
          continue;  // o, dq stay 0
        }
        if (sinks) m = std::max(m, sink);
        double l = sinks ? std::exp(sink - m) : 0.0;
        for (int j = 0; j < S; ++j) {
          p[j] = vis[j] ? std::exp(p[j] - m) : 0.0;
          l += p[j];
        }
        r.lse[li] = m + std::log(l);
        for (int j = 0; j < S; ++j) p[j] /= l;
        if (drop)
          for (int j = 0; j < S; ++j) zs[j] = drop->keep(b, h, i, j) ? keep_scale : 0.0;
        double delta = 0;
        for (int d = 0; d < Dv; ++d) {
          double acc = 0;
          for (int j = 0; j < S; ++j) acc += p[j] * zs[j] * v.at(b, j, hk, d);
          r.o[((size_t(b) * T + i) * H + h) * Dv + d] = acc;
          if (dout) delta += acc * dout->at(b, i, h, d);
        }
        if (!dout) continue;  // forward only
        r.delta[li] = delta;
        for (int j = 0; j < S; ++j) {
          if (p[j] == 0) {
            dp[j] = 0;
            continue;
          }
          double acc = 0;
          for (int d = 0; d < Dv; ++d) acc += dout->at(b, i, h, d) * v.at(b, j, hk, d);
          double ds = p[j] * (zs[j] * acc - delta);
          if (c.softcap > 0) {
            const double t = std::tanh(raw[j] / c.softcap);
            ds *= 1 - t * t;
          }
          dp[j] = ds * scale;  // d(q.k)
        }
        for (int j = 0; j < S; ++j) {
          if (p[j] == 0) continue;
          for (int d = 0; d < D; ++d) {
            r.dq[((size_t(b) * T + i) * H + h) * D + d] += dp[j] * k.at(b, j, hk, d);
            r.dk[((size_t(b) * S + j) * c.Hk + hk) * D + d] += dp[j] * q.at(b, i, h, d);
          }
          for (int d = 0; d < Dv; ++d)
            r.dv[((size_t(b) * S + j) * c.Hk + hk) * Dv + d] += p[j] * zs[j] * dout->at(b, i, h, d);
        }
      }
    }
  return r;
}

// ------------------------------------------------------------------ device helpers
template <typename T>
T* dev_alloc(size_t n) {
  T* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}
inline uint16_t* upload(const Tensor& t) {
  uint16_t* p = dev_alloc<uint16_t>(t.count());
  CHECK_CUDA(cudaMemcpy(p, t.bits.data(), t.count() * 2, cudaMemcpyHostToDevice));
  return p;
}
// Floats on the device; nullptr for none.
inline float* upload(const std::vector<float>& x) {
  if (x.empty()) return nullptr;
  float* p = dev_alloc<float>(x.size());
  CHECK_CUDA(cudaMemcpy(p, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice));
  return p;
}

// A case's learnable sinks (jax_flash/sinks.h): [B, H] logits in [-1, 3],
// around the scores' range so that the sink's share matters; none (empty)
// unless enabled.
inline std::vector<float> random_sinks(bool enabled, int B, int H, std::mt19937& rng) {
  std::vector<float> sinks;
  std::uniform_real_distribution<float> u(-1.f, 3.f);
  if (enabled)
    for (int i = 0; i < B * H; ++i) sinks.push_back(u(rng));
  return sinks;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
