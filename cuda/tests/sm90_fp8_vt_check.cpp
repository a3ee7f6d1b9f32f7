// CPU check of the FP8 forward's V transpose (sm90/fwd/v_transpose.h), run by
// tools/build/build_sm90_tests.sh: for each head dim and a warp count, every
// transposer lane's units run on the host exactly as the device loop runs
// them (same offsets, same byte permutes); then
// - every byte of the V^T stage is written exactly once, with the byte of V
//   at (physical key vt_key(kappa), d);
// - every 32-bit load and store instruction of a warp touches 32 distinct
//   banks (no conflicts).
#include <cstdio>
#include <cstring>
#include <set>
#include <vector>

#include "sm90/fwd/v_transpose.h"

using namespace jax_flash::sm90;

static int failures = 0;
#define CHECK(cond, ...)                         \
  do {                                           \
    if (!(cond)) {                               \
      if (failures++ < 10) {                     \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);                \
        std::printf("\n");                       \
      }                                          \
    }                                            \
  } while (0)

// __byte_perm on the host.
static uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}

template <int D>
static void check(int warps) {
  using L = VTransposeLayout<D>;
  // V natural [128 keys][D bytes]: a byte pattern that identifies (k, d) mod 256
  // in two planes, checked separately below.
  std::vector<uint8_t> src(L::kStageBytes), dst(L::kStageBytes, 0);
  std::vector<int> writes(L::kStageBytes, 0);
  auto value = [](int k, int d, int plane) { return uint8_t(plane ? (k * 7 + d) : (k + 131 * d)); };
  for (int plane = 0; plane < 2; ++plane) {
    for (int k = 0; k < L::kBlockN; ++k)
      for (int d = 0; d < D; ++d) src[L::src_offset(k, d)] = value(k, d, plane);
    std::fill(writes.begin(), writes.end(), 0);
    for (int w = 0; w < warps; ++w) {
      for (int s = w; s < L::kSteps; s += warps) {
        std::set<int> load_banks[4], store_banks[4];
        for (int lane = 0; lane < 32; ++lane) {
          const int q = L::quad(lane, s);
          uint32_t in[4], out[4];
          for (int j = 0; j < 4; ++j) {
            const uint32_t a = L::src_offset(L::load_key(lane, j), 4 * q);
            CHECK(a % 4 == 0, "unaligned load");
            std::memcpy(&in[j], &src[a], 4);
            load_banks[j].insert(int(a / 4 % 32));
          }
          L::key_order(in, lane);
          transpose_4x4_bytes(in, out, byte_perm);
          for (int j = 0; j < 4; ++j) {
            const uint32_t a = L::dst_offset(4 * q + j, 4 * lane);
            CHECK(a % 4 == 0, "unaligned store");
            std::memcpy(&dst[a], &out[j], 4);
            for (int b = 0; b < 4; ++b) ++writes[a + b];
            store_banks[j].insert(int(a / 4 % 32));
          }
        }
        for (int j = 0; j < 4; ++j) {
          CHECK(load_banks[j].size() == 32, "D=%d warps=%d s=%d j=%d: loads hit %zu banks", D, warps, s, j,
                load_banks[j].size());
          CHECK(store_banks[j].size() == 32, "D=%d warps=%d s=%d j=%d: stores hit %zu banks", D, warps, s,
                j, store_banks[j].size());
        }
      }
    }
    for (int d = 0; d < D; ++d)
      for (int kappa = 0; kappa < L::kBlockN; ++kappa) {
        const uint32_t a = L::dst_offset(d, kappa);
        CHECK(writes[a] == 1, "D=%d (d=%d, kappa=%d) written %d times", D, d, kappa, writes[a]);
        CHECK(dst[a] == value(L::vt_key(kappa), d, plane), "D=%d (d=%d, kappa=%d): %d, want %d", D, d,
              kappa, dst[a], value(L::vt_key(kappa), d, plane));
      }
  }
  // vt_key is a permutation of each group of 32 keys.
  std::set<int> keys;
  for (int kappa = 0; kappa < L::kBlockN; ++kappa) {
    const int k = L::vt_key(kappa);
    CHECK(k / 32 == kappa / 32, "vt_key leaves its group");
    keys.insert(k);
  }
  CHECK(int(keys.size()) == L::kBlockN, "vt_key is not a permutation");
}

int main() {
  for (int warps : {1, 3, 4}) {
    check<64>(warps);
    check<128>(warps);
    check<256>(warps);
  }
  std::printf("%s: FP8 V transpose (D = 64, 128, 256; 1, 3, 4 warps)\n", failures ? "FAIL" : "ok");
  return failures ? 1 : 0;
}
