// The tile-span pre-pass (cuda/packing/tile_spans.cu), run on the host
// emulator, against a plain reference of the packing buffer: per group a
// scan of the whole other side, key by key (the definition the kernel's
// fragments must reproduce word for word). Random segment ids: sorted runs
// (aligned and not, empty documents), padding ids, few small ids in any
// order, ids spread wider than a group's table, fragments past the kernel's
// shared-memory capacity; T != S, batch > 1, with and without diagonal
// shifts, unbounded, causal and windowed bands. Built by
//   cuda/tests/emu/build_emu.sh OUT packing   ->  OUT/tile_spans_check_emu
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "jax_flash/packing_layout.h"
#include "packing/tile_spans.h"

using jax_flash::kSpanInts;
using jax_flash::kSpanRows;
using jax_flash::packing::TileSpanArgs;

namespace {

int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

// The packing buffer from its definition (packing_layout.h, mask_info.h).
std::vector<int32_t> reference(const TileSpanArgs& a) {
  const bool shifts = a.q_shift != nullptr;
  const auto lay = jax_flash::packing_layout(a.batch, a.seqlen_q, a.seqlen_k, shifts);
  std::vector<int32_t> out(lay.total);
  const int T = a.seqlen_q, S = a.seqlen_k, off = S - T;
  for (int b = 0; b < a.batch; ++b) {
    for (int side = 0; side < 2; ++side) {
      const bool q_side = side == 0;
      const int own_len = q_side ? T : S, other_len = q_side ? S : T;
      const int32_t* own = (q_side ? a.q_seg : a.kv_seg) + int64_t(b) * own_len;
      const int32_t* other = (q_side ? a.kv_seg : a.q_seg) + int64_t(b) * other_len;
      const int32_t* shift = shifts ? (q_side ? a.q_shift : a.kv_shift) + int64_t(b) * own_len : nullptr;
      const int band_lo = q_side ? a.window_left : a.window_right;
      const int band_hi = q_side ? a.window_right : a.window_left;
      const int groups = (own_len + kSpanRows - 1) / kSpanRows;
      for (int g = 0; g < groups; ++g) {
        const int t0 = g * kSpanRows, rows = std::min(kSpanRows, own_len - t0);
        int smin = INT_MAX, smax = INT_MIN, pmin = INT_MAX, pmax = INT_MIN;
        std::vector<int> pos(rows);
        for (int r = 0; r < rows; ++r) {
          const int sh = shift ? shift[t0 + r] : 0;
          pos[r] = q_side ? t0 + r + off + sh : t0 + r - off - sh;
          smin = std::min(smin, own[t0 + r]);
          smax = std::max(smax, own[t0 + r]);
          pmin = std::min(pmin, pos[r]);
          pmax = std::max(pmax, pos[r]);
        }
        const bool table = int64_t(smax) - smin < kSpanRows;
        int lo = other_len, hi = 0, count = 0;
        std::vector<int> t_lo(kSpanRows, other_len), t_hi(kSpanRows, 0), t_n(kSpanRows, 0);
        for (int j = 0; j < other_len; ++j) {
          const int v = other[j];
          if (v < smin || v > smax) continue;
          lo = std::min(lo, j);
          hi = std::max(hi, j + 1);
          ++count;
          if (table) {
            t_lo[v - smin] = std::min(t_lo[v - smin], j);
            t_hi[v - smin] = std::max(t_hi[v - smin], j + 1);
            ++t_n[v - smin];
          }
        }
        bool exact = table;
        std::vector<int> run_lo(rows, 0), run_hi(rows, 0);
        for (int r = 0; r < rows && table; ++r) {
          const int k = own[t0 + r] - smin;
          run_lo[r] = t_n[k] > 0 ? t_lo[k] : 0;
          run_hi[r] = t_n[k] > 0 ? t_hi[k] : 0;
          exact = exact && t_n[k] == run_hi[r] - run_lo[r];
        }
        for (int r = 0; r < rows; ++r) {
          int64_t vl = run_lo[r], vh = run_hi[r];
          if (band_lo >= 0) vl = std::max(vl, int64_t(pos[r]) - band_lo);
          if (band_hi >= 0) vh = std::min(vh, int64_t(pos[r]) + band_hi + 1);
          vl = clamp64(vl, 0, other_len);
          vh = clamp64(vh, vl, other_len);
          const int64_t tok = int64_t(b) * own_len + t0 + r;
          int32_t* iv = out.data() + (q_side ? lay.q_iv : lay.kv_iv) + 2 * tok;
          iv[0] = exact ? int32_t(vl) : 0;
          iv[1] = exact ? int32_t(vh) : other_len;
          if (shift) out[(q_side ? lay.q_shift : lay.kv_shift) + tok] = shift[t0 + r];
        }
        const bool one_run = smin == smax && count == hi - lo;
        int64_t l = lo, h = hi, fl = lo, fh = hi;
        if (band_lo >= 0) {
          l = std::max(l, int64_t(pmin) - band_lo);
          fl = std::max(fl, int64_t(pmax) - band_lo);
        }
        if (band_hi >= 0) {
          h = std::min(h, int64_t(pmax) + band_hi + 1);
          fh = std::min(fh, int64_t(pmin) + band_hi + 1);
        }
        l = clamp64(l, 0, other_len);
        h = clamp64(h, 0, other_len);
        if (h <= l) l = h = 0;
        fl = clamp64(fl, l, h);
        fh = clamp64(fh, l, h);
        if (!one_run || fh <= fl) fl = fh = 0;
        const int64_t base = q_side ? lay.q_span : lay.kv_span;
        int32_t* e = out.data() + base + (int64_t(b) * groups + g) * kSpanInts;
        const int32_t ev[kSpanInts] = {int32_t(l), int32_t(h), int32_t(fl), int32_t(fh), exact ? 1 : 0, 0, 0, 0};
        std::memcpy(e, ev, sizeof ev);
      }
    }
  }
  return out;
}

std::mt19937 rng(1234);
int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

// Sorted runs of random lengths (some empty: their ids never appear) from
// id `first`, then `pad` tokens of id `pad_id`.
std::vector<int32_t> runs(int n, int max_len, int first, int pad, int pad_id) {
  std::vector<int32_t> ids;
  int id = first;
  while (int(ids.size()) < n - pad) {
    const int len = uniform(0, max_len);
    for (int i = 0; i < len && int(ids.size()) < n - pad; ++i) ids.push_back(id);
    ++id;
  }
  ids.resize(n, pad_id);
  return ids;
}

struct Case {
  const char* name;
  int batch, T, S;
  int kind;  // 0 same runs, 1 q the last T of the keys' runs, 2 independent runs,
             // 3 small ids in any order, 4 wide ids, 5 padding, 6 alternating (spill)
};

std::vector<int32_t> ids_of(int kind, int n, bool q, const std::vector<int32_t>& keys, int T) {
  switch (kind) {
    case 0:
      return keys;
    case 1:
      return q ? std::vector<int32_t>(keys.end() - T, keys.end()) : keys;
    case 2:
      return runs(n, 300, uniform(-3, 3), 0, 0);
    case 3: {
      std::vector<int32_t> v(n);
      for (auto& x : v) x = uniform(0, 3);
      return v;
    }
    case 4: {
      std::vector<int32_t> v(n);
      for (auto& x : v) x = uniform(-1000, 1000) * (uniform(0, 1) ? 1 : 100000);
      return v;
    }
    case 5:
      return runs(n, 200, 1, n / 7, q ? -1 : 0);
    default: {
      // Keys: sorted runs around a middle half of ids 0..3 in any order (a
      // fragment per key); queries: groups of run ids, of id 2, of ids 0..3.
      std::vector<int32_t> v(n);
      for (int i = 0; i < n; ++i) {
        if (!q) {
          v[i] = i >= n / 4 && i < 3 * n / 4 ? (i % 3) + (uniform(0, 9) == 0) : 100 + i / 500;
        } else {
          const int kind = (i / kSpanRows) % 3;
          v[i] = kind == 0 ? 100 + i / 250 : kind == 1 ? 2 : uniform(0, 3);
        }
      }
      return v;
    }
  }
}

}  // namespace

int main() {
  const Case cases[] = {
      {"same runs", 1, 16384, 16384, 0},     {"same runs odd", 2, 1333, 1333, 0},
      {"q suffix", 2, 333, 1000, 1},         {"q suffix short", 1, 1, 77, 1},
      {"independent", 3, 700, 450, 2},       {"small ids", 2, 501, 389, 3},
      {"wide ids", 1, 300, 520, 4},          {"padding", 2, 1200, 1200, 5},
      {"spill", 1, 4100, 8200, 6},           {"tiny", 1, 5, 3, 0},
      {"many groups", 1, 70000, 70000, 0},
  };
  const int bands[][2] = {{-1, -1}, {-1, 0}, {17, 5}, {0, 0}, {300, -1}};
  int failures = 0, checked = 0;
  for (const Case& c : cases) {
    for (int shifted = 0; shifted < 2; ++shifted) {
      for (const auto& band : bands) {
        const bool big = c.T > 5000 || c.S > 5000;
        if (big && (shifted || band[0] == 0)) continue;  // keep the emulator's time down
        std::vector<int32_t> q, k, qs, ks;
        for (int b = 0; b < c.batch; ++b) {
          const std::vector<int32_t> keys = c.kind <= 1 ? runs(c.S, 600, uniform(-2, 5), 0, 0)
                                                        : ids_of(c.kind, c.S, false, {}, c.T);
          const std::vector<int32_t> qi = c.kind <= 1 ? ids_of(c.kind, c.T, true, keys, c.T)
                                                      : ids_of(c.kind, c.T, true, {}, c.T);
          q.insert(q.end(), qi.begin(), qi.end());
          k.insert(k.end(), keys.begin(), keys.end());
        }
        if (shifted) {
          for (size_t i = 0; i < q.size(); ++i) qs.push_back(uniform(-40, 40));
          for (size_t i = 0; i < k.size(); ++i) ks.push_back(uniform(-40, 40));
        }
        TileSpanArgs a{};
        a.q_seg = q.data();
        a.kv_seg = k.data();
        a.q_shift = shifted ? qs.data() : nullptr;
        a.kv_shift = shifted ? ks.data() : nullptr;
        a.batch = c.batch;
        a.seqlen_q = c.T;
        a.seqlen_k = c.S;
        a.window_left = band[0];
        a.window_right = band[1];
        const std::vector<int32_t> want = reference(a);
        std::vector<int32_t> got(want.size(), 0x7eadbeef);
        a.out = got.data();
        const cudaError_t err = jax_flash::packing::tile_spans(a, nullptr);
        int bad = err != cudaSuccess ? 1 : 0;
        int64_t first_bad = -1;
        for (size_t i = 0; i < want.size(); ++i)
          if (got[i] != want[i]) {
            if (first_bad < 0) first_bad = int64_t(i);
            ++bad;
          }
        ++checked;
        if (bad) {
          ++failures;
          std::printf("FAIL %s B=%d T=%d S=%d shifts=%d band=(%d,%d): %d words differ (err %d), first at %lld: %d != %d\n",
                      c.name, c.batch, c.T, c.S, shifted, band[0], band[1], bad, int(err),
                      (long long)first_bad, first_bad >= 0 ? got[first_bad] : 0,
                      first_bad >= 0 ? want[first_bad] : 0);
        }
      }
    }
    std::printf("%-16s B=%d T=%d S=%d: done\n", c.name, c.batch, c.T, c.S);
    std::fflush(stdout);
  }
  std::printf("%d of %d calls differ from the reference\n", failures, checked);
  return failures ? 1 : 0;
}
