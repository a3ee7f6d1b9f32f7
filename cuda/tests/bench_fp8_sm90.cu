// The sm90 FP8 forward's tuning target: TF/s of the production FP8 kernel
// (fwd_default_tuning with 1-byte elements, launched as run_fwd_fp8_hdim
// does) beside configurations that change it in one way, on random e4m3
// inputs with random per-block descales. Compiled only into this binary
// (tools/build/build_fp8_bench.sh), never into the extension.
//
//   bench_fp8_sm90 [--launches=N] [filter-substring]
//
// Shapes: B*T = 16k at T=8192 (D=64/128/256, H = 2048 / D, causal and not)
// and B=1 T=16k at D=128. Each cell: the median of kRounds rounds of N
// back-to-back launches (default 100: the sustained, power-capped figure),
// the configurations of a row interleaved round by round. max|dO| = the
// largest |O_c - O_default| over the row's configurations (O poisoned with
// NaN before each check launch: inf/nan = a tile not written), beside
// max|O_default| for scale.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "gpu_wait.h"
#include "host_utils.h"
#include "jax_flash/params.h"
#include "sm90/fwd/launch_templates.cuh"

namespace sm90 = jax_flash::sm90;
using jax_flash::DType;
using jax_flash::Fp8FwdParams;
using sm90::FwdTuning;

// How a configuration changes the production one (head dim d).
constexpr FwdTuning keep(FwdTuning t, int) { return t; }
template <int kEvery>
constexpr FwdTuning poly(FwdTuning t, int) {
  t.exp2_poly_every = kEvery;
  return t;
}
constexpr FwdTuning toggle_pingpong(FwdTuning t, int) {
  t.pingpong = !t.pingpong;
  return t;
}


struct Fp8Ablation {
  const char* name;
  const char* what;
  FwdTuning (*modify)(FwdTuning, int);
};
constexpr Fp8Ablation kAblations[] = {
    {"default", "the production FP8 configuration", keep},
    {"poly4", "every 4th exponential on the FMA pipe (exp2_poly3)", poly<4>},
    {"pp", "the inter-warpgroup pingpong toggled", toggle_pingpong},

};
constexpr int kNum = int(sizeof(kAblations) / sizeof(kAblations[0]));

template <int kI, int kD, bool kCausal>
struct Fp8Tuning {
  static constexpr FwdTuning value = kAblations[kI].modify(sm90::fwd_default_tuning(kD, kD, kCausal, 1), kD);
};

using Launch = cudaError_t (*)(const Fp8FwdParams&, cudaStream_t);

// The configurations compiled per (head dim, causal): the production one and
// the pingpong toggled everywhere, the exponentials on the FMA pipe at D=128
// not causal only (each is a kernel of its own; the binary's build time is
// the limit).
constexpr bool built(int i, int d, bool causal) {
  const std::string_view name = kAblations[i].name;
  return i == 0 || name == "pp" || (name == "poly4" && d == 128 && !causal);
}

template <int kI, int kD, bool kCausal>
Launch one() {
  if constexpr (built(kI, kD, kCausal)) {
    return &sm90::launch_fwd_fp8<__nv_bfloat16, kD, Fp8Tuning<kI, kD, kCausal>>;
  } else {
    return nullptr;
  }
}
template <int kD, bool kCausal, int... kI>
void fill(Launch (&out)[kNum], std::integer_sequence<int, kI...>) {
  ((out[kI] = one<kI, kD, kCausal>()), ...);
}
Launch launcher(int d, bool causal, int i) {
  static Launch t[3][2][kNum];
  static bool init = false;
  if (!init) {
    fill<64, false>(t[0][0], std::make_integer_sequence<int, kNum>{});
    fill<64, true>(t[0][1], std::make_integer_sequence<int, kNum>{});
    fill<128, false>(t[1][0], std::make_integer_sequence<int, kNum>{});
    fill<128, true>(t[1][1], std::make_integer_sequence<int, kNum>{});
    fill<256, false>(t[2][0], std::make_integer_sequence<int, kNum>{});
    fill<256, true>(t[2][1], std::make_integer_sequence<int, kNum>{});
    init = true;
  }
  return t[d == 64 ? 0 : d == 128 ? 1 : 2][causal ? 1 : 0][i];
}

// dev_alloc and upload(std::vector<float>): selftest_common.h (via gpu_wait.h).
static uint8_t* upload_bytes(const std::vector<uint8_t>& h) {
  uint8_t* p = dev_alloc<uint8_t>(h.size());
  CHECK_CUDA(cudaMemcpy(p, h.data(), h.size(), cudaMemcpyHostToDevice));
  return p;
}

int main(int argc, char** argv) {
  int launches = 100;
  std::string filter;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--launches=", 0) == 0)
      launches = std::atoi(a.c_str() + 11);
    else
      filter = a;
  }
  struct Shape {
    int D, H, B, T;
    bool causal;
    std::string name() const {
      return "d" + std::to_string(D) + " T" + std::to_string(T) + (causal ? " causal" : "");
    }
  };
  const Shape shapes[] = {{128, 16, 2, 8192, false}, {128, 16, 2, 8192, true}, {128, 16, 1, 16384, false},
                          {64, 32, 2, 8192, false},  {64, 32, 2, 8192, true},  {256, 8, 2, 8192, false},
                          {256, 8, 2, 8192, true}};
  constexpr int kRounds = 7;
  std::printf("bench_fp8_sm90: e4m3 in, bf16 out, TF/s (4 B H T S D, halved when causal); median of %d\n"
              "rounds x %d launches, configurations interleaved per round.\n",
              kRounds, launches);
  for (int i = 0; i < kNum; ++i) std::printf("  %-8s %s\n", kAblations[i].name, kAblations[i].what);
  std::printf("%-18s", "shape");
  for (int i = 0; i < kNum; ++i) std::printf(" %8s", kAblations[i].name);
  std::printf("  %-9s %s\n", "max|dO|", "max|O|");
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.5f, 1.5f);
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  int32_t* counter = dev_alloc<int32_t>(1);
  for (const Shape& sh : shapes) {
    if (!filter.empty() && sh.name().find(filter) == std::string::npos) continue;
    const int B = sh.B, T = sh.T, H = sh.H, D = sh.D;
    const size_t n = size_t(B) * T * H * D;
    std::vector<uint8_t> h8(n);
    auto fill8 = [&] {
      for (auto& x : h8) x = uint8_t(__nv_cvt_float_to_fp8(64.f * nd(rng), __NV_SATFINITE, __NV_E4M3));
      return upload_bytes(h8);
    };
    uint8_t *q = fill8(), *k = fill8(), *v = fill8();
    const int k_block = jax_flash::fp8_k_block(D);
    const int qb = (T + 63) / 64, kb = (T + k_block - 1) / k_block;
    // Descales: ~ 1 / 64 (inputs ~ N(0, 1)) with some spread per block.
    std::vector<float> qd(size_t(B) * H * qb), kd(size_t(B) * H * kb), vd(size_t(B) * H * D);
    for (auto* vec : {&qd, &kd, &vd})
      for (auto& x : *vec) x = ud(rng) / 64.f;
    float *dqd = upload(qd), *dkd = upload(kd), *dvd = upload(vd);
    uint16_t* o = dev_alloc<uint16_t>(n);
    uint16_t* o_ref = dev_alloc<uint16_t>(n);
    float* lse = dev_alloc<float>(size_t(B) * H * T);

    Fp8FwdParams p{};
    p.q = q;
    p.k = k;
    p.v = v;
    p.o = o;
    p.lse = lse;
    const int64_t rs = int64_t(H) * D;
    p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = rs;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = D;
    p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = rs * T;
    p.batch = B;
    p.seqlen_q = p.seqlen_k = T;
    p.num_heads = p.num_heads_k = H;
    p.head_dim = p.head_dim_v = D;
    p.scale = float(1.0 / std::sqrt(double(D)));
    p.window_left = -1;
    p.window_right = sh.causal ? 0 : -1;
    p.dtype = DType::kFloat8E4M3;
    p.num_sms = sms;
    p.sm90_tile_counter = counter;
    p.q_descale = dqd;
    p.k_descale = dkd;
    p.v_descale = dvd;
    p.out_dtype = DType::kBFloat16;
    const double flops = 4.0 * B * H * double(T) * T * D * (sh.causal ? 0.5 : 1.0);
    const std::string where = "bench_fp8 " + sh.name();

    // Correctness against the default: poisoned O, one launch each.
    std::vector<uint16_t> ref(n), got(n);
    double max_o = 0, max_d = 0;
    std::vector<bool> ok(kNum, true);
    for (int i = 0; i < kNum; ++i) {
      CHECK_CUDA(cudaMemset(o, 0xFF, n * 2));  // NaN
      const Launch l = launcher(D, sh.causal, i);
      ok[i] = l != nullptr && l(p, 0) == cudaSuccess;
      sync_or_die(where + " " + kAblations[i].name);
      if (!ok[i]) continue;
      CHECK_CUDA(cudaMemcpy((i == 0 ? ref : got).data(), o, n * 2, cudaMemcpyDeviceToHost));
      for (size_t j = 0; j < n; ++j) {
        const double r = from_bits(ref[j], false);
        if (i == 0) {
          max_o = std::isfinite(r) ? std::max(max_o, std::fabs(r)) : INFINITY;
        } else {
          const double d = std::fabs(double(from_bits(got[j], false)) - r);
          max_d = std::isfinite(d) ? std::max(max_d, d) : INFINITY;
        }
      }
    }
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    std::vector<std::vector<double>> ms(kNum);
    for (int r = 0; r < kRounds; ++r)
      for (int c0 = 0; c0 < kNum; ++c0) {
        const int c = (c0 + r) % kNum;  // rotated order
        if (!ok[c]) continue;
        const Launch l = launcher(D, sh.causal, c);
        CHECK_CUDA(cudaEventRecord(e0));
        for (int i = 0; i < launches; ++i) l(p, 0);
        CHECK_CUDA(cudaEventRecord(e1));
        wait_or_die([&] { return cudaEventQuery(e1); }, where);
        float t = 0;
        CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
        ms[c].push_back(t / launches);
      }
    CHECK_CUDA(cudaGetLastError());
    std::printf("%-18s", sh.name().c_str());
    for (int c = 0; c < kNum; ++c) {
      if (!ok[c] || ms[c].empty()) {
        std::printf(" %8s", launcher(D, sh.causal, c) == nullptr ? "-" : "fail");
        continue;
      }
      std::sort(ms[c].begin(), ms[c].end());
      std::printf(" %8.1f", flops / (ms[c][ms[c].size() / 2] * 1e-3) / 1e12);
    }
    std::printf("  %-9.3g %.3g\n", max_d, max_o);
    std::fflush(stdout);
    CHECK_CUDA(cudaEventDestroy(e0));
    CHECK_CUDA(cudaEventDestroy(e1));
    for (void* ptr : std::initializer_list<void*>{q, k, v, dqd, dkd, dvd, o, o_ref, lse}) CHECK_CUDA(cudaFree(ptr));
  }
  return 0;
}
