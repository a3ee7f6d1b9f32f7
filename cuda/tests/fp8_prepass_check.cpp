// CPU check of the FP8 pre-pass's index math and rotation (cuda/fp8/
// prepass_layout.h, cuda/fp8/quantize.cu), run by tests/test_fp8_prepass_layout.py:
// - launch 1's unit order (slot) is a bijection onto the K, Q and V units;
// - every (unit, rank, thread, step, chunk) of the Q and K CTAs replayed as
//   rows_cta runs it (place, parts, RowThreads::row / dim, the part's rows):
//   each element of every head's rows is loaded and stored exactly once, by
//   the CTAs of one cluster for one descale block, which is written once, and
//   no load or store leaves the tensor;
// - the transform of a row spread as RowThreads spreads it (16 values per
//   lane, butterflies in the thread, across kRowLanes lanes, in the thread
//   again, lanes' partner values as fma(v, +-1, o)), with the signs as flips
//   of the sign bit, gives the same float32 bits as the transform with 4 / 8
//   values per lane over 32 lanes (v * sign, then v[i] +- v[i + h] in the
//   thread and upper ? o - v : v + o across lanes), the pre-pass's previous
//   arithmetic, on random rows: the rotated values, hence the amax, descales
//   and e4m3 bytes, are the same.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "fp8/prepass_layout.h"

using namespace jax_flash::fp8;

static int failures = 0;
#define CHECK(cond, ...)                  \
  do {                                    \
    if (!(cond)) {                        \
      if (++failures <= 20) {             \
        std::printf("FAIL: " __VA_ARGS__); \
        std::printf("\n");                \
      }                                   \
    }                                     \
  } while (0)

static void check_slot(long long k, long long q, long long v) {
  std::vector<int> seen_k(k), seen_q(q), seen_v(v);
  for (long long i = 0; i < k + q + v; ++i) {
    const Slot s = slot(i, k, q);
    if (s.kind == kKindK) {
      CHECK(s.unit >= 0 && s.unit < k, "slot k=%lld q=%lld: K unit %lld", k, q, s.unit);
      if (s.unit >= 0 && s.unit < k) seen_k[s.unit]++;
    } else if (s.kind == kKindQ) {
      CHECK(s.unit >= 0 && s.unit < q, "slot k=%lld q=%lld: Q unit %lld", k, q, s.unit);
      if (s.unit >= 0 && s.unit < q) seen_q[s.unit]++;
    } else {
      CHECK(s.unit >= 0 && s.unit < v, "slot k=%lld q=%lld v=%lld: V unit %lld", k, q, v, s.unit);
      if (s.unit >= 0 && s.unit < v) seen_v[s.unit]++;
    }
  }
  for (auto c : seen_k) CHECK(c == 1, "slot: a K unit taken %d times", c);
  for (auto c : seen_q) CHECK(c == 1, "slot: a Q unit taken %d times", c);
  for (auto c : seen_v) CHECK(c == 1, "slot: a V unit taken %d times", c);
}

// rows_cta's loads and stores for one kind over `heads` heads of n rows
// (batch 1; the batch index enters as the head's does).
template <int D>
static void check_rows(int kind, int block, int n, int heads) {
  using R = RowThreads<D>;
  const int P = parts(kind, D);
  const int part_rows = block / P;
  const int steps = (part_rows + R::kStepRows - 1) / R::kStepRows;
  const long long blocks = (n + block - 1) / block;
  const long long items = blocks * heads;
  const long long nunits = units(items, kind, D);
  std::vector<int> loads(size_t(n) * heads * D), stores(size_t(n) * heads * D);
  std::vector<int> desc(items);
  for (long long u = 0; u < nunits; ++u) {
    for (int r = 0; r < kClusterCtas; ++r) {
      const Place pl = place(u, r, kind, D);
      CHECK(pl.part == r % P && r - pl.part + P <= kClusterCtas, "D=%d: a block's parts leave the cluster", D);
      if (pl.item >= items) continue;  // inactive
      // A block's parts lie in one unit (cluster).
      CHECK(pl.item / (kClusterCtas / P) == u, "D=%d: block %lld not in unit %lld", D, pl.item, u);
      const int blk = int(pl.item % blocks), h = int(pl.item / blocks);
      if (pl.part == 0) desc[pl.item]++;
      for (int tid = 0; tid < kPrepassThreads; ++tid) {
        const int t = (tid % 32) % R::kRowLanes;
        for (int s = 0; s < steps; ++s) {
          const int in_part = R::row(tid, s);
          const int row = blk * block + pl.part * part_rows + in_part;
          // the kernel: row0 + s kStepRows == row
          CHECK(row == blk * block + pl.part * part_rows + R::row(tid, 0) + s * R::kStepRows, "row form");
          if (in_part >= part_rows || row >= n) continue;
          for (int j = 0; j < R::kRowElems; ++j) {
            const int d = R::dim(t, j);
            // the kernel's address: 8 t + 8 kRowLanes c + e within the row
            CHECK(d == 8 * t + 8 * R::kRowLanes * (j / 8) + j % 8, "dim form");
            CHECK(d >= 0 && d < D, "D=%d: dim %d", D, d);
            if (d < 0 || d >= D) continue;
            const size_t at = (size_t(row) * heads + h) * D + d;
            loads[at]++;
            stores[at]++;
          }
        }
      }
    }
  }
  for (size_t i = 0; i < loads.size(); ++i) {
    CHECK(loads[i] == 1 && stores[i] == 1, "D=%d kind %d n=%d: element %zu loaded %d, stored %d times", D, kind,
          n, i, loads[i], stores[i]);
  }
  for (long long i = 0; i < items; ++i) CHECK(desc[i] == 1, "D=%d kind %d: descale %lld written %d times", D, kind, i, desc[i]);
}

static uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
static float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// The previous arithmetic: element d = E lane + e, E = D / 32.
static void fwht_lanes32(std::vector<float>& x, int D) {
  const int E = D / 32;
  std::vector<float> v = x;  // v[E lane + e]
  for (int h = 1; h < E; h *= 2)
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < E; ++i)
        if ((i & h) == 0) {
          const float a = v[E * lane + i], b = v[E * lane + i + h];
          v[E * lane + i] = a + b;
          v[E * lane + i + h] = a - b;
        }
  for (int m = 1; m < 32; m *= 2) {
    std::vector<float> o(D);
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < E; ++e) o[E * lane + e] = v[E * (lane ^ m) + e];
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < E; ++e) {
        const int i = E * lane + e;
        v[i] = (lane & m) ? o[i] - v[i] : v[i] + o[i];
      }
  }
  x = v;
}

// rows_cta's: RowThreads<D>, kRowLanes lanes of 16 values.
template <int D>
static void fwht_rowthreads(std::vector<float>& x) {
  using R = RowThreads<D>;
  constexpr int L = R::kRowLanes, E = R::kRowElems;
  std::vector<float> v(L * E);  // v[E t + j] = x[dim(t, j)]
  for (int t = 0; t < L; ++t)
    for (int j = 0; j < E; ++j) v[E * t + j] = x[R::dim(t, j)];
  for (int h = 1; h < 8; h *= 2)
    for (int t = 0; t < L; ++t)
      for (int i = 0; i < E; ++i)
        if ((i & h) == 0) {
          const float a = v[E * t + i], b = v[E * t + i + h];
          v[E * t + i] = a + b;
          v[E * t + i + h] = a - b;
        }
  for (int m = 1; m < L; m *= 2) {
    std::vector<float> o(L * E);
    for (int t = 0; t < L; ++t)
      for (int e = 0; e < E; ++e) o[E * t + e] = v[E * (t ^ m) + e];
    for (int t = 0; t < L; ++t) {
      const float sgn = (t & m) ? -1.f : 1.f;
      for (int e = 0; e < E; ++e) v[E * t + e] = std::fmaf(v[E * t + e], sgn, o[E * t + e]);
    }
  }
  for (int t = 0; t < L; ++t)
    for (int e = 0; e < 8; ++e) {
      const float a = v[E * t + e], b = v[E * t + e + 8];
      v[E * t + e] = a + b;
      v[E * t + e + 8] = a - b;
    }
  for (int t = 0; t < L; ++t)
    for (int j = 0; j < E; ++j) x[R::dim(t, j)] = v[E * t + j];
}

template <int D>
static void check_fwht(std::mt19937& gen) {
  constexpr float kNorm = D == 64 ? 0.125f : D == 128 ? 0.08838834764831845f : 0.0625f;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  std::vector<float> sg(D);
  int rows = 0, differ = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    for (int d = 0; d < D; ++d) sg[d] = ud(gen) < 0.5f ? -1.f : 1.f;
    std::vector<float> x(D);
    for (int d = 0; d < D; ++d) {
      float y = nd(gen) * (ud(gen) < 0.01f ? 100.f : 1.f);
      if (trial % 7 == 0) y = std::round(y * 4.f) / 4.f;  // exact sums and ties: signed zeros
      // a bf16 value (the inputs' precision)
      x[d] = from_bits(bits(y) & 0xffff0000u);
    }
    std::vector<float> a(D), b(D);
    for (int d = 0; d < D; ++d) {
      a[d] = x[d] * sg[d];
      b[d] = from_bits(bits(x[d]) ^ (sg[d] < 0.f ? 0x80000000u : 0u));
    }
    fwht_lanes32(a, D);
    fwht_rowthreads<D>(b);
    ++rows;
    bool same = true;
    for (int d = 0; d < D; ++d) same &= bits(a[d] * kNorm) == bits(b[d] * kNorm);
    differ += !same;
  }
  CHECK(differ == 0, "D=%d: %d of %d rotated rows differ in their bits", D, differ, rows);
}

int main() {
  for (long long k : {0, 1, 2, 5, 37})
    for (long long q : {0, 1, 3, 5, 128})
      for (long long v : {0, 1, 4, 9}) check_slot(k, q, v);
  for (int n : {1, 17, 63, 64, 65, 131, 159, 160, 161, 223, 224, 225, 333, 1000, 2049})
    for (int heads : {1, 3}) {
      check_rows<64>(kKindK, 160, n, heads);
      check_rows<64>(kKindQ, 64, n, heads);
      check_rows<128>(kKindK, 224, n, heads);
      check_rows<128>(kKindQ, 64, n, heads);
      check_rows<256>(kKindK, 128, n, heads);
      check_rows<256>(kKindQ, 64, n, heads);
    }
  std::mt19937 gen(1234);
  check_fwht<64>(gen);
  check_fwht<128>(gen);
  check_fwht<256>(gen);
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("ok: launch 1's order, Q/K element coverage, rotation bits\n");
  return 0;
}
