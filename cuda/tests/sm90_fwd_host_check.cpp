// CPU-only checks of the sm90 forward's host-side choices (no GPU needed; run
// by tools/build/build_sm90_tests.sh):
// - TileOrder (sm90/common/tile_scheduler.cuh), the order both persistent schedulers
//   walk: over [0, total) decode is a bijection onto (block, head, batch); with
//   a causal-like mask the blocks of each head come heaviest (last) first and
//   the heads of one L2 section are interleaved, so that the CTAs running at
//   the same time share a section's K/V;
// - persistent_grid: one CTA per SM, at most one per tile;
// - the production policy (sm90/fwd/fwd_tuning.h) keeps the constraints the
//   kernels assert (Q in registers only with the overlap schedule, the
//   dynamic scheduler exactly for causal-like masks).
#include <cstdio>
#include <set>
#include <tuple>
#include <vector>

// Host shims for the device-only names tile_scheduler.cuh mentions (only the
// host-side functions and TileOrder::decode are called here).
#include <algorithm>
#define JF_DEVICE inline
struct JfDim {
  unsigned x = 0, y = 0, z = 0;
};
static JfDim gridDim, blockIdx, threadIdx;
using std::max;
using std::min;
inline int atomicAdd(int* p, int v) { return (*p += v) - v; }
inline unsigned long long __cvta_generic_to_shared(const void*) { return 0; }
inline int __shfl_sync(unsigned, int v, int) { return v; }

#include "sm90/fwd/fwd_tuning.h"
#include "sm90/fwd/v_transpose.h"
#include "sm90/common/tile_scheduler.cuh"

using namespace jax_flash::sm90;

static int failures = 0;
#define CHECK(cond, ...)                         \
  do {                                           \
    if (!(cond)) {                               \
      if (failures++ < 10) {                     \
        std::printf("FAIL %s: ", #cond);         \
        std::printf(__VA_ARGS__);                \
        std::printf("\n");                       \
      }                                          \
    }                                            \
  } while (0)

int main() {
  int cases = 0;
  for (int batch : {1, 3})
    for (int heads : {1, 2, 6, 32})
      for (int heads_per_kv : {1, 2})
        for (int seqlen : {1, 127, 128, 1000, 8192})
          for (int seqlen_kv : {1, 4096, 65536})
            for (bool causal : {false, true}) {
              if (heads % heads_per_kv != 0) continue;
              ++cases;
              TileOrder::Arguments a{batch, heads, heads_per_kv, seqlen, seqlen_kv, 128, 2, 128, causal};
              const TileOrder o = TileOrder::make(a);
              CHECK(o.total == o.num_blocks * batch * heads, "total %d", o.total);
              std::set<std::tuple<int, int, int>> seen;
              std::vector<int> last_block(size_t(batch) * heads, 1 << 30);
              bool order_ok = true;
              for (int t = 0; t < o.total; ++t) {
                const TileCoord c = o.decode(t);
                const bool in_range = c.block >= 0 && c.block < o.num_blocks && c.head >= 0 &&
                                      c.head < heads && c.batch >= 0 && c.batch < batch && c.split == 0;
                CHECK(in_range, "t %d -> (%d, %d, %d)", t, c.block, c.head, c.batch);
                if (!in_range) break;
                seen.insert({c.block, c.head, c.batch});
                int& lb = last_block[size_t(c.batch) * heads + c.head];
                // causal: each head's blocks descend; plain: ascend.
                if (causal ? c.block >= lb : (lb != (1 << 30) && c.block <= lb)) order_ok = false;
                lb = c.block;
              }
              CHECK(int(seen.size()) == o.total, "B %d H %d T %d causal %d: %zu distinct of %d", batch,
                    heads, seqlen, causal, seen.size(), o.total);
              CHECK(order_ok, "B %d H %d T %d causal %d: block order", batch, heads, seqlen, causal);
              if (causal) {
                CHECK(o.heads_per_section >= 1 && o.heads_per_section <= batch * heads &&
                          (o.heads_per_section % heads_per_kv == 0 ||
                           o.heads_per_section == batch * heads),
                      "section %d", o.heads_per_section);
              } else {
                CHECK(o.heads_per_section == 0, "plain order has no sections (%d)", o.heads_per_section);
              }
            }
  for (int sms : {1, 7, 132})
    for (int tiles : {0, 1, 5, 131, 132, 133, 5000}) {
      ++cases;
      const int g = persistent_grid(tiles, sms);
      CHECK(g == std::min(tiles, sms), "tiles %d sms %d grid %d", tiles, sms, g);
    }
  // The buckets and the head-dim pair 192 / 128.
  const int shapes[][2] = {{64, 64}, {128, 128}, {256, 256}, {192, 128}};
  for (const auto& shape : shapes)
    for (bool causal_like : {false, true}) {
      ++cases;
      const int d = shape[0], dv = shape[1];
      const FwdTuning t = fwd_default_tuning(d, dv, causal_like);
      CHECK(!t.q_in_regs || t.overlap, "d %d: Q in registers needs the overlap schedule", d);
      CHECK(t.dynamic_scheduler == causal_like, "d %d causal_like %d", d, causal_like);
      CHECK(t.block_m() <= 256 && t.block_n % 16 == 0 && t.block_n <= 256, "d %d tile", d);
      // With dropout: whole 64-key chunks per KV block (philox.h); Q in
      // registers only with the producer's bit mask (the consumers' own draw
      // keeps the Philox output live across the GEMMs instead), and then
      // where the policy puts it without dropout.
      const FwdTuning td = fwd_default_tuning(d, dv, causal_like, 2, false, true);
      CHECK(td.block_n % 64 == 0, "d %d dropout", d);
      CHECK(td.dropout_producer_mask == kFwdDropoutProducerMask, "d %d dropout: the mask's side", d);
      CHECK(!td.q_in_regs || (td.dropout_producer_mask && t.q_in_regs && td.overlap), "d %d dropout: Q in registers", d);
    }
  // FP8 (8-bit inputs, 16-bit O): the KV tile is the scheme's K descale
  // block, whole 32-key k-steps of the PV GEMM, one Q descale per consumer
  // warpgroup, and the shared-memory plan (Q, K, V and V^T rings of whole
  // 128-key atoms, O of its own or in the V ring) within sm_90's 227 KB less
  // the barriers' room (epilogue.cuh kFwdSmemLimit).
  for (int d : {64, 128, 256})
    for (bool causal_like : {false, true}) {
      ++cases;
      const FwdTuning t = fwd_default_tuning(d, d, causal_like, 1);
      CHECK(t.block_n == jax_flash::fp8_k_block(d), "fp8 d %d: KV tile %d, K block %d", d, t.block_n,
            jax_flash::fp8_k_block(d));
      CHECK(t.block_n % 32 == 0 && t.block_n <= 256 && t.block_m() % jax_flash::kFp8QBlock == 0, "fp8 d %d tile", d);
      CHECK(!t.q_in_regs, "fp8 d %d: Q in registers reads 16-bit fragments", d);
      const int kv = t.block_n * d, o = t.block_m() * d * 2;
      const int plan = t.block_m() * d + t.stages * (2 * kv + vt_stage_bytes(d, t.block_n)) + (t.o_in_v ? 0 : o);
      CHECK(plan <= 227 * 1024 - 1024 - 256, "fp8 d %d: %d bytes of shared memory", d, plan);
      CHECK(!t.o_in_v || t.stages * kv >= o, "fp8 d %d: O fits the V ring", d);
    }
  CHECK(fwd_causal_like(-1, 0) && !fwd_causal_like(-1, -1) && !fwd_causal_like(3, 0),
        "causal-like masks");
  std::printf("sm90 fwd host checks: %d cases, %s\n", cases, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
