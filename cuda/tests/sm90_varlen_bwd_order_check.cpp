// The varlen backward's tile order (jax_flash/varlen_bwd_order.h) on the
// host: for random packings (empty sequences, tokens outside every sequence,
// q and kv lengths that differ, batch rows > 1, causal-like or not, GQA, the
// backward's tiles) the cursor's decode, driven as the kernel drives it
// (CTA b decodes index b from the top of the order), must give
//   - every (sequence, KV block, KV head) of a sequence with keys exactly
//     once, nothing past the last index;
//   - the sequence geometry in the queries' and keys' own terms, in bounds;
//   - heaviest first for causal self-attention: the query-block count of a
//     KV block (the mask's own range, in kBlockN rows) never rises along the
//     order within a section of heads;
//   - a grid bound (max_tiles) that covers every tile.
// Run by tests/test_varlen_order.py (g++), prints "ok".
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "jax_flash/block_info.h"
#include "jax_flash/varlen_bwd_order.h"

using jax_flash::VarlenBwdOrder;
using jax_flash::VarlenCursor;
using jax_flash::VarlenSeq;
using jax_flash::VarlenTile;

namespace {

int failures = 0;
#define CHECK(cond, ...)                 \
  do {                                   \
    if (!(cond)) {                       \
      if (failures++ < 20) {             \
        std::printf("FAIL %s: ", #cond); \
        std::printf(__VA_ARGS__);        \
        std::printf("\n");               \
      }                                  \
    }                                    \
  } while (0)

std::vector<int32_t> offsets(std::mt19937& rng, int n, int max_len, int lead, int& total) {
  std::vector<int32_t> cu(n + 1);
  cu[0] = lead;
  for (int s = 0; s < n; ++s) {
    const int kind = int(rng() % 8);
    const int len = kind == 0 ? 0 : kind == 1 ? int(rng() % 8) + 1 : kind < 6 ? int(rng() % 300) : int(rng() % max_len);
    cu[s + 1] = cu[s] + len;
  }
  total = cu[n] + int(rng() % 3) * 17;
  return cu;
}

// Query blocks of kBlockN rows that KV block n of a sequence sees.
int q_blocks(const VarlenSeq& s, int n, int bn, bool causal) {
  jax_flash::BlockInfo bi = jax_flash::make_block_info(jax_flash::SeqlenInfo{0, 0, s.len_q, s.len_k}, -1,
                                                       causal ? 0 : -1);
  int first, last;
  bi.q_block_range(n * bn, bn, bn, first, last);
  return last - first;
}

void run(std::mt19937& rng) {
  // Up to 3 x 70 sequences: both sides of decode_one's cached limit (128).
  const int batch = 1 + int(rng() % 3), n = 1 + int(rng() % 70);
  const int heads_per_kv = 1 << int(rng() % 3), heads_k = 1 + int(rng() % 4);
  const int tiles[3] = {128, 128, 64};  // kBlockN of hdim 64, 128, 256
  const int bn = tiles[rng() % 3];
  const bool causal = rng() % 2 == 0, same = rng() % 2 == 0;
  const int max_len = 1 + int(rng() % 6000);
  std::vector<int32_t> cu_q, cu_k;
  int tq = 0, tk = 0;
  for (int b = 0; b < batch; ++b) {
    int a, c;
    const int lead = rng() % 4 == 0 ? int(rng() % 50) : 0;
    const auto q = offsets(rng, n, max_len, lead, a);
    const auto k = same ? q : offsets(rng, n, max_len, 0, c);
    if (same) c = a;
    cu_q.insert(cu_q.end(), q.begin(), q.end());
    cu_k.insert(cu_k.end(), k.begin(), k.end());
    tq = std::max(tq, a);
    tk = std::max(tk, c);
  }
  // Small row bytes or a huge one: one section or several.
  const int row_bytes = rng() % 2 ? 512 : 1 << 20;
  const VarlenBwdOrder o =
      VarlenBwdOrder::make(cu_q.data(), cu_k.data(), batch, n, tq, tk, heads_k, heads_per_kv, bn, row_bytes, causal);
  std::set<std::tuple<int, int, int>> want;  // (g, KV block, KV head)
  for (int b = 0; b < batch; ++b)
    for (int s = 0; s < n; ++s) {
      const int len_k = cu_k[b * (n + 1) + s + 1] - cu_k[b * (n + 1) + s];
      for (int blk = 0; blk < (len_k + bn - 1) / bn; ++blk)
        for (int h = 0; h < heads_k; ++h) want.emplace(b * n + s, blk, h);
    }
  const int total = int(want.size());
  CHECK(VarlenBwdOrder::max_tiles(batch, n, tk, heads_k, bn) >= total, "max_tiles below %d", total);
  // Every index from the top (CTA b decodes index b), and one cursor walking up.
  VarlenCursor walk = o.start();
  std::set<std::tuple<int, int, int>> got;
  int prev_cost = 1 << 30, prev_section = -1;
  for (int t = 0; t < total + 3; ++t) {
    VarlenCursor cur = o.start();
    const VarlenTile w = o.decode(cur, t);
    const VarlenTile w2 = o.decode(walk, t);
    CHECK(w.block == w2.block && w.head == w2.head && w.batch == w2.batch, "index %d: cursors differ", t);
    // The kernel's one-shot decode (register-cached level ranges up to
    // kCachedSeqs sequences, the cursor beyond) gives the same tile.
    const VarlenTile w3 = o.decode_one(t);
    CHECK(w3.block == w.block && w3.head == w.head && w3.batch == w.batch &&
              w3.seq.offset_q == w.seq.offset_q && w3.seq.len_q == w.seq.len_q &&
              w3.seq.offset_k == w.seq.offset_k && w3.seq.len_k == w.seq.len_k,
          "index %d: decode_one differs", t);
    if (t >= total) {
      CHECK(w.block < 0, "index %d past the last tile %d decodes a tile", t, total);
      continue;
    }
    CHECK(w.block >= 0, "index %d of %d decodes no tile", t, total);
    if (w.block < 0) continue;
    // Find the sequence from its offsets.
    int g = -1;
    for (int s = 0; s < n; ++s) {
      const int i = w.batch * (n + 1) + s;
      if (cu_q[i] == w.seq.offset_q && cu_q[i + 1] - cu_q[i] == w.seq.len_q && cu_k[i] == w.seq.offset_k &&
          cu_k[i + 1] - cu_k[i] == w.seq.len_k && w.block * bn < w.seq.len_k &&
          !got.count({w.batch * n + s, w.block, w.head})) {
        g = w.batch * n + s;
        break;
      }
    }
    CHECK(g >= 0, "index %d: no sequence with that geometry (batch %d, block %d)", t, w.batch, w.block);
    if (g < 0) continue;
    CHECK(got.emplace(g, w.block, w.head).second, "index %d decoded twice", t);
    CHECK(w.head >= 0 && w.head < heads_k, "index %d: head %d", t, w.head);
    CHECK(w.seq.offset_k + w.seq.len_k <= tk && w.seq.offset_q + w.seq.len_q <= tq, "index %d: rows", t);
    const int section = w.head / o.fwd.heads_per_section;
    if (section != prev_section) prev_cost = 1 << 30;
    prev_section = section;
    if (causal && same) {
      const int cost = q_blocks(w.seq, w.block, bn, true);
      CHECK(cost <= prev_cost, "causal order not heaviest first at %d: %d after %d", t, cost, prev_cost);
      prev_cost = cost;
    }
  }
  CHECK(got == want, "decoded %zu tiles, want %zu", got.size(), want.size());
}

}  // namespace

int main() {
  std::mt19937 rng(4321);
  for (int i = 0; i < 300; ++i) run(rng);
  {  // No sequence with keys.
    const std::vector<int32_t> cu{0, 0, 0};
    const VarlenBwdOrder o = VarlenBwdOrder::make(cu.data(), cu.data(), 1, 2, 5, 5, 2, 1, 128, 512, true);
    VarlenCursor cur = o.start();
    CHECK(o.decode(cur, 0).block < 0, "empty packing decodes a tile");
  }
  if (failures) {
    std::printf("%d failures\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
