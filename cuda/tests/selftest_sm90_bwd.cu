// Standalone GPU self-test and benchmark of the sm90 (Hopper, FA3-style)
// backward, jax_flash::sm90::run_bwd. No JAX needed.
//
// Test mode: for each case, random 16-bit Q, K, V, dO; LSE and delta from a
// float64 CPU reference (the same reference and tolerances as selftest.cu,
// which checks the sm80 backward); dQ, dK, dV poisoned with NaN (0xFF bytes)
// and dq_accum too (the launcher must zero it); one PASS/FAIL row per case
// with the max gradient errors relative to the largest reference magnitude
// (floored at 0.05). The row padding of dQ, dK, dV (strided cases) must stay
// untouched (TMA store / convert clipping). Requests the sm90 backward does
// not serve must answer cudaErrorNotSupported (deterministic mode without its
// semaphore workspace, head dim > 256): those rows check exactly that ("NS
// ok"). Deterministic cases ("det ...", BwdParams::deterministic with
// sm90_dq_semaphore, poisoned too: the launcher must zero it) run 3 times:
// once alone, then twice while a "hog" kernel on another stream holds a
// random set of SMs for random times (so the CTAs start in other orders, on
// other SMs, at other times); dQ, dK, dV and the fp32 dq_accum (where a
// changed addition order shows even when the 16-bit dQ rounds it away) must
// be bitwise identical over the runs (result "PASS det x3"), the tile-claim
// counter must equal the tile count and every semaphore lie in [0, KV
// blocks]. For information the non-deterministic kernel is run the same way
// and "(nondet: differs)" noted when its dq_accum bits changed. Head dims: the buckets 64,
// 128 (incl. 96, 80) and 256 (incl. 200, 136, 160: zero-padded columns, a
// whole padding column block for 136 and 160). Attention dropout ("dropout"
// cases, every bucket): the reference draws the generator's keep bit per
// element (Dropout::keep, philox.h) at the nonzero origin of kDropoutWords;
// softcap with dropout must answer cudaErrorNotSupported (sm80 serves it).
// Every case runs variant 0 (the default, sm90::run_bwd) and the explicit
// variants of the tuning table that apply (sm90_bwd_tuning.h; bf16 only):
// 1 (dQ by row bulk reductions), 2 (kBlockM 80, dQ_swapAB; hdim-128 bucket,
// no causal / local bound; the default there), 3 (the bucket's tile with dQ
// tensor reductions; the default elsewhere), 4 (softcap cases: the default's
// tile with softcap's tanh as 1 - 2 / (1 + e^{2y})), and for the dropout
// cases of the hdim-64 / 128 buckets 5 (the keep masks drawn the other way:
// by the producer warpgroup's idle warps or by the consumer warpgroups,
// bwd_policy.h bwd_dropout_producer_mask); "#v" counts the variants run and
// a failing row names the failing ones.
// Exit code 1 on a failure.
//
// Bench mode (--bench): backward TF/s at B=2, T=S=8192 for (D=128, H=16),
// (D=64, H=32), (D=256, H=8) and the pair (D=192, D_v=128, H=16), causal and not: sm90 run_bwd (default, and variants 1, 2, 3
// where applicable: "-" elsewhere) and the sm90 deterministic mode ("sm90 det",
// incl. its semaphore memset; "bits": three runs, one next to an SM-hogging kernel, bitwise
// equal) next to sm80 run_bwd (fast mode), each including its dq_accum memset and dq_convert
// pass; 10 back-to-back calls between two events, median of 5 repeats; FLOPs = 2.5 x the
// forward's 2 B H T S (D + D_v) (halved when causal). LSE comes from the sm80 forward; also prints
// max |dX_sm90 - dX_sm80| / max |dX_sm80| for the default and, where it ran, variant 2, and
// the speed ratio v2 / v3 (the 80-row tile against the 64-row one).
// --bench --softcap=X: the cost of softcap instead: the default and variant 4
// with softcap X beside the default without it, same shapes.
//
// A failing row is preceded by lines naming, for dQ, dK and dV, the worst
// element and the count of bad elements per (row % 128 < 64 or >= 64: the
// consumer warpgroup of hdim 64 / 128; head-dim column block of 64: for hdim
// 256 blocks 0-1 are consumer warpgroup 0's, 2-3 warpgroup 1's), to localise the fault. A kernel
// that does not finish within 60 s prints "HANG: <case> (variant v)" and exits
// with code 3 (a barrier protocol fault; the context cannot be recovered).
//
// Build: tools/build/build_sm90_bwd_tests.sh (see cuda/tests/README.md).
// The head-dim pair 192 / 128 (DeepSeek MLA): the "mla d192v128" cases (v,
// dO, dV 128 wide; dq_accum pitch 192; the default's 64 x 96 dKV_swapAB
// tile, and variant 3: the 64 x 64 column split) and the bench's "mla" rows
// (B=2, T=S=8192, H=16; --bench mla runs them alone; "sm90 v3" is the 64 x 64
// kernel, the last column the default's speed over it).
// Options: ./selftest_sm90_bwd [filter-substring] [--quick] [--bench [--softcap=X] [row filter]]
//          [--variant=N]
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
#include "sm90_bwd_tuning.h"
#include "gpu_wait.h"
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
  bool expect_ns = false; // run_bwd must answer cudaErrorNotSupported
  bool no_semaphore = false;  // deterministic without BwdParams::sm90_dq_semaphore
  float dropout = 0.f;        // attention dropout rate (selftest_common.h dropout_args)
  bool drop_broadcast = false;  // one mask for every (batch, head)
  int Dv = 0;             // v's (dO's, dV's) head dim: 0 = D; else a head-dim pair
};

// Max |got - ref| over the logical elements of a 16-bit tensor (NaN -> inf).
// Where: the worst element, and (for a failure report) how many elements are
// off by more than `bad_abs`, split by the kernel's work split: row % 128 in
// [0, 64) or [64, 128) (the consumer warpgroup of a dK / dV row; of a dQ row
// for D <= 64) and head-dim column block d / 64 (hdim 256: the consumer
// warpgroup of a dK / dV / dQ column is d / 128).
struct ErrWhere {
  int b = -1, l = -1, h = -1, d = -1;
  double got = 0, ref = 0;
  long bad[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};  // [row half][column block]
};
static double err16(const std::vector<uint16_t>& got, const Tensor& layout,
                    const std::vector<double>& ref, bool fp16, double* ref_max,
                    ErrWhere* where = nullptr, double bad_abs = INFINITY) {
  double e = 0, rm = 0;
  for (int b = 0; b < layout.B; ++b)
    for (int l = 0; l < layout.L; ++l)
      for (int h = 0; h < layout.H; ++h)
        for (int d = 0; d < layout.D; ++d) {
          const double r = ref[((size_t(b) * layout.L + l) * layout.H + h) * layout.D + d];
          const double g = from_bits(got[layout.idx(b, l, h, d)], fp16);
          double diff = std::fabs(g - r);
          if (std::isnan(diff)) diff = INFINITY;
          if (where && diff > e) {
            where->b = b;
            where->l = l;
            where->h = h;
            where->d = d;
            where->got = g;
            where->ref = r;
          }
          if (where && diff > bad_abs) ++where->bad[(l % 128) / 64][std::min(d / 64, 3)];
          e = std::max(e, diff);
          rm = std::max(rm, std::fabs(r));
        }
  *ref_max = rm;
  return e;
}

static void print_where(const char* name, const ErrWhere& w, double ref_max, double tol) {
  std::printf("    %s: worst at (b %d, l %d, h %d, d %d) got %.6g ref %.6g; |err| > %.2g: "
              "rows%%128<64 [cb0 %ld, cb1 %ld, cb2 %ld, cb3 %ld], rows%%128>=64 [cb0 %ld, cb1 %ld, "
              "cb2 %ld, cb3 %ld]\n",
              name, w.b, w.l, w.h, w.d, w.got, w.ref, tol * std::max(ref_max, 0.05), w.bad[0][0],
              w.bad[0][1], w.bad[0][2], w.bad[0][3], w.bad[1][0], w.bad[1][1], w.bad[1][2], w.bad[1][3]);
}

// Padding elements (columns past H * D of each row) must still hold the
// poison pattern 0xFFFF: the kernels clip their stores to the tensor.
static bool padding_untouched(const std::vector<uint16_t>& got, const Tensor& layout) {
  const int64_t rs = layout.row_stride(), used = int64_t(layout.H) * layout.D;
  for (size_t i = 0; i < got.size(); ++i)
    if (int64_t(i) % rs >= used && got[i] != 0xFFFF) return false;
  return true;
}

static int g_only_variant = -1;  // --variant=N
// The tuning table's variants (0 = the default).
constexpr int kNumVariants = jax_flash::sm90::tuning::kNumVariants;

// Holds SMs for a while (a backward CTA needs a whole SM's registers, so it
// cannot start next to one of these): each block spins for a pseudo-random
// number of clock cycles (up to `max_cycles`).
__global__ void hog_kernel(long long max_cycles, uint32_t seed) {
  uint32_t x = blockIdx.x * 2654435761u ^ seed;
  x ^= x >> 15;
  x *= 2246822519u;
  x ^= x >> 13;
  const long long cycles = max_cycles / 16 * (1 + x % 16);
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

// Launches the hog on a non-blocking stream (runs next to stream 0's work):
// a seed-dependent number of blocks, up to ~100 us each.
static void launch_hog(uint32_t seed, int num_sms) {
  static cudaStream_t s = nullptr;
  if (s == nullptr) CHECK_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int blocks = 1 + int((seed * 7919u) % uint32_t(2 * num_sms));
  hog_kernel<<<blocks, 128, 0, s>>>(200000, seed);
  CHECK_CUDA(cudaGetLastError());
}

struct Row {
  double dq = 0, dk = 0, dv = 0;
  bool pad_ok = true;
  bool pass = true;
  bool skipped = false;  // not supported, and not expected to be
  bool ns_checked = false;
  int variants_run = 0;
  std::string failed_variants;
  int det_runs = 0;             // deterministic: runs compared bitwise
  bool det_same = true;         // ... all identical to the first
  bool det_sem_ok = true;       // claim counter / semaphore values
  bool nondet_differs = false;  // information: the timing-order kernel changed dq_accum bits
};

static std::vector<int> make_segments(const Case& c, int n, std::mt19937& rng) {
  // Runs of random length (ids 0..4 repeat, as in selftest.cu).
  std::vector<int> seg(size_t(c.B) * n, 0);
  std::uniform_int_distribution<int> len(1, 24);
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
  return seg;
}

static Row run_case(const Case& c, std::mt19937& rng) {
  const bool fp16 = c.fp16;
  const double scale = c.scale_mul / std::sqrt(double(c.D));
  Tensor q = make_tensor(c.B, c.T, c.H, c.D, c.pitch_pad, fp16, rng, 1.f);
  Tensor k = make_tensor(c.B, c.S, c.Hk, c.D, c.pitch_pad, fp16, rng, 1.f);
  const int Dv = c.Dv > 0 ? c.Dv : c.D;
  Tensor v = make_tensor(c.B, c.S, c.Hk, Dv, c.pitch_pad, fp16, rng, 1.f);
  Tensor dout = make_tensor(c.B, c.T, c.H, Dv, c.pitch_pad, fp16, rng, 1.f);
  std::vector<int> qs, ks;
  if (c.segments) {
    qs = make_segments(c, c.T, rng);
    ks = make_segments(c, c.S, rng);
  }
  // Dropout: the reference draws Dropout::keep per element with the same
  // key words (kDropoutWords: a nonzero origin), so a kernel mask that
  // differs from the generator's anywhere fails by O(1).
  jax_flash::DropoutArgs drop_args = dropout_args(c.dropout, c.drop_broadcast);
  jax_flash::DropoutArgs host_drop = drop_args;
  host_drop.words = kDropoutWords;
  const jax_flash::Dropout drop_ref(host_drop);
  const Reference ref = reference(c, q, k, v, &dout, qs, ks, scale, drop_args.enabled() ? &drop_ref : nullptr);
  uint32_t* d_words = nullptr;
  if (drop_args.enabled()) {
    d_words = dev_alloc<uint32_t>(std::size(kDropoutWords));
    CHECK_CUDA(cudaMemcpy(d_words, kDropoutWords, sizeof(kDropoutWords), cudaMemcpyHostToDevice));
    drop_args.words = d_words;
  }

  uint16_t *d_q = upload(q), *d_k = upload(k), *d_v = upload(v), *d_do = upload(dout);
  uint16_t *d_dq = dev_alloc<uint16_t>(q.count()), *d_dk = dev_alloc<uint16_t>(k.count()),
           *d_dv = dev_alloc<uint16_t>(v.count());
  const size_t nstat = size_t(c.B) * c.H * c.T;
  float* d_lse = dev_alloc<float>(nstat);
  float* d_delta = dev_alloc<float>(nstat);
  int32_t *d_qs = nullptr, *d_ks = nullptr;
  if (c.segments) {
    d_qs = dev_alloc<int32_t>(qs.size());
    d_ks = dev_alloc<int32_t>(ks.size());
    CHECK_CUDA(cudaMemcpy(d_qs, qs.data(), qs.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_ks, ks.data(), ks.size() * 4, cudaMemcpyHostToDevice));
  }
  std::vector<float> lse_f(nstat), delta_f(nstat);
  for (size_t i = 0; i < nstat; ++i) {
    lse_f[i] = float(ref.lse[i]);  // -inf for rows without a visible key
    delta_f[i] = float(ref.delta[i]);
  }
  if (nstat) {
    CHECK_CUDA(cudaMemcpy(d_lse, lse_f.data(), nstat * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(d_delta, delta_f.data(), nstat * 4, cudaMemcpyHostToDevice));
  }
  const int hd_round = jax_flash::rounded_head_dim(c.D, Dv);
  const int tq_round = jax_flash::rounded_seqlen(c.T);
  const size_t nacc = size_t(c.B) * c.H * tq_round * hd_round;
  float* d_acc = dev_alloc<float>(nacc);
  const bool use_sem = c.deterministic && !c.no_semaphore;
  const size_t nsem = size_t(jax_flash::sm90_bwd_semaphore_ints(c.B, c.H, c.T));
  int32_t* d_sem = use_sem ? dev_alloc<int32_t>(nsem) : nullptr;

  BwdParams bp{};
  bp.q = d_q;
  bp.k = d_k;
  bp.v = d_v;
  bp.o = nullptr;  // not read by the backward (delta is precomputed)
  bp.lse = d_lse;
  bp.q_batch_stride = q.batch_stride();
  bp.q_row_stride = q.row_stride();
  bp.q_head_stride = c.D;
  bp.k_batch_stride = k.batch_stride();
  bp.k_row_stride = k.row_stride();
  bp.k_head_stride = c.D;
  bp.v_batch_stride = v.batch_stride();
  bp.v_row_stride = v.row_stride();
  bp.v_head_stride = Dv;
  bp.o_batch_stride = dout.batch_stride();  // dO has O's strides
  bp.o_row_stride = dout.row_stride();
  bp.o_head_stride = Dv;
  bp.batch = c.B;
  bp.seqlen_q = c.T;
  bp.seqlen_k = c.S;
  bp.num_heads = c.H;
  bp.num_heads_k = c.Hk;
  bp.head_dim = c.D;
  bp.head_dim_v = Dv;
  bp.scale = float(scale);
  bp.softcap = c.softcap;
  bp.window_left = c.wl;
  bp.window_right = c.causal ? (c.wr < 0 ? 0 : std::min(c.wr, 0)) : c.wr;
  bp.q_segment = d_qs;
  bp.kv_segment = d_ks;
  bp.dtype = fp16 ? DType::kFloat16 : DType::kBFloat16;
  CHECK_CUDA(cudaDeviceGetAttribute(&bp.num_sms, cudaDevAttrMultiProcessorCount, 0));
  bp.dout = d_do;
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
  bp.sm90_dq_semaphore = d_sem;
  bp.dropout = drop_args;

  auto poison = [&] {
    CHECK_CUDA(cudaMemset(d_dq, 0xFF, q.count() * 2));
    CHECK_CUDA(cudaMemset(d_dk, 0xFF, k.count() * 2));
    CHECK_CUDA(cudaMemset(d_dv, 0xFF, v.count() * 2));
    CHECK_CUDA(cudaMemset(d_acc, 0xFF, nacc * 4));  // the launcher must zero it
    if (d_sem) CHECK_CUDA(cudaMemset(d_sem, 0xFF, nsem * 4));  // this too
    CHECK_CUDA(cudaDeviceSynchronize());
  };
  poison();
  Row row;
  auto free_all = [&] {
    for (void* ptr : std::initializer_list<void*>{d_q, d_k, d_v, d_do, d_dq, d_dk, d_dv, d_lse,
                                                  d_delta, d_acc, d_qs, d_ks, d_sem, d_words})
      if (ptr) CHECK_CUDA(cudaFree(ptr));
  };
  // --variant=N runs only variant N (e.g. 1 when the default
  // tensor-reduction path hangs or fails).
  const int v_first = g_only_variant > 0 && !c.expect_ns ? g_only_variant : 0;
  const int v_end = g_only_variant >= 0 ? v_first + 1 : kNumVariants;
  const bool supported = jax_flash::sm90::bwd_supported(bp);
  cudaError_t err = jax_flash::sm90::tuning::run_variant(bp, v_first, 0);
  if (c.expect_ns) {
    // Must decline without touching anything (the caller then runs sm80).
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<uint16_t> g(k.count());
    CHECK_CUDA(cudaMemcpy(g.data(), d_dk, k.count() * 2, cudaMemcpyDeviceToHost));
    bool untouched = true;
    for (uint16_t x : g) untouched &= x == 0xFFFF;
    row.ns_checked = true;
    row.pass = !supported && err == cudaErrorNotSupported && untouched;
    free_all();
    return row;
  }
  if (err == cudaErrorNotSupported) {
    row.skipped = true;
    free_all();
    return row;
  }
  const double tol_g = fp16 ? 1e-2 : 4e-2;  // selftest.cu's gradient tolerances
  std::vector<uint16_t> first_bits[3];     // deterministic: the first run's dQ, dK, dV
  // ... and its fp32 dq_accum (the sums themselves: a changed addition order
  // shows there in the low bits even where the 16-bit dQ rounds it away).
  std::vector<uint32_t> first_acc;
  auto read_acc = [&] {
    std::vector<uint32_t> a(nacc);
    CHECK_CUDA(cudaMemcpy(a.data(), d_acc, nacc * 4, cudaMemcpyDeviceToHost));
    return a;
  };
  // Variant 0 (default), then the explicit variants where they apply; the
  // row keeps the worst errors.
  int last_variant = v_first;  // the one whose workspace the first semaphore check reads
  for (int variant = v_first; variant < v_end; ++variant) {
    if (variant > v_first) {
      if (!jax_flash::sm90::tuning::variant_applies(bp, variant)) continue;  // not for this case
      poison();
      err = jax_flash::sm90::tuning::run_variant(bp, variant, 0);
    }
    last_variant = variant;
    CHECK_CUDA(err);
    sync_or_die(c.name + " (variant " + std::to_string(variant) + ")");
    std::vector<uint16_t> g_dq(q.count()), g_dk(k.count()), g_dv(v.count());
    CHECK_CUDA(cudaMemcpy(g_dq.data(), d_dq, q.count() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(g_dk.data(), d_dk, k.count() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(g_dv.data(), d_dv, v.count() * 2, cudaMemcpyDeviceToHost));
    double m1, m2, m3;
    const double edq = err16(g_dq, q, ref.dq, fp16, &m1) / std::max(m1, 0.05);
    const double edk = err16(g_dk, k, ref.dk, fp16, &m2) / std::max(m2, 0.05);
    const double edv = err16(g_dv, v, ref.dv, fp16, &m3) / std::max(m3, 0.05);
    const bool pad = padding_untouched(g_dq, q) && padding_untouched(g_dk, k) &&
                     padding_untouched(g_dv, v);
    row.dq = std::max(row.dq, edq);
    row.dk = std::max(row.dk, edk);
    row.dv = std::max(row.dv, edv);
    row.pad_ok = row.pad_ok && pad;
    ++row.variants_run;
    if (c.deterministic && variant == v_first) {
      first_bits[0] = g_dq;
      first_bits[1] = g_dk;
      first_bits[2] = g_dv;
      first_acc = read_acc();
    }
    if (!(edq <= tol_g && edk <= tol_g && edv <= tol_g && pad)) {
      row.pass = false;
      row.failed_variants += (row.failed_variants.empty() ? "v" : ",v") + std::to_string(variant);
      // Where it fails (printed before the case's row): worst element and the
      // count of bad elements per (row half, head-dim column block).
      std::printf("  %s, variant %d: dQ %.2e dK %.2e dV %.2e pad %s\n", c.name.c_str(), variant, edq, edk,
                  edv, pad ? "ok" : "BAD");
      const struct {
        const char* n;
        const std::vector<uint16_t>* g;
        const Tensor* t;
        const std::vector<double>* r;
        double m;
      } ts[3] = {{"dQ", &g_dq, &q, &ref.dq, m1}, {"dK", &g_dk, &k, &ref.dk, m2}, {"dV", &g_dv, &v, &ref.dv, m3}};
      for (const auto& t : ts) {
        ErrWhere w;
        double rm;
        err16(*t.g, *t.t, *t.r, fp16, &rm, &w, tol_g * std::max(t.m, 0.05));
        print_where(t.n, w, t.m, tol_g);
      }
    }
  }
  if (c.deterministic && !first_bits[0].empty()) {
    // Two more runs with other CTA start orders / timings (the hog kernel
    // next to them); bitwise identical gradients; the workspace's claim
    // counter and semaphores sane.
    // Keys per CTA of the tile `variant` ran (the pair: the default 64 x 96,
    // variant 3 its 64 x 64 column split; the repeats run the default).
    auto kv_block_of = [&](int variant) {
      if (Dv != c.D) return variant == jax_flash::sm90::tuning::kBucket ? 64 : 96;
      return hd_round == 256 ? 64 : 128;
    };
    const int q_block = hd_round == 64 ? 128 : 64;
    const size_t sems_used = size_t(c.B) * c.H * ((c.T + q_block - 1) / q_block);
    auto check_sems = [&](int variant) {
      const int kv_block = kv_block_of(variant);
      const int n_blocks = (c.S + kv_block - 1) / kv_block;
      const int64_t tiles = int64_t(n_blocks) * c.Hk * c.B;
      std::vector<int32_t> sem(1 + sems_used);
      CHECK_CUDA(cudaMemcpy(sem.data(), d_sem, sem.size() * 4, cudaMemcpyDeviceToHost));
      if (tiles == 0) return true;  // no kernel: the workspace is not touched
      bool ok = sem[0] == tiles;
      for (size_t i = 1; i < sem.size(); ++i) ok &= sem[i] >= 0 && sem[i] <= n_blocks;
      if (!ok) std::printf("  %s: claim counter %d (tiles %lld) or a semaphore out of [0, %d]\n", c.name.c_str(),
                           sem[0], (long long)tiles, n_blocks);
      return ok;
    };
    row.det_sem_ok = check_sems(last_variant);
    row.det_runs = 1;
    int num_sms = 0;
    CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
    for (uint32_t rep = 1; rep <= 2; ++rep) {
      poison();
      launch_hog(rep * 0x9E3779B9u, num_sms);
      CHECK_CUDA(jax_flash::sm90::run_bwd(bp, 0));
      sync_or_die(c.name + " (deterministic, repeat " + std::to_string(rep) + ")");
      uint16_t* dev[3] = {d_dq, d_dk, d_dv};
      for (int t = 0; t < 3; ++t) {
        std::vector<uint16_t> g(first_bits[t].size());
        CHECK_CUDA(cudaMemcpy(g.data(), dev[t], g.size() * 2, cudaMemcpyDeviceToHost));
        if (g != first_bits[t]) {
          size_t nd = 0;
          for (size_t i = 0; i < g.size(); ++i) nd += g[i] != first_bits[t][i];
          std::printf("  %s: repeat %u: %zu bits of %s differ from the first run\n", c.name.c_str(), rep, nd,
                      t == 0 ? "dQ" : t == 1 ? "dK" : "dV");
          row.det_same = false;
        }
      }
      {
        const std::vector<uint32_t> acc = read_acc();
        if (acc != first_acc) {
          size_t nd = 0;
          for (size_t i = 0; i < acc.size(); ++i) nd += acc[i] != first_acc[i];
          std::printf("  %s: repeat %u: %zu fp32 words of dq_accum differ from the first run\n", c.name.c_str(),
                      rep, nd);
          row.det_same = false;
        }
      }
      row.det_sem_ok = row.det_sem_ok && check_sems(0);
      ++row.det_runs;
    }
    CHECK_CUDA(cudaDeviceSynchronize());  // the hog too
    row.pass = row.pass && row.det_same && row.det_sem_ok;
    // Information: the timing-order kernel under the same conditions.
    BwdParams nd = bp;
    nd.deterministic = false;
    nd.sm90_dq_semaphore = nullptr;
    for (uint32_t rep = 0; rep < 3 && !row.nondet_differs; ++rep) {
      poison();
      if (rep) launch_hog(rep * 0x85EBCA6Bu, num_sms);
      CHECK_CUDA(jax_flash::sm90::run_bwd(nd, 0));
      sync_or_die(c.name + " (non-deterministic comparison)");
      CHECK_CUDA(cudaDeviceSynchronize());
      const std::vector<uint32_t> g = read_acc();  // fp32 sums: the order shows in their low bits
      static std::vector<uint32_t> nd_first;
      if (rep == 0)
        nd_first = g;
      else
        row.nondet_differs = g != nd_first;
    }
  }
  free_all();
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
    c = base;
    c.name = d + " deterministic w/o workspace -> NS";
    c.causal = true;
    c.deterministic = true;
    c.no_semaphore = true;
    c.expect_ns = true;
    cs.push_back(c);
    // Deterministic mode: fixed dQ order (3 runs, bitwise).
    c = base;
    c.name = d + " det causal";
    c.causal = true;
    c.deterministic = true;
    cs.push_back(c);
    c = Case{d + " det multiblock GQA 4:1 plain", 1, 300, 517, 8, 2, D};
    c.deterministic = true;
    cs.push_back(c);
    c = Case{d + " det multiblock causal T>S GQA", 2, 517, 300, 4, 2, D};
    c.causal = true;
    c.deterministic = true;
    cs.push_back(c);
    c = Case{d + " multiblock MQA causal", 1, 300, 517, 2, 1, D};
    c.causal = true;
    cs.push_back(c);
    c = Case{d + " multiblock GQA 4:1 plain", 1, 300, 517, 8, 2, D};
    cs.push_back(c);
    if (!quick) {
      c = Case{d + " multiblock window+seg", 1, 333, 290, 2, 2, D};
      c.wl = 100;
      c.wr = 20;
      c.segments = true;
      cs.push_back(c);
      c = Case{d + " multiblock plain strided", 2, 257, 259, 2, 1, D};
      c.pitch_pad = 8;
      cs.push_back(c);
      c = Case{d + " multiblock causal T=1000 S=1531", 1, 1000, 1531, 2, 1, D};
      c.causal = true;
      cs.push_back(c);
      c = Case{d + " multiblock causal T>S GQA", 2, 517, 300, 4, 2, D};
      c.causal = true;
      cs.push_back(c);
      c = Case{d + " multiblock softcap window fp16", 1, 400, 400, 2, 1, D};
      c.softcap = 5.f;
      c.scale_mul = 2.f;
      c.wl = 150;
      c.fp16 = true;
      cs.push_back(c);
      c = Case{d + " multiblock segments causal", 2, 300, 300, 2, 2, D};
      c.segments = true;
      c.causal = true;
      cs.push_back(c);
      c = Case{d + " det multiblock causal T=1000 S=1531 MQA", 1, 1000, 1531, 2, 1, D};
      c.causal = true;
      c.deterministic = true;
      cs.push_back(c);
      c = Case{d + " det multiblock window+seg softcap fp16", 1, 333, 290, 2, 2, D};
      c.wl = 100;
      c.wr = 20;
      c.segments = true;
      c.softcap = 5.f;
      c.scale_mul = 2.f;
      c.fp16 = true;
      c.deterministic = true;
      cs.push_back(c);
    }
  }
  // Attention dropout (the filter "dropout" runs them all), every bucket:
  // the key split (64, 128) and the column split (256, incl. 200 and 160 in
  // it), rates 0.1 - 0.5 (0.9 on a 1 x 1 problem), GQA / MQA, causal incl.
  // T > S, windows, segment ids, the broadcast mask, deterministic mode, odd
  // and multi-block shapes, strided rows; every case at the nonzero origin
  // of kDropoutWords. Softcap with dropout is the sm80 backward's ("NS ok").
  for (int D : {64, 128, 256}) {
    const std::string d = "d" + std::to_string(D);
    Case base{d + " dropout 0.1 GQA", 2, 37, 53, 4, 2, D};
    base.dropout = 0.1f;
    cs.push_back(base);
    Case c = base;
    c.name = d + " dropout 0.5 causal T>S";
    c.dropout = 0.5f;
    c.causal = true;
    c.T = 53;
    c.S = 37;
    cs.push_back(c);
    c = base;
    c.name = d + " dropout 0.5 det causal";
    c.dropout = 0.5f;
    c.causal = true;
    c.deterministic = true;
    cs.push_back(c);
    c = Case{d + " dropout 0.1 multiblock MQA causal", 1, 300, 517, 2, 1, D};
    c.dropout = 0.1f;
    c.causal = true;
    cs.push_back(c);
    c = base;
    c.name = d + " dropout softcap -> NS";
    c.softcap = 2.f;
    c.expect_ns = true;
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
      c.name = d + " dropout 0.5 broadcast";
      c.dropout = 0.5f;
      c.drop_broadcast = true;
      cs.push_back(c);
      c = Case{d + " dropout 0.3 multiblock win+seg det", 1, 333, 290, 2, 2, D};
      c.wl = 100;
      c.wr = 20;
      c.segments = true;
      c.deterministic = true;
      c.dropout = 0.3f;
      cs.push_back(c);
      c = Case{d + " dropout 0.5 multiblock GQA 4:1 T=1000 S=1531", 1, 1000, 1531, 4, 1, D};
      c.dropout = 0.5f;
      cs.push_back(c);
      c = Case{d + " dropout 0.2 multiblock causal T>S fp16", 2, 517, 300, 4, 2, D};
      c.dropout = 0.2f;
      c.causal = true;
      c.fp16 = true;
      cs.push_back(c);
    }
  }
  {
    Case c{"d200 (bucket 256) dropout 0.25 strided", 2, 70, 45, 2, 1, 200};
    c.dropout = 0.25f;
    c.pitch_pad = 8;
    cs.push_back(c);
    c = Case{"d160 (bucket 256) dropout 0.1 multiblock window", 1, 200, 180, 2, 2, 160};
    c.dropout = 0.1f;
    c.wl = 40;
    c.wr = 10;
    cs.push_back(c);
    c = Case{"d256 tiny T=1 S=1 dropout 0.9", 1, 1, 1, 1, 1, 256};
    c.dropout = 0.9f;
    cs.push_back(c);
  }
  // kBlockM 80 (variant 2: hdim-128 bucket, no causal / local bound):
  // whole and partial 80-row blocks, GQA sums over several query blocks,
  // softcap and segments together (the segment mask of the softcap kernel
  // collects mismatch bits), a head dim zero-padded to 128, fp16.
  {
    cs.push_back(Case{"d128 multiblock plain T=160 S=300 (2 x 80 rows)", 1, 160, 300, 2, 1, 128});
    Case c{"d128 multiblock softcap+seg GQA T=413 S=389", 2, 413, 389, 4, 2, 128};
    c.softcap = 5.f;
    c.scale_mul = 2.f;
    c.segments = true;
    cs.push_back(c);
    c = Case{"d128 multiblock segments T=241 S=700", 1, 241, 700, 2, 2, 128};
    c.segments = true;
    cs.push_back(c);
    cs.push_back(Case{"d112 multiblock plain GQA T=330 S=129", 1, 330, 129, 6, 2, 112});
    c = Case{"d128 multiblock plain fp16 T=250 S=333", 2, 250, 333, 4, 2, 128};
    c.fp16 = true;
    cs.push_back(c);
    c = Case{"d96 multiblock softcap fp16 T=170 S=90", 1, 170, 90, 2, 1, 96};
    c.softcap = 5.f;
    c.fp16 = true;
    cs.push_back(c);
  }
  // Deterministic with more CTAs than SMs (several waves: CTAs wait for ones
  // of an earlier wave), causal and not.
  {
    Case c{"det waves causal GQA d64 (B=8 H=8:4 T=S=520)", 8, 520, 520, 8, 4, 64};
    c.causal = true;
    c.deterministic = true;
    cs.push_back(c);
    c = Case{"det waves plain d128 (B=4 H=8:8 T=333 S=520)", 4, 333, 520, 8, 8, 128};
    c.deterministic = true;
    cs.push_back(c);
    c = Case{"det waves causal d256 (B=4 H=4:4 T=S=600)", 4, 600, 600, 4, 4, 256};
    c.causal = true;
    c.deterministic = true;
    cs.push_back(c);
    c = Case{"det d200 causal GQA strided", 2, 300, 517, 4, 2, 200};
    c.causal = true;
    c.deterministic = true;
    c.pitch_pad = 8;
    cs.push_back(c);
    c = Case{"det d80 left window only T<S", 1, 150, 400, 4, 1, 80};
    c.wl = 16;
    c.deterministic = true;
    cs.push_back(c);
    c = Case{"det T=0", 1, 0, 70, 2, 1, 128};
    c.deterministic = true;
    cs.push_back(c);
    c = Case{"det S=0", 1, 20, 0, 2, 1, 64};
    c.deterministic = true;
    cs.push_back(c);
  }
  // The head-dim pair 192 / 128 (DeepSeek MLA; the default's 64 x 96 tiles,
  // each consumer WG 48 keys, and in bf16 variant 3's 64 x 64 column split):
  // odd T and S (KV blocks whose second WG's keys lie past S, or part of
  // them), GQA / MQA, causal, T > S (empty rows), windows, segment ids,
  // softcap, fp16, strided rows, deterministic mode, edges; a pair without
  // sm90 kernels must decline.
  {
    auto mla = [&](const std::string& name, int B, int T, int S, int H, int Hk) {
      Case c{"mla d192v128 " + name, B, T, S, H, Hk, 192};
      c.Dv = 128;
      return c;
    };
    Case c = mla("plain", 2, 37, 53, 4, 2);
    cs.push_back(c);
    c = mla("causal", 2, 37, 53, 4, 2);
    c.causal = true;
    cs.push_back(c);
    c = mla("causal T>S (empty rows)", 2, 53, 37, 4, 2);
    c.causal = true;
    cs.push_back(c);
    c = mla("window(7,3)", 2, 37, 53, 4, 2);
    c.wl = 7;
    c.wr = 3;
    cs.push_back(c);
    c = mla("segments", 2, 37, 53, 4, 2);
    c.segments = true;
    cs.push_back(c);
    c = mla("softcap 2 (scale x4)", 2, 37, 53, 4, 2);
    c.softcap = 2.f;
    c.scale_mul = 4.f;
    cs.push_back(c);
    c = mla("fp16 causal", 2, 37, 53, 4, 2);
    c.causal = true;
    c.fp16 = true;
    cs.push_back(c);
    c = mla("multiblock GQA 4:1 plain", 1, 300, 517, 8, 2);
    cs.push_back(c);
    c = mla("multiblock causal T=S=384 (whole 96-key blocks)", 1, 384, 384, 2, 1);
    c.causal = true;
    cs.push_back(c);
    c = mla("multiblock MQA causal", 1, 300, 517, 2, 1);
    c.causal = true;
    cs.push_back(c);
    c = mla("multiblock causal T>S GQA", 2, 517, 300, 4, 2);
    c.causal = true;
    cs.push_back(c);
    c = mla("multiblock causal T=1000 S=1531", 1, 1000, 1531, 2, 1);
    c.causal = true;
    cs.push_back(c);
    c = mla("multiblock window+seg", 1, 333, 290, 2, 2);
    c.wl = 100;
    c.wr = 20;
    c.segments = true;
    cs.push_back(c);
    c = mla("multiblock plain strided", 2, 257, 259, 2, 1);
    c.pitch_pad = 8;
    cs.push_back(c);
    c = mla("multiblock softcap window fp16", 1, 400, 400, 2, 1);
    c.softcap = 5.f;
    c.scale_mul = 2.f;
    c.wl = 150;
    c.fp16 = true;
    cs.push_back(c);
    c = mla("multiblock segments causal", 2, 300, 300, 2, 2);
    c.segments = true;
    c.causal = true;
    cs.push_back(c);
    c = mla("det causal", 2, 37, 53, 4, 2);
    c.causal = true;
    c.deterministic = true;
    cs.push_back(c);
    c = mla("det multiblock GQA 4:1 plain", 1, 300, 517, 8, 2);
    c.deterministic = true;
    cs.push_back(c);
    c = mla("det multiblock causal T>S GQA", 2, 517, 300, 4, 2);
    c.causal = true;
    c.deterministic = true;
    cs.push_back(c);
    c = mla("det window+seg softcap fp16", 1, 333, 290, 2, 2);
    c.wl = 100;
    c.wr = 20;
    c.segments = true;
    c.softcap = 5.f;
    c.scale_mul = 2.f;
    c.fp16 = true;
    c.deterministic = true;
    cs.push_back(c);
    c = mla("det waves causal (B=4 H=4:4 T=S=600)", 4, 600, 600, 4, 4);
    c.causal = true;
    c.deterministic = true;
    cs.push_back(c);
    c = mla("deterministic w/o workspace -> NS", 2, 37, 53, 4, 2);
    c.causal = true;
    c.deterministic = true;
    c.no_semaphore = true;
    c.expect_ns = true;
    cs.push_back(c);
    cs.push_back(mla("tiny T=1 S=1", 1, 1, 1, 1, 1));
    c = mla("window(0,0) diag only", 1, 70, 70, 2, 1);
    c.wl = 0;
    c.wr = 0;
    cs.push_back(c);
    cs.push_back(mla("S=0 (dQ = 0)", 1, 20, 0, 2, 1));
    cs.push_back(mla("T=0 (dK = dV = 0)", 1, 0, 70, 2, 1));
    c = Case{"mla d192v96 (no sm90 pair) -> NotSupported", 2, 37, 53, 2, 1, 192};
    c.Dv = 96;
    c.expect_ns = true;
    cs.push_back(c);
  }
  // Head dims served by a larger bucket (zero-filled columns).
  cs.push_back(Case{"d40 (bucket 64)", 2, 37, 53, 4, 2, 40});
  cs.push_back(Case{"d80 (bucket 128, pitch 96) strided", 2, 37, 53, 4, 4, 80, false, -1, -1, false,
                    0.f, 1.f, false, false, 8});
  Case c{"d80 multiblock causal GQA", 1, 300, 517, 4, 2, 80};
  c.causal = true;
  cs.push_back(c);
  // The 256 bucket: 200 (column block 3 half padding), 136 and 160 (block 3
  // entirely padding: zero-filled loads, no dQ reduction, no dK / dV store).
  cs.push_back(Case{"d200 (bucket 256) strided", 2, 37, 53, 4, 2, 200, false, -1, -1, false, 0.f, 1.f,
                    false, false, 8});
  c = Case{"d200 multiblock causal GQA", 1, 300, 517, 4, 2, 200};
  c.causal = true;
  cs.push_back(c);
  cs.push_back(Case{"d136 (bucket 256) plain", 2, 70, 90, 2, 1, 136});
  c = Case{"d160 multiblock window+seg fp16", 1, 200, 180, 2, 2, 160};
  c.wl = 40;
  c.wr = 10;
  c.segments = true;
  c.fp16 = true;
  cs.push_back(c);
  c = Case{"d264 -> NotSupported", 2, 37, 53, 2, 1, 264};
  c.expect_ns = true;
  cs.push_back(c);
  cs.push_back(Case{"tiny T=1 S=1", 1, 1, 1, 1, 1, 64});
  c = Case{"window(0,0) diag only", 1, 70, 70, 2, 1, 128};
  c.wl = 0;
  c.wr = 0;
  cs.push_back(c);
  c = Case{"left window only 16", 1, 150, 150, 2, 1, 64};
  c.wl = 16;
  cs.push_back(c);
  c = Case{"right window only 5, T>S", 1, 200, 130, 2, 1, 128};
  c.wr = 5;
  cs.push_back(c);
  cs.push_back(Case{"S=0 (dQ = 0)", 1, 20, 0, 2, 1, 64});
  cs.push_back(Case{"T=0 (dK = dV = 0)", 1, 0, 70, 2, 1, 128});
  c = Case{"causal T=S=1 many heads", 3, 1, 1, 8, 8, 128};
  c.causal = true;
  cs.push_back(c);
  // The same edges for the hdim-256 consumer (64-key blocks, 1 dO stage).
  cs.push_back(Case{"d256 tiny T=1 S=1", 1, 1, 1, 1, 1, 256});
  c = Case{"d256 window(0,0) diag only", 1, 70, 70, 2, 1, 256};
  c.wl = 0;
  c.wr = 0;
  cs.push_back(c);
  c = Case{"d256 right window only 5, T>S", 1, 200, 130, 2, 1, 256};
  c.wr = 5;
  cs.push_back(c);
  cs.push_back(Case{"d256 S=0 (dQ = 0)", 1, 20, 0, 2, 1, 256});
  cs.push_back(Case{"d256 T=0 (dK = dV = 0)", 1, 0, 70, 2, 1, 256});
  return cs;
}

// ------------------------------------------------------------------ bench

__global__ void fill_bits(uint16_t* p, size_t n, uint32_t seed) {
  // Deterministic pseudo-random bf16 values in about [-2, 2).
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    const float f = (float(x & 0xFFFF) / 65536.f) * 4.f - 2.f;
    p[i] = __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
}

// Rows whose label contains `filter` (all when empty; "mla": the head-dim pair).
// softcap > 0: instead of the tables below, the cost of softcap: per shape the
// default with softcap, variant 4 (softcap's tanh as 1 - 2 / (1 + e^{2y})) and
// the default without softcap, timed in that order (LSE from the sm80 forward
// with the softcap).
static void bench(const std::string& filter, float softcap) {
  struct Shape {
    int D, H, Dv;
    std::string label() const {
      return Dv == D ? "d" + std::to_string(D) : "mla d" + std::to_string(D) + "v" + std::to_string(Dv);
    }
  };
  const int B = 2, T = 8192, S = 8192;
  std::printf("bench: B=%d T=S=%d bf16, backward TF/s (2.5 x fwd FLOPs, fwd = 2 B H T S (D + D_v), halved "
              "when causal: benchmarks/bench_attention.py's; the pair's GEMMs are 2 B H T S (3 D + 2 D_v), "
              "x 1.04 at 192 / 128; 10 calls between events, median of 5; incl. dq_accum memset and "
              "dq_convert)\n",
              B, T);
  if (softcap > 0.f)
    std::printf("softcap %g: %-5s %-4s %-7s %9s %9s %9s %9s %9s   %s\n", softcap, "D", "H", "causal", "sm90",
                "sm90 v4", "no sc", "sm90/nosc", "v4/nosc", "max|d_v4-d_sm90|/max|d_sm90| (dQ, dK, dV)");
  else
    std::printf("%-5s %-4s %-7s %9s %9s %9s %9s %9s %7s %7s %9s %6s %5s   %s\n", "D", "H", "causal", "sm90",
                "sm90 v1", "sm90 v2", "sm90 v3", "sm80", "90/80", "v2/v3", "sm90 det", "det/90", "bits",
                "max|d90-d80|/max|d80| (dQ, dK, dV; default, v2)");
  // Attention dropout rows, printed after the table: rate 0.1 (threshold 26)
  // with the tests' key words, the sm90 dropout kernels against the sm80
  // backward's (the same mask, so their gradients agree to rounding).
  std::vector<std::string> drop_rows;
  uint32_t* d_words = dev_alloc<uint32_t>(std::size(kDropoutWords));
  CHECK_CUDA(cudaMemcpy(d_words, kDropoutWords, sizeof(kDropoutWords), cudaMemcpyHostToDevice));
  for (Shape sh : {Shape{128, 16, 128}, Shape{64, 32, 64}, Shape{256, 8, 256}, Shape{192, 16, 128}}) {
    if (!filter.empty() && sh.label().find(filter) == std::string::npos) continue;
    // q, k, dq, dk: n elements; v, o, dO, dv: n_v (T == S).
    const size_t n = size_t(B) * T * sh.H * sh.D, n_v = size_t(B) * T * sh.H * sh.Dv;
    const size_t n_of[3] = {n, n, n_v};  // dq, dk, dv
    uint16_t *dq_in = dev_alloc<uint16_t>(n), *dk_in = dev_alloc<uint16_t>(n),
             *dv_in = dev_alloc<uint16_t>(n_v), *ddo = dev_alloc<uint16_t>(n_v), *d_o = dev_alloc<uint16_t>(n_v);
    uint32_t seed = 1;
    for (uint16_t* p : {dq_in, dk_in}) fill_bits<<<1024, 256>>>(p, n, seed++);
    for (uint16_t* p : {dv_in, ddo}) fill_bits<<<1024, 256>>>(p, n_v, seed++);
    uint16_t* g[3][3];
    for (auto& gi : g)
      for (int t = 0; t < 3; ++t) gi[t] = dev_alloc<uint16_t>(n_of[t]);
    const size_t nstat = size_t(B) * sh.H * T;
    float* d_lse = dev_alloc<float>(nstat);
    float* d_delta = dev_alloc<float>(nstat);
    CHECK_CUDA(cudaMemset(d_delta, 0, nstat * 4));  // any value: timing only
    const size_t nacc =
        size_t(B) * sh.H * jax_flash::rounded_seqlen(T) * jax_flash::rounded_head_dim(sh.D, sh.Dv);
    float* d_acc = dev_alloc<float>(nacc);
    int32_t* d_sem = dev_alloc<int32_t>(size_t(jax_flash::sm90_bwd_semaphore_ints(B, sh.H, T)));
    uint16_t* g_det[3];
    for (int t = 0; t < 3; ++t) g_det[t] = dev_alloc<uint16_t>(n_of[t]);
    for (bool causal : {false, true}) {
      BwdParams p{};
      p.q = dq_in;
      p.k = dk_in;
      p.v = dv_in;
      p.o = d_o;
      p.lse = d_lse;
      const int64_t rs = int64_t(sh.H) * sh.D, rs_v = int64_t(sh.H) * sh.Dv;
      p.q_row_stride = p.k_row_stride = rs;
      p.v_row_stride = p.o_row_stride = rs_v;
      p.q_head_stride = p.k_head_stride = sh.D;
      p.v_head_stride = p.o_head_stride = sh.Dv;
      p.q_batch_stride = p.k_batch_stride = rs * T;
      p.v_batch_stride = p.o_batch_stride = rs_v * T;
      p.batch = B;
      p.seqlen_q = T;
      p.seqlen_k = S;
      p.num_heads = p.num_heads_k = sh.H;
      p.head_dim = sh.D;
      p.head_dim_v = sh.Dv;
      p.scale = float(1.0 / std::sqrt(double(sh.D)));
      p.window_left = -1;
      p.window_right = causal ? 0 : -1;
      p.softcap = softcap;
      p.dtype = DType::kBFloat16;
      CHECK_CUDA(cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, 0));
      CHECK_CUDA(jax_flash::sm80::run_fwd(p, 0));  // LSE (and O, unused)
      p.dout = ddo;
      p.delta = d_delta;
      p.seqlen_q_rounded = jax_flash::rounded_seqlen(T);
      p.seqlen_k_rounded = jax_flash::rounded_seqlen(S);
      p.head_dim_rounded = jax_flash::rounded_head_dim(sh.D, sh.Dv);
      p.dq_accum = d_acc;
      p.deterministic = false;
      const double flops = 2.5 * 2.0 * B * sh.H * double(T) * S * (sh.D + sh.Dv) * (causal ? 0.5 : 1.0);
      cudaEvent_t e0, e1;
      CHECK_CUDA(cudaEventCreate(&e0));
      CHECK_CUDA(cudaEventCreate(&e1));
      auto time_it = [&](auto&& launch) -> double {
        if (launch() != cudaSuccess) return -1;
        CHECK_CUDA(cudaDeviceSynchronize());
        std::vector<double> reps;
        for (int r = 0; r < 5; ++r) {
          CHECK_CUDA(cudaEventRecord(e0));
          for (int i = 0; i < 10; ++i) launch();
          CHECK_CUDA(cudaEventRecord(e1));
          CHECK_CUDA(cudaEventSynchronize(e1));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
          reps.push_back(ms / 10);
        }
        CHECK_CUDA(cudaGetLastError());
        return flops / (median(reps) * 1e-3) / 1e12;
      };
      if (softcap > 0.f) {  // the default and v4 with softcap, the default without
        double ts[3] = {-1, -1, -1};
        for (int impl : {0, 1, 2}) {
          BwdParams pi = p;
          pi.dq = g[impl][0];
          pi.dk = g[impl][1];
          pi.dv = g[impl][2];
          if (impl == 2) pi.softcap = 0.f;
          const int variant = impl == 1 ? jax_flash::sm90::tuning::kSoftcapExp : 0;
          ts[impl] = jax_flash::sm90::tuning::variant_applies(pi, variant)
                         ? time_it([&] { return jax_flash::sm90::tuning::run_variant(pi, variant, 0); })
                         : -1;
        }
        double rel[3] = {-1, -1, -1};
        if (ts[0] > 0 && ts[1] > 0) {
          std::vector<uint16_t> a, b;
          for (int t = 0; t < 3; ++t) {
            a.resize(n_of[t]);
            b.resize(n_of[t]);
            CHECK_CUDA(cudaMemcpy(a.data(), g[1][t], n_of[t] * 2, cudaMemcpyDeviceToHost));
            CHECK_CUDA(cudaMemcpy(b.data(), g[0][t], n_of[t] * 2, cudaMemcpyDeviceToHost));
            double md = 0, mr = 0;
            for (size_t i = 0; i < n_of[t]; ++i) {
              const double d = std::fabs(double(from_bits(a[i], false)) - from_bits(b[i], false));
              md = std::isnan(d) ? INFINITY : std::max(md, d);
              mr = std::max(mr, std::fabs(double(from_bits(b[i], false))));
            }
            rel[t] = md / std::max(mr, 1e-30);
          }
        }
        std::printf("%-5d %-4d %-7s %9.1f %9.1f %9.1f %9.3f %9.3f   %.3g %.3g %.3g\n", sh.D, sh.H,
                    causal ? "yes" : "no", ts[0], ts[1], ts[2], ts[2] > 0 ? ts[0] / ts[2] : 0.0,
                    ts[2] > 0 ? ts[1] / ts[2] : 0.0, rel[0], rel[1], rel[2]);
        std::fflush(stdout);
        CHECK_CUDA(cudaEventDestroy(e0));
        CHECK_CUDA(cudaEventDestroy(e1));
        continue;
      }
      // Timed in the order sm90 variant 1 (row dQ reductions), 2 (kBlockM 80), 3 (the bucket's tile), sm80, sm90 default
      // (last), where they apply. Gradients: g[0] sm90 (v1, v3, then the
      // default over them), g[1] sm80, g[2] sm90 v2. tf[]: default, v1, v2,
      // v3, sm80 (-1: not run).
      double tf[5] = {-1, -1, -1, -1, -1};
      for (int impl : {1, 2, 3, 4, 0}) {
        BwdParams pi = p;
        const int gi = impl == 4 ? 1 : impl == 2 ? 2 : 0;
        pi.dq = g[gi][0];
        pi.dk = g[gi][1];
        pi.dv = g[gi][2];
        if (impl == 4)
          tf[impl] = time_it([&] { return jax_flash::sm80::run_bwd(pi, 0); });
        else
          tf[impl] = jax_flash::sm90::tuning::variant_applies(pi, impl)
                         ? time_it([&] { return jax_flash::sm90::tuning::run_variant(pi, impl, 0); })
                         : -1;
      }
      // Deterministic mode (its own outputs and semaphores), then two more
      // runs, one next to the hog kernel: bitwise identical?
      double tf_det = -1;
      const char* det_bits = "-";
      {
        BwdParams pd = p;
        pd.dq = g_det[0];
        pd.dk = g_det[1];
        pd.dv = g_det[2];
        pd.deterministic = true;
        pd.sm90_dq_semaphore = d_sem;
        if (jax_flash::sm90::bwd_supported(pd)) {
          tf_det = time_it([&] { return jax_flash::sm90::run_bwd(pd, 0); });
          std::vector<uint16_t> a[3], b;
          for (int t = 0; t < 3; ++t) {
            a[t].resize(n_of[t]);
            CHECK_CUDA(cudaMemcpy(a[t].data(), g_det[t], n_of[t] * 2, cudaMemcpyDeviceToHost));
          }
          bool same = true;
          int num_sms = 0;
          CHECK_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, 0));
          for (uint32_t rep = 1; rep <= 2; ++rep) {
            for (int t = 0; t < 3; ++t) CHECK_CUDA(cudaMemset(g_det[t], 0xFF, n_of[t] * 2));
            if (rep == 2) launch_hog(0xC2B2AE35u, num_sms);
            CHECK_CUDA(jax_flash::sm90::run_bwd(pd, 0));
            CHECK_CUDA(cudaDeviceSynchronize());
            for (int t = 0; t < 3; ++t) {
              b.resize(n_of[t]);
              CHECK_CUDA(cudaMemcpy(b.data(), g_det[t], n_of[t] * 2, cudaMemcpyDeviceToHost));
              same = same && b == a[t];
            }
          }
          det_bits = same ? "same" : "DIFF";
        }
      }
      // max |d(sm90 impl) - d(sm80)| / max |d(sm80)| per gradient
      auto rel_to_sm80 = [&](int gi, double (&rel)[3]) {
        std::vector<uint16_t> a, b;
        for (int t = 0; t < 3; ++t) {
          a.resize(n_of[t]);
          b.resize(n_of[t]);
          CHECK_CUDA(cudaMemcpy(a.data(), g[gi][t], n_of[t] * 2, cudaMemcpyDeviceToHost));
          CHECK_CUDA(cudaMemcpy(b.data(), g[1][t], n_of[t] * 2, cudaMemcpyDeviceToHost));
          double md = 0, mr = 0;
          for (size_t i = 0; i < n_of[t]; ++i) {
            const double x = from_bits(a[i], false), y = from_bits(b[i], false);
            const double d = std::fabs(x - y);
            md = std::isnan(d) ? INFINITY : std::max(md, d);
            mr = std::max(mr, std::fabs(y));
          }
          rel[t] = md / std::max(mr, 1e-30);
        }
      };
      double rel[3] = {-1, -1, -1}, rel2[3] = {-1, -1, -1};
      if (tf[0] > 0 && tf[4] > 0) rel_to_sm80(0, rel);
      if (tf[2] > 0 && tf[4] > 0) rel_to_sm80(2, rel2);
      const std::string dcol =
          std::to_string(sh.D) + (sh.Dv == sh.D ? std::string() : "/" + std::to_string(sh.Dv));
      std::printf("%-5s %-4d %-7s", dcol.c_str(), sh.H, causal ? "yes" : "no");
      for (double x : tf) {
        if (x < 0)
          std::printf(" %9s", "-");
        else
          std::printf(" %9.1f", x);
      }
      std::printf(" %7.2f", tf[0] > 0 && tf[4] > 0 ? tf[0] / tf[4] : 0.0);
      if (tf[2] > 0 && tf[3] > 0)
        std::printf(" %7.3f", tf[2] / tf[3]);
      else
        std::printf(" %7s", "-");
      if (tf_det < 0)
        std::printf(" %9s %6s", "-", "-");
      else
        std::printf(" %9.1f %6.2f", tf_det, tf[0] > 0 ? tf_det / tf[0] : 0.0);
      std::printf(" %5s   %.3g %.3g %.3g", det_bits, rel[0], rel[1], rel[2]);
      if (tf[2] > 0) std::printf("   v2: %.3g %.3g %.3g", rel2[0], rel2[1], rel2[2]);
      // The pair: the default's 64 x 96 dKV_swapAB tile against variant 3, its 64 x 64 column split.
      if (sh.Dv != sh.D && tf[0] > 0 && tf[3] > 0) std::printf("   64x96/64x64 (default/v3): %.3f", tf[0] / tf[3]);
      std::printf("\n");
      std::fflush(stdout);
      {
        BwdParams pd = p;
        pd.dropout = dropout_args(0.1f, false);
        pd.dropout.words = d_words;
        // sm90 (g[0]), sm80 (g[1]), sm90 variant kDropAlt (g[2]: the masks
        // drawn the other way; hdim 64 / 128), timed alt, sm80, sm90.
        double td[3] = {-1, -1, -1};
        for (int impl : {2, 1, 0}) {
          BwdParams pi = pd;
          pi.dq = g[impl][0];
          pi.dk = g[impl][1];
          pi.dv = g[impl][2];
          constexpr int kAlt = jax_flash::sm90::tuning::kDropAlt;
          if (impl == 2)
            td[impl] = jax_flash::sm90::tuning::variant_applies(pi, kAlt)
                           ? time_it([&] { return jax_flash::sm90::tuning::run_variant(pi, kAlt, 0); })
                           : -1;
          else
            td[impl] = impl == 1 ? time_it([&] { return jax_flash::sm80::run_bwd(pi, 0); })
                                 : time_it([&] { return jax_flash::sm90::run_bwd(pi, 0); });
        }
        double rd[3] = {-1, -1, -1}, ra[3] = {-1, -1, -1};
        if (td[0] > 0 && td[1] > 0) rel_to_sm80(0, rd);
        if (td[2] > 0 && td[1] > 0) rel_to_sm80(2, ra);
        char line[320];
        std::snprintf(line, sizeof(line), "%-5d %-4d %-7s %9.1f %9.1f %7.2f %9.1f %7.3f   %.3g %.3g %.3g   alt: %.3g %.3g %.3g",
                      sh.D, sh.H, causal ? "yes" : "no", td[0], td[1], td[0] > 0 && td[1] > 0 ? td[0] / td[1] : 0.0,
                      td[2], td[0] > 0 && td[2] > 0 ? td[2] / td[0] : 0.0, rd[0], rd[1], rd[2], ra[0], ra[1], ra[2]);
        drop_rows.push_back(line);
      }
      CHECK_CUDA(cudaEventDestroy(e0));
      CHECK_CUDA(cudaEventDestroy(e1));
    }
    for (void* ptr : std::initializer_list<void*>{dq_in, dk_in, dv_in, ddo, d_o, d_lse, d_delta, d_acc, d_sem})
      CHECK_CUDA(cudaFree(ptr));
    for (uint16_t* x : g_det) CHECK_CUDA(cudaFree(x));
    for (auto& gi : g)
      for (auto& x : gi) CHECK_CUDA(cudaFree(x));
  }
  CHECK_CUDA(cudaFree(d_words));
  if (softcap > 0.f) return;
  std::printf("\ndropout 0.1 (same shapes; -1: not served): backward TF/s; drop-alt = variant %d (the keep masks\n"
              "drawn the other way: producer warpgroup <-> consumer warpgroups), alt/90 its speed over the default\n"
              "%-5s %-4s %-7s %9s %9s %7s %9s %7s   %s\n",
              int(jax_flash::sm90::tuning::kDropAlt), "D", "H", "causal", "sm90", "sm80", "90/80", "drop-alt",
              "alt/90", "max|d90-d80|/max|d80| (dQ, dK, dV), and of drop-alt");
  for (const std::string& r : drop_rows) std::printf("%s\n", r.c_str());
}

int main(int argc, char** argv) {
  std::string filter;
  bool quick = false, do_bench = false;
  float softcap = 0.f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick")
      quick = true;
    else if (a == "--bench")
      do_bench = true;
    else if (a.rfind("--variant=", 0) == 0)
      g_only_variant = std::atoi(a.c_str() + 10);
    else if (a.rfind("--softcap=", 0) == 0)
      softcap = float(std::atof(a.c_str() + 10));
    else
      filter = a;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d), %d SMs\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  if (do_bench) {
    bench(filter, softcap);
    return 0;
  }
  std::mt19937 rng(1234);
  int failed = 0, run = 0, skipped = 0;
  std::printf("%-40s %9s %9s %9s %4s %3s  %s\n", "case", "dQ", "dK", "dV", "pad", "#v", "result");
  for (const Case& c : all_cases(quick)) {
    if (!filter.empty() && c.name.find(filter) == std::string::npos) continue;
    const Row r = run_case(c, rng);
    if (r.skipped) {
      ++skipped;
      std::printf("%-40s %9s %9s %9s %4s %3s  %s\n", c.name.c_str(), "-", "-", "-", "-", "-",
                  "SKIP (run_bwd: not supported)");
      continue;
    }
    ++run;
    failed += !r.pass;
    if (r.ns_checked) {
      std::printf("%-40s %9s %9s %9s %4s %3s  %s\n", c.name.c_str(), "-", "-", "-", "-", "-",
                  r.pass ? "PASS (NS ok)" : "FAIL (expected cudaErrorNotSupported, untouched outputs)");
    } else {
      std::string det;
      if (r.det_runs > 0)
        det = std::string(r.det_same ? " det x" + std::to_string(r.det_runs) : " det: BITS DIFFER") +
              (r.det_sem_ok ? "" : " SEMAPHORES BAD") + (r.nondet_differs ? " (nondet: differs)" : "");
      std::printf("%-40s %9.2e %9.2e %9.2e %4s %3d  %s%s%s\n", c.name.c_str(), r.dq, r.dk, r.dv,
                  r.pad_ok ? "ok" : "BAD", r.variants_run, r.pass ? "PASS" : "FAIL ",
                  r.failed_variants.c_str(), det.c_str());
    }
    std::fflush(stdout);
  }
  std::printf("%d passed, %d failed, %d skipped\n", run - failed, failed, skipped);
  return (failed || run == 0) ? 1 : 0;
}
