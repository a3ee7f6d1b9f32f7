// Host check of the sm90 kernels' producer-drawn dropout bit masks
// (cuda/sm90/common/drop_bits.h). The forward's (cuda/sm90/fwd/drop_mask.h):
// the words the producer warps write (drop_mask_word at each word index of
// DropMaskLayout, the tasks split over the mask threads as mainloop.cuh
// make_masks does) and what a consumer thread makes of them (drop_pair on its
// packed P fragment registers, acc_to_a's order) must keep exactly the
// elements Dropout::keep (philox.h, the reference form) keeps, at every tile
// shape of the dropout kernels, for thresholds 1..255, broadcast or not, at
// a nonzero call origin. Also: the layout is a bijection, the tasks cover
// every word once, and drop_keep_bit is a bijection onto the 32 bits. The
// backward key split's (cuda/sm90/bwd/bwd_drop_mask.h): the words the mask
// warps write (bwd_drop_mask_word at the buffer index of bwd_key_split.cuh
// draw_masks, tasks split over 64 threads) read back as the consumer thread
// does (its word row, queries 8 j + 2 t + {0, 1}, bit bwd_drop_shift + 16 h
// for key 16 warp + lane / 4 + 8 h of its WG) must give Dropout::keep.
//   g++ -std=c++17 -O2 -Wall -Icuda/include -Icuda cuda/tests/sm90_drop_mask_check.cpp -o c && ./c
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "sm90/bwd/bwd_drop_mask.h"
#include "sm90/fwd/drop_mask.h"

using jax_flash::Dropout;
using jax_flash::DropoutArgs;
namespace sm90 = jax_flash::sm90;

static int failures = 0;
#define EXPECT(cond, ...)            \
  do {                               \
    if (!(cond)) {                   \
      if (failures++ < 20) {         \
        std::printf("FAIL: " __VA_ARGS__); \
        std::printf("\n");           \
      }                              \
    }                                \
  } while (0)

template <int kBlockM, int kBlockN>
static void check_tile(std::mt19937& rng, int mask_threads) {
  using L = sm90::DropMaskLayout<kBlockM, kBlockN>;
  // The layout: a bijection between (group, lane, chunk) and word indices.
  std::vector<int> seen(L::kWords, 0);
  for (int g = 0; g < kBlockM / 16; ++g)
    for (int lane = 0; lane < 32; ++lane)
      for (int c = 0; c < L::kChunks; ++c) {
        const int w = L::word(g, lane, c);
        EXPECT(w >= 0 && w < L::kWords, "word index out of range");
        if (w < 0 || w >= L::kWords) continue;
        ++seen[w];
        EXPECT(L::group_of(w) == g && L::lane_of(w) == lane && L::chunk_of(w) == c, "layout inverse");
      }
  for (int w = 0; w < L::kWords; ++w) EXPECT(seen[w] == 1, "word %d seen %d times", w, seen[w]);
  // The producer's task split: thread j takes words j, j + mask_threads, ...
  std::vector<int> task(L::kWords, 0);
  for (int j = 0; j < mask_threads; ++j)
    for (int w = j; w < L::kWords; w += mask_threads) ++task[w];
  for (int w = 0; w < L::kWords; ++w) EXPECT(task[w] == 1, "task cover");

  std::uniform_int_distribution<uint32_t> u32;
  for (int trial = 0; trial < 24; ++trial) {
    uint32_t words[6] = {u32(rng), u32(rng), u32(rng) % 7, u32(rng) % 9, u32(rng) % 5000, 64 * (u32(rng) % 50)};
    DropoutArgs a{};
    a.words = words;
    a.threshold = 1 + u32(rng) % 255;
    if (trial < 4) a.threshold = trial == 0 ? 1 : trial == 1 ? 255 : trial == 2 ? 128 : 26;
    a.broadcast = trial % 5 == 3;
    const Dropout d(a);
    const sm90::DropMaskThreshold t(d.threshold);
    const uint32_t batch = u32(rng) % 3, head = u32(rng) % 11, m0 = kBlockM * (u32(rng) % 20),
                   n = u32(rng) % 30;
    // Producer: every word of block n of the tile at query row m0.
    std::vector<uint32_t> smem(L::kWords);
    for (int w = 0; w < L::kWords; ++w) {
      const int g = L::group_of(w), lane = L::lane_of(w), c = L::chunk_of(w);
      smem[w] = sm90::drop_mask_word(d, t, batch, head, m0 + 16 * g + lane / 4, n * L::kChunks + c, lane % 4);
    }
    // Consumers: each thread's P registers p[kk][i] (acc_to_a: row half i % 2,
    // columns 16 kk + 8 (i / 2) + 2 t + e, e = 0 in the low half).
    for (int g = 0; g < kBlockM / 16; ++g)
      for (int lane = 0; lane < 32; ++lane)
        for (int kk = 0; kk < kBlockN / 16; ++kk)
          for (int i = 0; i < 4; ++i) {
            const int h = i % 2, j = 2 * kk + i / 2, c = j / 8, m = j % 8;
            const uint32_t pair = 0x3F80u | (0x4000u << 16) | (u32(rng) & 0x007F007Fu);
            const uint32_t got = sm90::drop_pair(pair, smem[L::word(g, lane, c)], m, h);
            for (int e = 0; e < 2; ++e) {
              const uint32_t row = m0 + 16 * g + lane / 4 + 8 * h;
              const uint32_t col = n * kBlockN + 8 * j + 2 * (lane % 4) + e;
              const bool keep = d.keep(batch, head, row, col);
              const uint32_t half = (got >> (16 * e)) & 0xFFFFu, want = keep ? (pair >> (16 * e)) & 0xFFFFu : 0u;
              EXPECT(half == want, "tile %dx%d thr %u row %u col %u keep %d: got %04x want %04x", kBlockM,
                     kBlockN, d.threshold, row, col, keep, half, want);
            }
          }
  }
}

// The key split's buffers (bwd_config.cuh BwdDropoutConfig: per WG [2
// words][kBM + 8]) and the consumers' reads (bwd_key_split.cuh drop_row,
// drop_shift): kBM query rows per step, 2 WGs of 64 keys.
template <int kBM>
static void check_bwd_key_split(std::mt19937& rng, int mask_threads) {
  constexpr int kRowWords = kBM + 8, kWGWords = 2 * kRowWords, kWords = 2 * 2 * kBM;
  std::vector<int> task(kWords, 0);
  for (int j = 0; j < mask_threads; ++j)
    for (int u = j; u < kWords; u += mask_threads) ++task[u];
  for (int u = 0; u < kWords; ++u) EXPECT(task[u] == 1, "bwd task cover");
  std::uniform_int_distribution<uint32_t> u32;
  for (int trial = 0; trial < 16; ++trial) {
    uint32_t words[6] = {u32(rng), u32(rng), u32(rng) % 7, u32(rng) % 9, u32(rng) % 5000, 64 * (u32(rng) % 50)};
    DropoutArgs a{};
    a.words = words;
    a.threshold = trial == 0 ? 1 : trial == 1 ? 255 : 1 + u32(rng) % 255;
    a.broadcast = trial % 5 == 3;
    const Dropout d(a);
    const sm90::DropMaskThreshold t(d.threshold);
    const uint32_t batch = u32(rng) % 3, head = u32(rng) % 11, m0 = kBM * (u32(rng) % 40),
                   n0 = 128 * (u32(rng) % 30);
    std::vector<uint32_t> buf(2 * kWGWords, 0xDEADBEEFu);  // [wg][word][query], padded rows
    for (int u = 0; u < kWords; ++u) {  // draw_masks
      const int wg = u / (2 * kBM), word = (u / kBM) % 2, q = u % kBM;
      buf[wg * kWGWords + word * kRowWords + q] =
          sm90::bwd_drop_mask_word(d, t, batch, head, m0 + q, (n0 + 64 * wg) / 64, word);
    }
    for (int wg = 0; wg < 2; ++wg)
      for (int warp = 0; warp < 4; ++warp)
        for (int lane = 0; lane < 32; ++lane) {
          const int row = wg * kWGWords + ((lane / 4) / 4) * kRowWords + 2 * (lane % 4);
          const int sh = sm90::bwd_drop_shift(warp, lane);
          for (int j = 0; j < kBM / 8; ++j)
            for (int e = 0; e < 2; ++e)
              for (int h = 0; h < 2; ++h) {
                const uint32_t z = buf[row + 8 * j + e];
                const bool got = (z >> (sh + 16 * h)) & 1u;
                const uint32_t q = m0 + 8 * j + 2 * (lane % 4) + e;
                const uint32_t key = n0 + 64 * wg + 16 * warp + lane / 4 + 8 * h;
                EXPECT(got == d.keep(batch, head, q, key), "bwd kBM %d thr %u query %u key %u", kBM,
                       d.threshold, q, key);
              }
        }
  }
}

int main() {
  // drop_keep_bit: (h, c) -> bit, a bijection onto 0..31.
  int used = 0;
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 16; ++c) {
      const int b = sm90::drop_keep_bit(h, c);
      EXPECT(b >= 0 && b < 32 && !(used >> b & 1), "keep bit %d of (%d, %d)", b, h, c);
      if (b >= 0 && b < 32) used |= 1 << b;
    }
  // drop_mask_half against KeepBits (the consumers' own decisions) bit by bit.
  std::mt19937 rng(2026);
  std::uniform_int_distribution<uint32_t> u32;
  for (uint32_t thr = 1; thr < 256; ++thr)
    for (int trial = 0; trial < 64; ++trial) {
      jax_flash::Philox4x32 w{{u32(rng), u32(rng), u32(rng), u32(rng)}};
      if (trial == 0) w = {{0u, 0xFFFFFFFFu, thr * 0x01010101u, (thr - 1) * 0x01010101u}};
      const jax_flash::KeepBits kb(w, thr);
      const sm90::DropMaskThreshold t(thr);
      const uint32_t r0 = sm90::drop_mask_half<0>(0u, w, t), r1 = sm90::drop_mask_half<1>(0u, w, t);
      for (int c = 0; c < 16; ++c) {
        EXPECT(((r0 >> sm90::drop_keep_bit(0, c)) & 1u) == uint32_t(kb.keep(c)), "half 0 thr %u byte %d", thr, c);
        EXPECT(((r1 >> sm90::drop_keep_bit(1, c)) & 1u) == uint32_t(kb.keep(c)), "half 1 thr %u byte %d", thr, c);
      }
      EXPECT((r0 & r1) == 0u, "row halves overlap");
    }
  // The dropout kernels' tiles (fwd_tuning.h): 192 x 128 (hdim 64), 128 x 128
  // (hdim 128, the pair 192 / 128), 128 x 64 (hdim 256); 96 mask threads.
  check_tile<192, 128>(rng, 96);
  check_tile<128, 128>(rng, 96);
  check_tile<128, 64>(rng, 96);
  // The backward's key split (hdim 64: kBlockM 128; hdim 128: 64), 64 mask threads.
  check_bwd_key_split<128>(rng, 64);
  check_bwd_key_split<64>(rng, 64);
  std::printf("sm90_drop_mask_check: %s (%d failures)\n", failures ? "FAIL" : "PASS", failures);
  return failures ? 1 : 0;
}
