// The varlen forward's tile order (jax_flash/varlen_order.h) on the host:
// for random packings (empty sequences, tokens outside every sequence,
// q and kv lengths that differ, batch rows > 1, causal-like or not, the
// tiles of each head-dim bucket) the cursor's decode, driven as the kernel
// drives it (each CTA decodes increasing indices from a shared counter, in
// a random interleaving), must give
//   - every (sequence, query block, head) of a non-empty sequence exactly
//     once, and nothing past the last index;
//   - the brute-force order: levels descending, then sequence, then head;
//   - heaviest first for causal T == S with square tiles: the KV block
//     count (the mask's own block range) never rises along the order;
//   - rows and keys in bounds of the tensors.
// Run by tests/test_varlen_order.py (g++), prints "ok".
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <tuple>
#include <vector>

#include "jax_flash/block_info.h"
#include "jax_flash/varlen_order.h"

using jax_flash::VarlenCursor;
using jax_flash::VarlenOrder;
using jax_flash::VarlenSeq;
using jax_flash::VarlenTile;

namespace {

int failures = 0;
#define CHECK(cond, ...)                       \
  do {                                         \
    if (!(cond)) {                             \
      if (failures++ < 20) {                   \
        std::printf("FAIL %s: ", #cond);       \
        std::printf(__VA_ARGS__);              \
        std::printf("\n");                     \
      }                                        \
    }                                          \
  } while (0)

struct Case {
  std::vector<int32_t> cu_q, cu_k;  // [batch, n + 1]
  int batch, n, total_q, total_k, heads, bm, bn;
  bool causal;
  int section = 0;  // query heads per section (0: all)
};

// Lengths: a long tail (mostly short, some up to max_len), empty ones.
std::vector<int32_t> offsets(std::mt19937& rng, int n, int max_len, int lead, int& total) {
  std::vector<int32_t> cu(n + 1);
  cu[0] = lead;
  for (int s = 0; s < n; ++s) {
    const int kind = int(rng() % 8);
    int len = kind == 0 ? 0 : kind == 1 ? int(rng() % 8) + 1 : kind < 6 ? int(rng() % 300) : int(rng() % max_len);
    cu[s + 1] = cu[s] + len;
  }
  total = cu[n] + int(rng() % 3) * 17;  // tokens past the last sequence
  return cu;
}

Case random_case(std::mt19937& rng) {
  Case c;
  c.batch = 1 + int(rng() % 3);
  c.n = 1 + int(rng() % 70);
  c.heads = 1 + int(rng() % 9);
  c.section = rng() % 2 ? 1 + int(rng() % c.heads) : 0;
  const int tiles[3][2] = {{192, 128}, {128, 128}, {128, 80}};
  const int t = int(rng() % 3);
  c.bm = tiles[t][0];
  c.bn = tiles[t][1];
  c.causal = rng() % 2 == 0;
  const bool same = rng() % 2 == 0;  // self-attention: one offsets array
  const int max_len = 1 + int(rng() % 6000);
  std::vector<std::vector<int32_t>> q(c.batch), k(c.batch);
  int tq = 0, tk = 0;
  for (int b = 0; b < c.batch; ++b) {
    int a, bb;
    const int lead = rng() % 4 == 0 ? int(rng() % 50) : 0;
    q[b] = offsets(rng, c.n, max_len, lead, a);
    if (same) {
      k[b] = q[b];
      bb = a;
    } else {
      k[b] = offsets(rng, c.n, max_len, 0, bb);
    }
    tq = std::max(tq, a);
    tk = std::max(tk, bb);
  }
  c.total_q = tq;
  c.total_k = tk;
  for (int b = 0; b < c.batch; ++b) {
    c.cu_q.insert(c.cu_q.end(), q[b].begin(), q[b].end());
    c.cu_k.insert(c.cu_k.end(), k[b].begin(), k[b].end());
  }
  return c;
}

VarlenOrder order_of(const Case& c) {
  VarlenOrder o;
  o.cu_q = c.cu_q.data();
  o.cu_k = c.cu_k.data();
  o.batch = c.batch;
  o.num_seqs = c.n;
  o.total_q = c.total_q;
  o.total_k = c.total_k;
  o.num_heads = c.heads;
  o.heads_per_section = c.section > 0 ? c.section : c.heads;
  o.block_m = c.bm;
  o.block_n = c.bn;
  o.causal_like = c.causal;
  return o;
}

// (level, g, head, block) by brute force, in the order's definition:
// head section, then levels descending, sequence, head.
std::vector<std::tuple<int, int, int, int>> reference(const VarlenOrder& o) {
  std::vector<std::tuple<int, int, int, int>> r;
  for (int g = 0; g < o.num_sequences(); ++g) {
    int lo, nb;
    o.levels(o.seq(g), lo, nb);
    for (int m = 0; m < nb; ++m)
      for (int h = 0; h < o.num_heads; ++h) r.emplace_back(lo + m, g, h, m);
  }
  const int hs = o.heads_per_section;
  std::sort(r.begin(), r.end(), [hs](const auto& a, const auto& b) {
    if (std::get<2>(a) / hs != std::get<2>(b) / hs) return std::get<2>(a) / hs < std::get<2>(b) / hs;
    if (std::get<0>(a) != std::get<0>(b)) return std::get<0>(a) > std::get<0>(b);
    if (std::get<1>(a) != std::get<1>(b)) return std::get<1>(a) < std::get<1>(b);
    return std::get<2>(a) < std::get<2>(b);
  });
  return r;
}

// KV blocks a tile visits (the kernel's block range of its sequence).
int kv_blocks(const Case& c, const VarlenSeq& s, int block) {
  jax_flash::BlockInfo bi = jax_flash::make_block_info(
      jax_flash::SeqlenInfo{0, 0, s.len_q, s.len_k}, -1, c.causal ? 0 : -1);
  int first, last;
  bi.kv_block_range(block * c.bm, c.bm, c.bn, first, last);
  return last - first;
}

void run(const Case& c, std::mt19937& rng) {
  const VarlenOrder o = order_of(c);
  const auto ref = reference(o);
  const int total = int(ref.size());
  // CTAs claim indices as the kernel does: index b first, then counter + grid.
  const int grid = 1 + int(rng() % 140);
  std::vector<VarlenCursor> cursor(grid);
  std::vector<int> next(grid);
  std::vector<bool> done(grid, false);
  for (int b = 0; b < grid; ++b) {
    cursor[b] = o.start();
    next[b] = b;
  }
  int counter = 0, live = grid;
  std::vector<int> seen(total, 0);
  while (live > 0) {
    const int b = int(rng() % grid);
    if (done[b]) continue;
    const int t = next[b];
    const VarlenTile w = o.decode(cursor[b], t);
    if (t >= total) {
      CHECK(w.block < 0, "index %d past the last tile %d decodes a tile", t, total);
      done[b] = true;
      --live;
      continue;
    }
    CHECK(w.block >= 0, "index %d of %d decodes no tile", t, total);
    if (w.block < 0) {
      done[b] = true;
      --live;
      continue;
    }
    ++seen[t];
    const auto& e = ref[t];
    const int g = std::get<1>(e);
    CHECK(w.head == std::get<2>(e) && w.block == std::get<3>(e) && w.batch == g / c.n,
          "index %d: got (batch %d, block %d, head %d), want (g %d, block %d, head %d)", t, w.batch,
          w.block, w.head, g, std::get<3>(e), std::get<2>(e));
    const VarlenSeq s = o.seq(g);
    CHECK(w.seq.offset_q == s.offset_q && w.seq.len_q == s.len_q && w.seq.offset_k == s.offset_k &&
              w.seq.len_k == s.len_k,
          "index %d: sequence geometry", t);
    CHECK(w.seq.offset_q + w.block * c.bm < w.seq.offset_q + w.seq.len_q && w.seq.offset_q >= 0 &&
              w.seq.offset_q + w.seq.len_q <= c.total_q && w.seq.offset_k >= 0 &&
              w.seq.offset_k + w.seq.len_k <= c.total_k,
          "index %d: rows out of bounds", t);
    next[b] = grid + counter++;
  }
  for (int t = 0; t < total; ++t) CHECK(seen[t] == 1, "tile %d decoded %d times", t, seen[t]);
  // One claim per decoded tile, as the kernel's producer makes them.
  CHECK(counter == total, "claims: %d for %d tiles", counter, total);
  // Every tile of every non-empty sequence is in the reference once.
  int64_t want = 0;
  for (int g = 0; g < o.num_sequences(); ++g) want += int64_t((o.seq(g).len_q + c.bm - 1) / c.bm) * c.heads;
  CHECK(want == total, "reference has %d tiles, want %lld", total, (long long)want);
  if (c.causal && c.bm == c.bn && c.cu_q == c.cu_k) {
    int prev = 1 << 30;
    for (int t = 0; t < total; ++t) {
      const auto& e = ref[t];
      if (t > 0 && std::get<2>(e) / o.heads_per_section != std::get<2>(ref[t - 1]) / o.heads_per_section)
        prev = 1 << 30;  // a new section starts from its heaviest tiles
      const int cost = kv_blocks(c, o.seq(std::get<1>(e)), std::get<3>(e));
      CHECK(cost <= prev, "causal order not heaviest first at %d: %d after %d", t, cost, prev);
      prev = cost;
    }
  }
  // Levels never rise within a section (what the cursor relies on).
  for (int t = 1; t < total; ++t)
    if (std::get<2>(ref[t]) / o.heads_per_section == std::get<2>(ref[t - 1]) / o.heads_per_section)
      CHECK(std::get<0>(ref[t]) <= std::get<0>(ref[t - 1]), "levels rise at %d", t);
  // The grid's bound covers every tile.
  CHECK(VarlenOrder::max_tiles(c.batch, c.n, c.total_q, c.heads, c.bm) >= total, "max_tiles below %d", total);
}

}  // namespace

int main() {
  std::mt19937 rng(1234);
  for (int i = 0; i < 400; ++i) run(random_case(rng), rng);
  // The L2 sections: whole GQA groups, all heads when K and V fit.
  CHECK(VarlenOrder::l2_section_heads(1, 16384, 256, 16, 4) == 16, "16k tokens, 4 KV heads: one section");
  CHECK(VarlenOrder::l2_section_heads(1, 16384, 256, 16, 1) == 4, "16k tokens, 16 KV heads: 4 per section");
  CHECK(VarlenOrder::l2_section_heads(2, 65536, 256, 8, 2) == 2, "one GQA group at least");
  // No sequence at all / every sequence empty.
  {
    Case c{{0, 0, 0}, {0, 0, 0}, 1, 2, 5, 5, 2, 128, 128, true};
    const VarlenOrder o = order_of(c);
    VarlenCursor cur = o.start();
    CHECK(cur.level < 0, "empty packing has a level");
    CHECK(o.decode(cur, 0).block < 0, "empty packing decodes a tile");
  }
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
