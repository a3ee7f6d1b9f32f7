// CPU-only checks of the sm90 forward's host-side choices (no GPU needed; run
// by tools/build_sm90_tests.sh):
// - persistent_grid (sm90/scheduler.cuh): the balanced grid never needs more rounds
//   than one CTA per SM, never exceeds the SMs or the tiles, and leaves fewer
//   than `rounds` CTA slots idle (one CTA per SM can leave up to sms - 1);
// - variant resolution (instantiations.h): kVarBalancedGrid launches the
//   mask's default kernel (resolves and schedules like variant 0).
#include <cstdio>

// Host shims for the device-only names scheduler.cuh mentions (only the
// host-side functions below are called).
#include <algorithm>
#define JF_DEVICE inline
struct JfDim {
  unsigned x = 1, y = 1, z = 1;
};
static JfDim gridDim, threadIdx;
using std::max;
using std::min;
inline int atomicAdd(int* p, int v) { return (*p += v) - v; }
inline unsigned long long __cvta_generic_to_shared(const void*) { return 0; }
inline int __shfl_sync(unsigned, int v, int) { return v; }

#include "sm90/instantiations.h"
#include "sm90/scheduler.cuh"

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
  for (int sms : {1, 2, 7, 66, 114, 132}) {
    for (int tiles = 0; tiles <= 5000; ++tiles) {
      ++cases;
      const int plain = persistent_grid(tiles, sms, false);
      const int grid = persistent_grid(tiles, sms, true);
      CHECK(plain == (tiles < sms ? tiles : sms), "tiles %d sms %d plain %d", tiles, sms, plain);
      if (tiles == 0) {
        CHECK(grid == 0, "tiles 0 sms %d grid %d", sms, grid);
        continue;
      }
      const int rounds_plain = (tiles + plain - 1) / plain;
      const int rounds = (tiles + grid - 1) / grid;
      CHECK(grid >= 1 && grid <= plain, "tiles %d sms %d grid %d", tiles, sms, grid);
      CHECK(rounds == rounds_plain, "tiles %d sms %d: %d rounds vs %d", tiles, sms, rounds,
            rounds_plain);
      CHECK(grid * rounds - tiles < rounds, "tiles %d sms %d grid %d: %d idle slots", tiles, sms,
            grid, grid * rounds - tiles);
    }
  }
  // The motivating shape: B=2, H=16, T=8192, 128-row tiles on an H200.
  CHECK(persistent_grid(2048, 132, true) == 128, "2048 tiles on 132 SMs: %d",
        persistent_grid(2048, 132, true));
  for (int bucket : {64, 128, 256})
    for (bool causal_like : {false, true}) {
      ++cases;
      CHECK(resolved_variant(kVarBalancedGrid, bucket, causal_like) ==
                resolved_variant(0, bucket, causal_like),
            "bucket %d causal_like %d", bucket, causal_like);
      CHECK(variant_uses_dynamic(kVarBalancedGrid, bucket, causal_like) ==
                variant_uses_dynamic(0, bucket, causal_like),
            "bucket %d causal_like %d", bucket, causal_like);
    }
  std::printf("sm90 fwd host checks: %d cases, %s\n", cases, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
