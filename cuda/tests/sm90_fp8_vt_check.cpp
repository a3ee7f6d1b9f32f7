// CPU check of the FP8 forward's V transpose (sm90/fwd/v_transpose.h), run by
// tools/build/build_sm90_tests.sh and tests/test_fp8_v_transpose.py. For each
// head dim, KV tile (kBlockN keys: whole 128-key V^T atoms and a partly used
// last one) and transposer warp count, every step of every warp runs on the
// host as the device runs it (VTranspose in v_transpose.cuh): the same
// addresses (VTransposeLayout::load_addr / store_addr from the same lane
// bases, with stage bases that are 1 KB aligned but not otherwise round), an
// emulation of ldmatrix.x4.trans and stmatrix.x4 (the PTX ISA's fragment
// layouts, below) and the same byte permutes (transpose_pairs). Then:
// - every byte of the V^T stage is written exactly once, with the byte of V
//   at (physical key vt_key(kappa), d), and nothing outside it is written
//   (nor the unused tail of a partly used last atom);
// - the PV GEMM's view of the stage (k-step kk of 32 keys at atom kk / 4,
//   byte (kk % 4) * 32 of a K-major 128B-swizzled [D rows][128 bytes] atom,
//   mainloop.cuh KMajorStep) finds each (row d, kappa) where the stores put it;
// - every load reads inside the V stage, and the address forms equal
//   src_offset / dst_offset of the key, head-dim byte and V^T row they stand
//   for;
// - each 8x8 matrix of every ldmatrix / stmatrix instruction has 16-byte
//   aligned rows in 8 distinct 16-byte bank groups: one shared-memory
//   wavefront per matrix, four per x4 instruction (512 bytes), the minimum.
#include <cstdio>
#include <cstring>
#include <set>
#include <vector>

#include "sm90/fwd/v_transpose.h"

using namespace jax_flash::sm90;

static int failures = 0;
#define CHECK(cond, ...)                                 \
  do {                                                   \
    if (!(cond)) {                                       \
      if (failures++ < 10) {                             \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);                        \
        std::printf("\n");                               \
      }                                                  \
    }                                                    \
  } while (0)

// __byte_perm on the host.
static uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((v >> (8 * ((s >> (4 * i)) & 7))) & 0xFF) << (8 * i);
  return r;
}

static uint16_t load16(const std::vector<uint8_t>& m, uint32_t a) { return uint16_t(m[a] | (m[a + 1] << 8)); }

// One x4 instruction's addresses (lane 8 i + r: row r of matrix i): 16-byte
// aligned rows, each matrix's 8 rows in distinct 16-byte bank groups.
static void check_banks(const uint32_t (&addr)[32], const char* what, int D, int N, int warps, int s) {
  for (int i = 0; i < 4; ++i) {
    std::set<uint32_t> groups;
    for (int r = 0; r < 8; ++r) {
      const uint32_t a = addr[8 * i + r];
      CHECK(a % 16 == 0, "D=%d N=%d warps=%d step %d %s: row address %u not 16-byte aligned", D, N, warps, s, what,
            a);
      groups.insert(a / 16 % 8);
    }
    CHECK(groups.size() == 8, "D=%d N=%d warps=%d step %d %s matrix %d: %zu bank groups (wavefronts > 1)", D, N,
          warps, s, what, i, groups.size());
  }
}

template <int D, int N>
static void check(int warps) {
  using L = VTransposeLayout<D, N>;
  static_assert(L::kVtStageBytes % 1024 == 0 && L::kStageBytes % 1024 == 0, "stages 1 KB aligned");
  // Shared memory: [V stage at kSrc][V^T stage at kDst], both 1 KB aligned.
  const uint32_t kSrc = 3 * 1024, kDst = kSrc + L::kStageBytes + 5 * 1024;
  std::vector<uint8_t> mem(kDst + L::kVtStageBytes + 1024);
  std::vector<int> writes(mem.size());
  auto value = [](int k, int d, int plane) { return uint8_t(plane ? (k * 7 + d) : (k + 131 * d)); };
  for (int plane = 0; plane < 2; ++plane) {  // a byte pattern per plane; together they identify (k, d)
    std::fill(mem.begin(), mem.end(), 0);
    std::fill(writes.begin(), writes.end(), 0);
    for (int k = 0; k < L::kBlockN; ++k)
      for (int d = 0; d < D; ++d) mem[kSrc + L::src_offset(k, d)] = value(k, d, plane);
    for (int w = 0; w < warps; ++w) {
      for (int s = L::first_step(w, warps); s < L::first_step(w + 1, warps); ++s) {
        const int c = L::chunk(s), g = L::group(s);
        // ldmatrix.x4.trans: lane 8 i + r gives the address of row r of
        // matrix i; lane t receives in register i column t / 4 of matrix i,
        // rows 2 (t % 4) (low 16 bits) and 2 (t % 4) + 1 (high 16 bits).
        uint32_t la[32], reg[32][4];
        for (int l = 0; l < 32; ++l) {
          la[l] = L::load_addr(kSrc, L::src_lane(l), s);
          CHECK(la[l] == kSrc + L::src_offset(32 * g + l, 16 * c), "D=%d N=%d step %d lane %d: load address", D, N, s, l);
          CHECK(la[l] >= kSrc && la[l] + 16 <= kSrc + L::kStageBytes, "D=%d N=%d step %d lane %d: load outside V",
                D, N, s, l);
        }
        check_banks(la, "ldmatrix", D, N, warps, s);
        for (int t = 0; t < 32; ++t)
          for (int i = 0; i < 4; ++i) {
            const uint32_t lo = load16(mem, la[8 * i + 2 * (t % 4)] + 2 * (t / 4));
            const uint32_t hi = load16(mem, la[8 * i + 2 * (t % 4) + 1] + 2 * (t / 4));
            reg[t][i] = lo | (hi << 16);
          }
        // stmatrix.x4: register j of lane t is row t / 4 of matrix j,
        // 16-bit columns 2 (t % 4), 2 (t % 4) + 1; lane 8 j + r gives the
        // address of row r of matrix j.
        uint32_t sa[32];
        for (int l = 0; l < 32; ++l) {
          sa[l] = L::store_addr(kDst, L::dst_lane(l), s);
          CHECK(sa[l] == kDst + L::dst_offset(16 * c + L::dst_row(l), 16 * (2 * g + l / 16)),
                "D=%d N=%d step %d lane %d: store address", D, N, s, l);
        }
        check_banks(sa, "stmatrix", D, N, warps, s);
        for (int l = 0; l < 32; ++l)
          CHECK(sa[l] >= kDst && sa[l] + 16 <= kDst + L::kVtStageBytes, "D=%d N=%d step %d lane %d: store outside V^T",
                D, N, s, l);
        for (int t = 0; t < 32; ++t) {
          uint32_t out[4];
          transpose_pairs(reg[t], out, L::sel(t), byte_perm);
          for (int j = 0; j < 4; ++j) {
            const uint32_t a = sa[8 * j + t / 4] + 4 * (t % 4);
            std::memcpy(&mem[a], &out[j], 4);
            for (int b = 0; b < 4; ++b) ++writes[a + b];
          }
        }
      }
    }
    for (int d = 0; d < D; ++d)
      for (int kappa = 0; kappa < L::kBlockN; ++kappa) {
        const uint32_t a = kDst + L::dst_offset(d, kappa);
        CHECK(writes[a] == 1, "D=%d N=%d warps=%d (d=%d, kappa=%d) written %d times", D, N, warps, d, kappa,
              writes[a]);
        CHECK(mem[a] == value(L::vt_key(kappa), d, plane), "D=%d N=%d warps=%d (d=%d, kappa=%d): %d, want %d", D,
              N, warps, d, kappa, mem[a], value(L::vt_key(kappa), d, plane));
        // The wgmma view: k-step kk = kappa / 32 starts at atom kk / 4, byte
        // (kk % 4) * 32; the 128B swizzle XORs address bits 4..6 with 7..9
        // (of the 1 KB aligned stage).
        const int kk = kappa / 32;
        const uint32_t start = uint32_t((kk / 4) * D * 128 + (kk % 4) * 32);
        const uint32_t lin = start + uint32_t(d * 128 + kappa % 32);
        const uint32_t sw = lin ^ (((lin >> 7) & 7u) << 4);
        CHECK(kDst + sw == a, "D=%d N=%d (d=%d, kappa=%d): the PV GEMM reads %u, the stores wrote %u", D, N, d,
              kappa, kDst + sw, a);
      }
    int total = 0;
    for (size_t a = 0; a < writes.size(); ++a) total += writes[a];
    CHECK(total == N * D, "D=%d N=%d warps=%d: %d bytes written, want %d (writes outside V^T)", D, N, warps, total,
          N * D);
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

// Every KV tile of kBlockN keys the FP8 policy may take (multiples of 32 up
// to 256) at head dims 64, 128 and 256.
template <int N>
static void check_n(int warps) {
  check<64, N>(warps);
  check<128, N>(warps);
  check<256, N>(warps);
}

int main() {
  for (int warps : {1, 3, 4}) {
    check_n<64>(warps);
    check_n<96>(warps);
    check_n<128>(warps);
    check_n<160>(warps);
    check_n<192>(warps);
    check_n<224>(warps);
    check_n<256>(warps);
  }
  std::printf("%s: FP8 V transpose (D = 64, 128, 256; kBlockN = 64 .. 256 in steps of 32; 1, 3, 4 warps)\n",
              failures ? "FAIL" : "ok");
  return failures ? 1 : 0;
}
