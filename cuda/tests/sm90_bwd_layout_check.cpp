// CPU-only check of the sm90 backward's shared-memory index math (no GPU, no
// nvcc): the kernel's own address / descriptor functions (BwdKeySplit /
// BwdColumnSplit ds_offset, pds_offset, BwdPairSplit t_offset, *_desc_*, the column split's dropout
// keep-word exchange, BwdDqAccumulator offsets,
// BwdEpilogue::kv_offset, the k-step functors, the smem
// plan, the masks and the tile scheduler) are compiled by g++ and checked
// against independent models of the hardware, written from the PTX ISA and
// CUTLASS (not from the kernel):
//   - 128B swizzle: byte address bits [4,7) ^= bits [7,10) (tiles 1 KB aligned);
//     TMA with CU_TENSOR_MAP_SWIZZLE_128B and a 128-byte inner box row writes
//     box element (r, c) at base + swz(r * 128 + c * elem_bytes);
//   - wgmma smem descriptor (CUTLASS GmmaDescriptor): start >> 4 in [0,14),
//     LBO >> 4 in [16,30), SBO >> 4 in [32,46), base offset [49,52) = 0,
//     layout [62,64) = 1 (128B swizzle). Canonical layouts (cute
//     make_gmma_desc, in 16-bit elements, T = 8 elements = 16 bytes):
//       K-major  SW128: ((8,m),(T,2k)):((8T,SBO),(1,T))  -> (mn, k) at
//                start + (mn % 8) * 128 + (mn / 8) * SBO + 2 k, then swizzled
//       MN-major SW128: ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO)) -> (k, mn) at
//                start + 2 (mn % 64) + (mn / 64) * LBO + (k % 8) * 128 + (k / 8) * SBO
//   - wgmma accumulator: d[4j + 2h + e] = D[16w + g + 8h][8j + 2t + e];
//     register A fragment: a[0] = A[16w+g][2t..2t+1], a[1] = A[16w+g+8][2t..],
//     a[2] = A[16w+g][2t+8..], a[3] = A[16w+g+8][2t+8..] (low half = lower column);
//   - stmatrix.m8n8.x4.trans: register r_i of lane l holds R_i[l/4][2(l%4) + e];
//     lane 8i + c gives the address of stored row c, which receives column c
//     of R_i (R_i[0..7][c], 8 consecutive 16-bit elements); without .trans
//     stored row c receives row c of R_i (R_i[c][0..7]);
//   - wgmma with tnspA: A read MN-major with the same canonical layout as an
//     MN-major B (m in place of n).
// Element identities (not values) flow through the models, so a wrong index
// names the element it got.
//
// Build and run (tools/build/build_sm90_bwd_tests.sh does both; CUDA = the toolkit):
//   g++ -std=c++17 -O2 -Icuda/include -Icuda -I$CUDA/include
//       cuda/tests/sm90_bwd_layout_check.cpp -o build/sm90_bwd_layout_check
//   build/sm90_bwd_layout_check       (exit code 1 on a mismatch)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

// ---- host shims for the device-only names the headers mention (only the
// integer index functions below are actually called).
#define JF_DEVICE inline
struct JfTid {
  unsigned x = 0, y = 0, z = 0;
};
static JfTid threadIdx, blockIdx, gridDim;
inline int atomicAdd(int* p, int v) { return (*p += v) - v; }
using std::max;
using std::min;
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
inline unsigned long long __cvta_generic_to_shared(const void*) { return 0; }
inline int __shfl_sync(unsigned, int v, int) { return v; }
inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
inline int __any_sync(unsigned, int p) { return p; }
inline void __syncwarp() {}
inline float __fdividef(float a, float b) { return a / b; }
// The FMA-pipe exponentials of fast_math.cuh (exp2_poly3 / exp2_poly5), as
// host code: bit casts and the round-down add.
inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; std::memcpy(&x, &i, 4); return x; }
inline float __fadd_rd(float a, float b) {
  const double exact = double(a) + double(b);
  const float r = float(exact);
  return double(r) > exact ? std::nextafter(r, -INFINITY) : r;
}

#include "sm90/bwd/bwd_epilogue.cuh"
#include "sm90/bwd/bwd_mainloop.cuh"

using namespace jax_flash;
using namespace jax_flash::sm90;

// The backward's tile order (sm90/common/tile_scheduler.cuh BwdTileOrder) in both
// directions: ascending, and descending for deterministic kernels.
struct BwdOrders {
  BwdTileOrder<false> asc;
  BwdTileOrder<true> desc;
  int total, num_n_blocks, num_heads_k, num_bh;
  template <bool kDescending = false>
  void decode(int t, int& n, int& h, int& b) const {
    const TileCoord c = kDescending ? desc.decode(t) : asc.decode(t);
    n = c.block;
    h = c.head;
    b = c.batch;
  }
};

static BwdOrders make_bwd_orders(int batch, int num_heads_k, int heads_per_kv, int seqlen_q, int seqlen_k,
                                 int head_dim, int block_n, bool causal_like) {
  const BwdTileOrderArguments a{batch, num_heads_k, heads_per_kv, seqlen_k, seqlen_q,
                                head_dim, 2, block_n, causal_like};
  BwdOrders o{BwdTileOrder<false>::make(a), BwdTileOrder<true>::make(a), 0, 0, 0, 0};
  o.total = o.asc.total;
  o.num_n_blocks = o.asc.num_blocks;
  o.num_heads_k = o.asc.num_heads;
  o.num_bh = o.asc.num_bh;
  return o;
}

static int g_fail = 0;
#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      if (g_fail < 20) {                                   \
        std::printf("  FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);                          \
        std::printf("\n");                                 \
      }                                                    \
      ++g_fail;                                            \
    }                                                      \
  } while (0)

// ---------------------------------------------------------------- models
static uint32_t swz(uint32_t addr) { return addr ^ (((addr >> 7) & 7u) << 4); }

struct Desc {
  uint32_t start, lbo, sbo;
};
static Desc decode(uint64_t d) {
  CHECK((d >> 62) == 1, "descriptor layout type %llu, want 1 (128B swizzle)", (unsigned long long)(d >> 62));
  CHECK(((d >> 49) & 7) == 0, "descriptor base offset %llu, want 0", (unsigned long long)((d >> 49) & 7));
  CHECK(((d >> 14) & 3) == 0 && ((d >> 30) & 3) == 0 && ((d >> 46) & 7) == 0 && ((d >> 52) & 0x3FF) == 0,
        "reserved descriptor bits set: %016llx", (unsigned long long)d);
  return Desc{uint32_t(d & 0x3FFF) << 4, uint32_t((d >> 16) & 0x3FFF) << 4, uint32_t((d >> 32) & 0x3FFF) << 4};
}
// Byte address of element (mn, k) (k < 16) of one k16 step.
static uint32_t kmajor_addr(uint64_t d, int mn, int k) {
  const Desc s = decode(d);
  return swz(s.start + (mn % 8) * 128 + (mn / 8) * s.sbo + 2 * k);
}
static uint32_t mnmajor_addr(uint64_t d, int k, int mn) {
  const Desc s = decode(d);
  return swz(s.start + 2 * (mn % 64) + (mn / 64) * s.lbo + (k % 8) * 128 + (k / 8) * s.sbo);
}
// The kernel's k-step: descriptor + (offset >> 4), as ptx::gemm_ss / gemm_rs do.
template <typename Step>
static uint64_t step_desc(uint64_t d0, Step step, int kk) {
  return d0 + (step(kk) >> 4);
}

// A 16-bit shared-memory image holding element ids (-1 = never written).
struct Smem16 {
  std::vector<int64_t> v;
  explicit Smem16(size_t bytes) : v(bytes / 2, -1) {}
  int64_t get(uint32_t addr) const {
    CHECK(addr % 2 == 0 && addr / 2 < v.size(), "16-bit read at %u out of the image", addr);
    return (addr % 2 == 0 && addr / 2 < v.size()) ? v[addr / 2] : -2;
  }
  void put(uint32_t addr, int64_t id, int* writes = nullptr) {
    CHECK(addr % 2 == 0 && addr / 2 < v.size(), "16-bit write at %u out of the image", addr);
    if (addr % 2 || addr / 2 >= v.size()) return;
    v[addr / 2] = id;
    if (writes) ++writes[addr / 2];
  }
};

// TMA 128B-swizzled box (rows x 64 16-bit elements) at `base` of the image.
static void tma_load_box16(Smem16& sm, uint32_t base, int rows, int64_t (*id)(int, int, int), int tag,
                           int row0, int col0) {
  CHECK(base % 1024 == 0, "TMA box base %u not 1 KB aligned", base);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < 64; ++c) sm.put(base + swz(uint32_t(r * 128 + c * 2)), id(tag, row0 + r, col0 + c));
}

static int64_t ident(int tag, int r, int c) { return (int64_t(tag) << 40) | (int64_t(r) << 20) | c; }
enum : int { kTagK = 1, kTagV, kTagQ, kTagDO, kTagDS };

// ---------------------------------------------------------------- checks
// dQ_swapAB (kBlockM 80): the dQ^T accumulator of a WG (64 columns x kDqRows
// queries: d[4j + 2h + e] = dQ^T[16w + g + 8h][8j + 2t + e]) -> the staging
// tile by BwdDqAccumulator::t_offset -> read back as the two TMA reduce boxes
// {32 cols, kDqRows rows} (128B swizzle, fp32; box b at b * kDqRows * 128):
// every element once, in place; and the 32 lanes' 4-byte stores of each
// register hit 32 distinct banks.
template <typename Cfg>
static void check_dq_staging_swapab() {
  using C = BwdKeySplit<__nv_bfloat16, Cfg, false, true>;
  using Dq = BwdDqAccumulator<Cfg, true>;
  constexpr int kRows = Cfg::kDqRows;
  static_assert(C::kQR == kRows / 2, "dQ^T fragment: 64 x kBlockM");
  std::vector<int64_t> st(Cfg::kDqWGBytes / 4, -1);
  std::vector<int> wr(st.size(), 0);
  for (int w = 0; w < 4; ++w)
    for (int j = 0; j < kRows / 8; ++j)
      for (int h = 0; h < 2; ++h)
        for (int e = 0; e < 2; ++e) {
          int banks[32] = {0};
          for (int l = 0; l < 32; ++l) {
            const uint32_t off = Dq::t_offset(w, l, j, h, e);
            CHECK(off % 4 == 0 && off + 4 <= uint32_t(Cfg::kDqWGBytes), "dQ^T staging offset %u", off);
            if (off % 4 || off + 4 > uint32_t(Cfg::kDqWGBytes)) continue;
            const int q = 8 * j + 2 * (l % 4) + e, c = 16 * w + l / 4 + 8 * h;
            st[off / 4] = ident(9, q, c);
            ++wr[off / 4];
            ++banks[(off / 4) % 32];
          }
          for (int b = 0; b < 32; ++b)
            CHECK(banks[b] == 1, "dQ^T staging store w%d j%d h%d e%d: bank %d hit %d times", w, j, h, e, b, banks[b]);
        }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 64; ++c) {
      const uint32_t a = uint32_t((c / 32) * kRows * 128) + swz(uint32_t(r * 128 + (c % 32) * 4));
      CHECK(a / 4 < st.size() && st[a / 4] == ident(9, r, c) && wr[a / 4] == 1, "dQ^T staging element (%d,%d)", r, c);
    }
  CHECK((kRows * 128) % 1024 == 0, "second dQ box not 1 KB aligned");
}

template <typename Cfg>
static void check_config() {
  using C = BwdKeySplit<__nv_bfloat16, Cfg, false, true>;
  using Dq = BwdDqAccumulator<Cfg, true>;
  using DqRows = BwdDqAccumulator<Cfg, false>;
  using Epi = BwdEpilogue<BwdMainloop<__nv_bfloat16, Cfg, false, true, false, false>>;
  constexpr int kD = Cfg::kHeadDim, kBM = Cfg::kBlockM, kBN = Cfg::kBlockN;
  std::printf("config D=%d BM=%d BN=%d%s: smem %d B (+1 KB slack)\n", kD, kBM, kBN,
              Cfg::kDqSwapAB ? " (dQ_swapAB)" : "", Cfg::kSmemBytes);
  const int fail0 = g_fail;

  // ---- smem plan: regions disjoint, in order, 1 KB aligned where swizzled
  {
    struct R {
      const char* n;
      int off, bytes;
    } rs[] = {{"K", Cfg::kOffK, Cfg::kKVBytes},
              {"V", Cfg::kOffV, Cfg::kKVBytes},
              {"Q", Cfg::kOffQ, Cfg::kStages * Cfg::kQBytes},
              {"dO", Cfg::kOffdO, Cfg::kStages * Cfg::kQBytes},
              {"dS", Cfg::kOffdS, 2 * Cfg::kDsBytes},
              {"dQ", Cfg::kOffdQ, Cfg::kConsumerWGs * Cfg::kDqWGBytes},
              {"LSE", Cfg::kOffLse, Cfg::kStages * Cfg::kStatBytes},
              {"delta", Cfg::kOffDelta, Cfg::kStages * Cfg::kStatBytes},
              {"bars", Cfg::kOffBar, 8 * Cfg::kNumBars}};
    for (size_t i = 0; i + 1 < sizeof(rs) / sizeof(rs[0]); ++i)
      CHECK(rs[i].off + rs[i].bytes <= rs[i + 1].off, "%s overlaps %s", rs[i].n, rs[i + 1].n);
    CHECK(Cfg::kOffBar + 8 * Cfg::kNumBars <= Cfg::kSmemBytes, "barriers past the plan");
    CHECK(Cfg::kSmemAlloc <= 227 * 1024, "plan > 227 KB");
    CHECK(Cfg::kDqWGBytes >= 2 * Cfg::kDqRows * 128 && (Cfg::kDqSwapAB || Cfg::kDqWGBytes >= 64 * Cfg::kDqPitch * 4),
          "dQ staging tile too small");
  }

  Smem16 sm(Cfg::kOffdQ);  // the 16-bit part of the plan
  // K, V: TMA boxes {64, kBN}; Q, dO stage 0: boxes {64, kBM}
  for (int cb = 0; cb < kD / 64; ++cb) {
    tma_load_box16(sm, Cfg::kOffK + cb * kBN * 128, kBN, ident, kTagK, 0, 64 * cb);
    tma_load_box16(sm, Cfg::kOffV + cb * kBN * 128, kBN, ident, kTagV, 0, 64 * cb);
    tma_load_box16(sm, Cfg::kOffQ + cb * kBM * 128, kBM, ident, kTagQ, 0, 64 * cb);
    tma_load_box16(sm, Cfg::kOffdO + cb * kBM * 128, kBM, ident, kTagDO, 0, 64 * cb);
  }

  for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg) {
    // ---- S^T = K_wg Q^T (and dP^T = V_wg dO^T): A (m = key, k = d), B K-major (n = query, k = d)
    for (int kk = 0; kk < kD / 16; ++kk)
      for (int k = 0; k < 16; ++k) {
        const uint64_t da = step_desc(C::sdp_desc_a(wg, Cfg::kOffK), typename C::SdpStepA{}, kk);
        const uint64_t dav = step_desc(C::sdp_desc_a(wg, Cfg::kOffV), typename C::SdpStepA{}, kk);
        for (int m = 0; m < 64; ++m) {
          CHECK(sm.get(kmajor_addr(da, m, k)) == ident(kTagK, 64 * wg + m, 16 * kk + k),
                "S^T A wg%d kk%d (m%d,k%d)", wg, kk, m, k);
          CHECK(sm.get(kmajor_addr(dav, m, k)) == ident(kTagV, 64 * wg + m, 16 * kk + k),
                "dP^T A wg%d kk%d (m%d,k%d)", wg, kk, m, k);
        }
        const uint64_t db = step_desc(C::sdp_desc_b(Cfg::kOffQ), typename C::SdpStepB{}, kk);
        const uint64_t dbo = step_desc(C::sdp_desc_b(Cfg::kOffdO), typename C::SdpStepB{}, kk);
        for (int n = 0; n < kBM; ++n) {
          CHECK(sm.get(kmajor_addr(db, n, k)) == ident(kTagQ, n, 16 * kk + k), "S^T B kk%d (n%d,k%d)", kk, n, k);
          CHECK(sm.get(kmajor_addr(dbo, n, k)) == ident(kTagDO, n, 16 * kk + k), "dP^T B kk%d (n%d,k%d)", kk, n, k);
        }
      }
    // ---- dV += P^T dO, dK += dS^T Q: B MN-major (k = query, n = d)
    for (int kk = 0; kk < kBM / 16; ++kk) {
      const uint64_t dq = step_desc(C::dkv_desc_b(Cfg::kOffQ), typename C::DkvStepB{}, kk);
      const uint64_t ddo = step_desc(C::dkv_desc_b(Cfg::kOffdO), typename C::DkvStepB{}, kk);
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < kD; ++n) {
          CHECK(sm.get(mnmajor_addr(dq, k, n)) == ident(kTagQ, 16 * kk + k, n), "dK B kk%d (k%d,n%d)", kk, k, n);
          CHECK(sm.get(mnmajor_addr(ddo, k, n)) == ident(kTagDO, 16 * kk + k, n), "dV B kk%d (k%d,n%d)", kk, k, n);
        }
    }
    // ---- dQ B = K MN-major (k = key, n = d within the WG's column block);
    // dQ_swapAB (kBlockM 80): the same descriptor is A of dQ^T = K^T dS^T,
    // read with tnspA (m = d), which has the MN-major B's canonical layout.
    for (int kk = 0; kk < kBN / 16; ++kk) {
      const uint64_t d = step_desc(C::dq_desc_b(wg, Cfg::kOffK), typename C::DqStepB{}, kk);
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < Cfg::kDqCols; ++n)
          CHECK(sm.get(mnmajor_addr(d, k, n)) == ident(kTagK, 16 * kk + k, 64 * C::dq_wg_n(wg) + n),
                "dQ B wg%d kk%d (k%d,n%d)", wg, kk, k, n);
    }
  }

  // ---- dS^T accumulator -> A fragments (acc_to_a pairing) -> stmatrix.trans
  // into the dS buffer -> read back as the dQ GEMM's A (K-major, m = query,
  // k = key) and as the RS A fragment of dK += dS^T Q.
  {
    const uint32_t ds_base = Cfg::kOffdS;  // buffer 0
    std::vector<int> writes(sm.v.size(), 0);
    for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg)
      for (int w = 0; w < 4; ++w) {
        // regs[lane][k][i][half] = element id, from the accumulator layout and
        // the kernel's acc_to_a pairing a[k][i] = (d[8k + 2i], d[8k + 2i + 1]).
        std::vector<int64_t> regs(32 * (kBM / 16) * 4 * 2);
        auto R = [&](int l, int k, int i, int hf) -> int64_t& { return regs[((l * (kBM / 16) + k) * 4 + i) * 2 + hf]; };
        for (int l = 0; l < 32; ++l) {
          const int g = l / 4, t = l % 4;
          for (int k = 0; k < kBM / 16; ++k)
            for (int i = 0; i < 4; ++i)
              for (int hf = 0; hf < 2; ++hf) {
                const int idx = 8 * k + 2 * i + hf;  // accumulator register index
                const int j = idx / 4, h = (idx / 2) % 2, e = idx % 2;
                const int key = 64 * wg + 16 * w + g + 8 * h, q = 8 * j + 2 * t + e;
                R(l, k, i, hf) = ident(kTagDS, q, key);  // dS[q][key]
              }
          // RS A fragment of dK += dS^T Q, k-step k: A(m = key, kq = query)
          for (int k = 0; k < kBM / 16; ++k)
            for (int i = 0; i < 4; ++i)
              for (int hf = 0; hf < 2; ++hf) {
                const int m = 16 * w + g + 8 * (i % 2), kq = 2 * t + 8 * (i / 2) + hf;
                CHECK(R(l, k, i, hf) == ident(kTagDS, 16 * k + kq, 64 * wg + m), "RS A fragment wg%d w%d l%d k%d i%d",
                      wg, w, l, k, i);
              }
        }
        // stmatrix.trans, fragment k: matrix i = register i; lane 8i + c gives
        // the row address of stored row c = column c of R_i.
        for (int k = 0; k < kBM / 16; ++k)
          for (int i = 0; i < 4; ++i)
            for (int c = 0; c < 8; ++c) {
              const uint32_t row_addr = ds_base + C::ds_offset(wg, w, 8 * i + c, k);
              CHECK(row_addr % 16 == 0, "stmatrix row address %u not 16-byte aligned", row_addr);
              for (int r = 0; r < 8; ++r) {
                // R_i[r][c] is in lane 4r + c/2, half c%2
                sm.put(row_addr + 2 * r, R(4 * r + c / 2, k, i, c % 2), writes.data());
              }
            }
      }
    for (uint32_t b = ds_base; b < ds_base + Cfg::kDsBytes; b += 2)
      CHECK(writes[b / 2] == 1, "dS buffer element at %u written %d times", b, writes[b / 2]);
    // dQ A (m = query, k = key, 64 rows of WG wg's row half); dQ_swapAB:
    // the B operand of dQ^T (n = query: all kBlockM rows, both WGs).
    for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg)
      for (int kk = 0; kk < kBN / 16; ++kk) {
        const uint64_t d = step_desc(C::dq_desc_a(wg, ds_base), typename C::DqStepA{}, kk);
        for (int m = 0; m < Cfg::kDqRows; ++m)
          for (int k = 0; k < 16; ++k)
            CHECK(sm.get(kmajor_addr(d, m, k)) == ident(kTagDS, 64 * C::dq_wg_m(wg) + m, 16 * kk + k),
                  "dQ A (dS) wg%d kk%d (m%d,k%d): got %llx", wg, kk, m, k,
                  (unsigned long long)sm.get(kmajor_addr(d, m, k)));
      }
  }

  // ---- dQ accumulator (64 x 64 fp32 per WG) -> staging tile -> reads of the
  // two TMA reduce boxes {32 cols, 64 rows} (128B swizzle, fp32) / the rows.
  if constexpr (Cfg::kDqSwapAB) {
    check_dq_staging_swapab<Cfg>();
  } else {
  for (int variant = 0; variant < 2; ++variant) {
    std::vector<int64_t> st(Cfg::kDqWGBytes / 4, -1);
    std::vector<int> wr(st.size(), 0);
    for (int w = 0; w < 4; ++w)
      for (int l = 0; l < 32; ++l)
        for (int j = 0; j < Cfg::kDqCols / 8; ++j)
          for (int h = 0; h < 2; ++h) {
            const uint32_t off = variant == 0 ? Dq::offset(w, l, j, h) : DqRows::offset(w, l, j, h);
            CHECK(off % 8 == 0 && off + 8 <= uint32_t(Cfg::kDqWGBytes), "dQ staging offset %u", off);
            if (off % 8 || off + 8 > uint32_t(Cfg::kDqWGBytes)) continue;
            for (int e = 0; e < 2; ++e) {
              const int r = 16 * w + l / 4 + 8 * h, c = 8 * j + 2 * (l % 4) + e;
              st[off / 4 + e] = ident(9, r, c);
              ++wr[off / 4 + e];
            }
          }
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < 64; ++c) {
        uint32_t a;
        if (variant == 0) {
          const int b = c / 32;  // box b: smem base + b * 64 * 128 (1 KB aligned)
          a = uint32_t(b * 64 * 128) + swz(uint32_t(r * 128 + (c % 32) * 4));
        } else {
          a = uint32_t((r * Cfg::kDqPitch + c) * 4);
        }
        CHECK(st[a / 4] == ident(9, r, c) && wr[a / 4] == 1, "dQ staging (%s) element (%d,%d)",
              variant == 0 ? "tensor" : "rows", r, c);
      }
  }
  }

  // ---- dK / dV accumulator -> 16-bit tile rows [64 wg, +64) -> TMA store
  // boxes {64, 64} at tile + cb * kBN * 128 + 64 wg * 128.
  {
    Smem16 t(Cfg::kKVBytes);
    std::vector<int> wr(t.v.size(), 0);
    for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg)
      for (int w = 0; w < 4; ++w)
        for (int l = 0; l < 32; ++l)
          for (int j = 0; j < kD / 8; ++j)
            for (int h = 0; h < 2; ++h) {
              const uint32_t off = Epi::kv_offset(wg, w, l, j, h);
              CHECK(off % 4 == 0, "dK/dV pair offset %u not 4-byte aligned", off);
              for (int e = 0; e < 2; ++e)
                t.put(off + 2 * e, ident(7, 64 * wg + 16 * w + l / 4 + 8 * h, 8 * j + 2 * (l % 4) + e), wr.data());
            }
    for (size_t i = 0; i < wr.size(); ++i) CHECK(wr[i] == 1, "dK/dV tile element %zu written %d times", i, wr[i]);
    for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg)
      for (int cb = 0; cb < kD / 64; ++cb) {
        const uint32_t base = uint32_t(cb * kBN * 128 + 64 * wg * 128);
        CHECK(base % 1024 == 0, "TMA store box base %u", base);
        for (int r = 0; r < 64; ++r)
          for (int c = 0; c < 64; ++c)
            CHECK(t.get(base + swz(uint32_t(r * 128 + 2 * c))) == ident(7, 64 * wg + r, 64 * cb + c),
                  "dK/dV store box wg%d cb%d (%d,%d)", wg, cb, r, c);
      }
  }
  std::printf("  layouts: %s\n", g_fail == fail0 ? "ok" : "FAILED");
}

// ---------------------------------------------------------------- dropout, hdim 256
// The column split's keep mask (bwd_column_split.cuh draw_dropout / step):
// each consumer thread (wg, warp, lane) draws one generator call (row
// drop_row, the block's 64-key chunk), packs it (pack_keep) into its word
// (drop_word); after the exchange every thread reads its pair (drop_pair)
// and takes accumulator element i = 4m + 2h + e (the accumulator model:
// query r0 + 8h, key 32 wg + 8m + 2t + e, the WG's keys of S = Q K_wg^T) at
// keep_bit(m, e) of word h shifted by 4 wg. Checked bit for bit against the
// reference form Dropout::keep(batch, head, row, col) at several blocks,
// thresholds, origins and the broadcast mask; the words must lie in the
// plan's buffer, one per (thread, WG), past the barriers.
static void check_dropout_hd256() {
  using Cfg = BwdDropoutConfig<BwdConfigFor<256>::type>;
  using C = BwdColumnSplit<__nv_bfloat16, Cfg, false, true>;
  const int fail0 = g_fail;
  CHECK(Cfg::kOffDrop >= Cfg::kOffBar + 8 * Cfg::kNumBars, "dropout words overlap the barriers");
  CHECK(Cfg::kOffDrop + Cfg::kDropBytes == Cfg::kSmemBytes && Cfg::kSmemAlloc <= 227 * 1024,
        "dropout plan: %d + %d B, alloc %d", Cfg::kOffDrop, Cfg::kDropBytes, Cfg::kSmemAlloc);
  std::printf("config D=256 with dropout: smem %d B (+1 KB slack), %d B of keep words\n", Cfg::kSmemBytes,
              Cfg::kDropBytes);
  const BwdKernelArgs args{};
  const BwdSmem<Cfg> sm{0};
  const uint32_t words[6] = {0x9E3779B9u, 0x243F6A88u, 3u, 5u, 77u, 192u};
  struct Draw {
    uint32_t threshold;
    bool broadcast;
    int batch, head, n_block, m0;
  } draws[] = {{26, false, 0, 0, 0, 0}, {128, false, 1, 3, 2, 64}, {230, false, 3, 1, 5, 320},
               {1, false, 0, 2, 1, 128}, {128, true, 2, 7, 3, 192}};
  for (const Draw& dr : draws) {
    DropoutArgs da{words, dr.threshold, dr.broadcast};
    const Dropout d(da);
    const int n0 = 64 * dr.n_block;
    std::vector<uint32_t> smem(Cfg::kSmemAlloc / 4, 0xDEADBEEFu);
    std::vector<int> writes(Cfg::kSmemAlloc / 4, 0);
    for (int wg = 0; wg < 2; ++wg)  // draw_dropout: one call and one word per thread
      for (int warp = 0; warp < 4; ++warp)
        for (int lane = 0; lane < 32; ++lane) {
          const C c{args, sm, wg, warp, lane};
          const int row = C::drop_row(dr.m0, wg, warp, lane);
          const uint32_t a = c.drop_word();
          CHECK(a % 4 == 0 && a >= uint32_t(Cfg::kOffDrop) && a + 4 <= uint32_t(Cfg::kOffDrop + Cfg::kDropBytes),
                "keep word of wg%d warp%d lane%d at %u outside the buffer", wg, warp, lane, a);
          if (a % 4 || a / 4 >= smem.size()) continue;
          smem[a / 4] = C::pack_keep(d.keep_bits(dr.batch, dr.head, row, uint32_t(n0) / 64u, lane % 4));
          ++writes[a / 4];
        }
    for (int x : writes) CHECK(x <= 1, "two threads write one keep word");
    for (int wg = 0; wg < 2; ++wg)  // step: the pair, element by element
      for (int warp = 0; warp < 4; ++warp)
        for (int lane = 0; lane < 32; ++lane) {
          const C c{args, sm, wg, warp, lane};
          const uint32_t a = c.drop_pair();
          CHECK(a % 8 == 0, "pair address %u not 8-byte aligned (ld.shared.v2)", a);
          if (a / 4 + 1 >= smem.size()) continue;
          const uint32_t pair[2] = {smem[a / 4], smem[a / 4 + 1]};
          for (int i = 0; i < C::kSR; ++i) {
            const int m = i / 4, h = (i / 2) % 2, e = i % 2;
            const int row = dr.m0 + 16 * warp + lane / 4 + 8 * h;
            const int col = n0 + 32 * wg + 8 * m + 2 * (lane % 4) + e;
            const bool got = ((pair[h] >> (4 * wg)) >> C::keep_bit(m, e)) & 1u;
            const bool want = d.keep(dr.batch, dr.head, row, col);
            CHECK(got == want, "dropout t%u: wg%d warp%d lane%d element %d (row %d, col %d): %d, want %d",
                  dr.threshold, wg, warp, lane, i, row, col, got, want);
          }
        }
  }
  std::printf("  dropout keep bits (column split): %s\n", g_fail == fail0 ? "ok" : "FAILED");
}

// ---------------------------------------------------------------- hdim 256
// The column split (!kSdpSwapAB, bwd_column_split.cuh): S / dP over key halves,
// P / dS through [query][key] tiles, dK / dV / dQ over column halves.
template <typename Cfg>
static void check_config_hd256() {
  using C = BwdColumnSplit<__nv_bfloat16, Cfg, false, true>;
  using Epi = BwdEpilogue<BwdMainloop<__nv_bfloat16, Cfg, false, true, false, false>>;
  constexpr int kD = Cfg::kHeadDim, kBM = Cfg::kBlockM, kBN = Cfg::kBlockN;
  constexpr int kWN = C::kWN, kWD = C::kWD;
  std::printf("config D=%d BM=%d BN=%d (split over keys / columns, dO stages %d): smem %d B (+1 KB slack)\n", kD,
              kBM, kBN, Cfg::kStagesDo, Cfg::kSmemBytes);
  const int fail0 = g_fail;
  {
    struct R {
      const char* n;
      int off, bytes;
    } rs[] = {{"K", Cfg::kOffK, Cfg::kKVBytes},
              {"V", Cfg::kOffV, Cfg::kKVBytes},
              {"Q", Cfg::kOffQ, Cfg::kStages * Cfg::kQBytes},
              {"dO", Cfg::kOffdO, Cfg::kStagesDo * Cfg::kQBytes},
              {"dS", Cfg::kOffdS, 2 * Cfg::kDsBytes},
              {"P", Cfg::kOffP, 2 * Cfg::kDsBytes},
              {"dQ", Cfg::kOffdQ, Cfg::kConsumerWGs * Cfg::kDqWGBytes},
              {"LSE", Cfg::kOffLse, Cfg::kStages * Cfg::kStatBytes},
              {"delta", Cfg::kOffDelta, Cfg::kStagesDo * Cfg::kStatBytes},
              {"bars", Cfg::kOffBar, 8 * Cfg::kNumBars}};
    for (size_t i = 0; i + 1 < sizeof(rs) / sizeof(rs[0]); ++i)
      CHECK(rs[i].off + rs[i].bytes <= rs[i + 1].off, "%s overlaps %s", rs[i].n, rs[i + 1].n);
    CHECK(Cfg::kOffBar + 8 * Cfg::kNumBars <= Cfg::kSmemBytes, "barriers past the plan");
    CHECK(Cfg::kSmemAlloc <= 227 * 1024, "plan > 227 KB");
    CHECK(Cfg::kOffP % 1024 == 0 && Cfg::kDsBytes % 1024 == 0, "P tiles not 1 KB aligned");
    // mbarrier indices distinct and inside the plan
    std::vector<int> used(Cfg::kNumBars, 0);
    BwdSmem<Cfg> sm{0};
    auto mark = [&](uint32_t a) {
      const int i = int((a - Cfg::kOffBar) / 8);
      CHECK(a >= uint32_t(Cfg::kOffBar) && i < Cfg::kNumBars, "mbarrier %u outside the plan", a);
      if (i >= 0 && i < Cfg::kNumBars) ++used[i];
    };
    mark(sm.full_kv());
    for (int st = 0; st < Cfg::kStages; ++st) {
      mark(sm.full_q(st));
      mark(sm.empty_q(st));
    }
    for (int st = 0; st < Cfg::kStagesDo; ++st) {
      mark(sm.full_do(st));
      mark(sm.empty_do(st));
    }
    for (int x : used) CHECK(x == 1, "mbarrier used %d times", x);
  }

  Smem16 sm(Cfg::kOffdQ);  // the 16-bit part of the plan
  for (int cb = 0; cb < kD / 64; ++cb) {
    tma_load_box16(sm, Cfg::kOffK + cb * kBN * 128, kBN, ident, kTagK, 0, 64 * cb);
    tma_load_box16(sm, Cfg::kOffV + cb * kBN * 128, kBN, ident, kTagV, 0, 64 * cb);
    tma_load_box16(sm, Cfg::kOffQ + cb * kBM * 128, kBM, ident, kTagQ, 0, 64 * cb);
    tma_load_box16(sm, Cfg::kOffdO + cb * kBM * 128, kBM, ident, kTagDO, 0, 64 * cb);
  }

  for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg) {
    // ---- S = Q K_wg^T (dP = dO V_wg^T): A K-major (m = query, k = d), B K-major (n = key of the WG, k = d)
    for (int kk = 0; kk < kD / 16; ++kk)
      for (int k = 0; k < 16; ++k) {
        const uint64_t da = step_desc(C::sdp_desc_a(Cfg::kOffQ), typename C::SdpStepA{}, kk);
        const uint64_t dao = step_desc(C::sdp_desc_a(Cfg::kOffdO), typename C::SdpStepA{}, kk);
        for (int m = 0; m < kBM; ++m) {
          CHECK(sm.get(kmajor_addr(da, m, k)) == ident(kTagQ, m, 16 * kk + k), "S A kk%d (m%d,k%d)", kk, m, k);
          CHECK(sm.get(kmajor_addr(dao, m, k)) == ident(kTagDO, m, 16 * kk + k), "dP A kk%d (m%d,k%d)", kk, m, k);
        }
        const uint64_t db = step_desc(C::sdp_desc_b(wg, Cfg::kOffK), typename C::SdpStepB{}, kk);
        const uint64_t dbv = step_desc(C::sdp_desc_b(wg, Cfg::kOffV), typename C::SdpStepB{}, kk);
        for (int n = 0; n < kWN; ++n) {
          CHECK(sm.get(kmajor_addr(db, n, k)) == ident(kTagK, kWN * wg + n, 16 * kk + k), "S B wg%d kk%d (n%d,k%d)",
                wg, kk, n, k);
          CHECK(sm.get(kmajor_addr(dbv, n, k)) == ident(kTagV, kWN * wg + n, 16 * kk + k),
                "dP B wg%d kk%d (n%d,k%d)", wg, kk, n, k);
        }
      }
    // ---- dV += P^T dO, dK += dS^T Q: B MN-major (k = query, n = column 128 wg + n)
    for (int kk = 0; kk < kBM / 16; ++kk) {
      const uint64_t dq = step_desc(C::dkv_desc_b(wg, Cfg::kOffQ), typename C::DkvStepB{}, kk);
      const uint64_t ddo = step_desc(C::dkv_desc_b(wg, Cfg::kOffdO), typename C::DkvStepB{}, kk);
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < kWD; ++n) {
          CHECK(sm.get(mnmajor_addr(dq, k, n)) == ident(kTagQ, 16 * kk + k, kWD * wg + n), "dK B wg%d kk%d (k%d,n%d)",
                wg, kk, k, n);
          CHECK(sm.get(mnmajor_addr(ddo, k, n)) == ident(kTagDO, 16 * kk + k, kWD * wg + n),
                "dV B wg%d kk%d (k%d,n%d)", wg, kk, k, n);
        }
    }
    // ---- dQ slice sl: B = K MN-major (k = key, n = column 128 wg + 64 sl + n)
    for (int sl = 0; sl < Cfg::kDqSlices; ++sl)
      for (int kk = 0; kk < kBN / 16; ++kk) {
        const uint64_t d = step_desc(C::dq_desc_b(wg, sl, Cfg::kOffK), typename C::DqStepB{}, kk);
        for (int k = 0; k < 16; ++k)
          for (int n = 0; n < Cfg::kDqCols; ++n)
            CHECK(sm.get(mnmajor_addr(d, k, n)) == ident(kTagK, 16 * kk + k, kWD * wg + Cfg::kDqCols * sl + n),
                  "dQ B wg%d sl%d kk%d (k%d,n%d)", wg, sl, kk, k, n);
      }
  }

  // ---- P / dS accumulator (64 queries x 32 keys per WG) -> A-fragment
  // packing -> stmatrix (not transposed) into the [query][key] tile -> read
  // back as dV's / dK's A (MN-major, m = key, k = query) and dQ's A (K-major,
  // m = query, k = key).
  {
    const uint32_t base = Cfg::kOffdS;  // dS buffer 0 (the P buffers have the same layout)
    std::vector<int> writes(sm.v.size(), 0);
    for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg)
      for (int w = 0; w < 4; ++w) {
        constexpr int kPK = C::kPK;
        std::vector<int64_t> regs(32 * kPK * 4 * 2);
        auto R = [&](int l, int k, int i, int hf) -> int64_t& { return regs[((l * kPK + k) * 4 + i) * 2 + hf]; };
        for (int l = 0; l < 32; ++l) {
          const int g = l / 4, t = l % 4;
          for (int k = 0; k < kPK; ++k)
            for (int i = 0; i < 4; ++i)
              for (int hf = 0; hf < 2; ++hf) {
                const int idx = 8 * k + 2 * i + hf;  // accumulator register (acc_to_a pairing)
                const int j = idx / 4, h = (idx / 2) % 2, e = idx % 2;
                const int q = 16 * w + g + 8 * h, key = kWN * wg + 8 * j + 2 * t + e;
                R(l, k, i, hf) = ident(kTagDS, q, key);
              }
        }
        // stmatrix: matrix i = register i; lane 8i + c gives the address of
        // stored row c, which receives row c of R_i (lanes 4c..4c+3).
        for (int k = 0; k < kPK; ++k)
          for (int i = 0; i < 4; ++i)
            for (int c = 0; c < 8; ++c) {
              const uint32_t row_addr = base + C::pds_offset(wg, w, 8 * i + c, k);
              CHECK(row_addr % 16 == 0, "stmatrix row address %u not 16-byte aligned", row_addr);
              for (int col = 0; col < 8; ++col)
                sm.put(row_addr + 2 * col, R(4 * c + col / 2, k, i, col % 2), writes.data());
            }
      }
    for (uint32_t b = base; b < base + Cfg::kDsBytes; b += 2)
      CHECK(writes[b / 2] == 1, "dS tile element at %u written %d times", b, writes[b / 2]);
    for (int kk = 0; kk < kBM / 16; ++kk) {
      const uint64_t d = step_desc(C::dkv_desc_a(base), typename C::DkvStepA{}, kk);
      for (int k = 0; k < 16; ++k)
        for (int m = 0; m < kBN; ++m)
          CHECK(sm.get(mnmajor_addr(d, k, m)) == ident(kTagDS, 16 * kk + k, m), "dK/dV A (P^T / dS^T) kk%d (m%d,k%d)",
                kk, m, k);
    }
    for (int kk = 0; kk < kBN / 16; ++kk) {
      const uint64_t d = step_desc(C::dq_desc_a(base), typename C::DqStepA{}, kk);
      for (int m = 0; m < kBM; ++m)
        for (int k = 0; k < 16; ++k)
          CHECK(sm.get(kmajor_addr(d, m, k)) == ident(kTagDS, m, 16 * kk + k), "dQ A (dS) kk%d (m%d,k%d)", kk, m, k);
    }
  }

  // ---- dQ staging: the same function and tile as the other buckets (pitch
  // without padding here): every element once, read back by the boxes / rows.
  for (int variant = 0; variant < 2; ++variant) {
    std::vector<int64_t> st(Cfg::kDqWGBytes / 4, -1);
    std::vector<int> wr(st.size(), 0);
    for (int w = 0; w < 4; ++w)
      for (int l = 0; l < 32; ++l)
        for (int j = 0; j < Cfg::kDqCols / 8; ++j)
          for (int h = 0; h < 2; ++h) {
            const uint32_t off = variant == 0 ? BwdDqAccumulator<Cfg, true>::offset(w, l, j, h)
                                              : BwdDqAccumulator<Cfg, false>::offset(w, l, j, h);
            CHECK(off % 8 == 0 && off + 8 <= uint32_t(Cfg::kDqWGBytes), "dQ staging offset %u", off);
            if (off % 8 || off + 8 > uint32_t(Cfg::kDqWGBytes)) continue;
            for (int e = 0; e < 2; ++e) {
              st[off / 4 + e] = ident(9, 16 * w + l / 4 + 8 * h, 8 * j + 2 * (l % 4) + e);
              ++wr[off / 4 + e];
            }
          }
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < 64; ++c) {
        const uint32_t a = variant == 0 ? uint32_t((c / 32) * 64 * 128) + swz(uint32_t(r * 128 + (c % 32) * 4))
                                        : uint32_t((r * Cfg::kDqPitch + c) * 4);
        CHECK(st[a / 4] == ident(9, r, c) && wr[a / 4] == 1, "dQ staging (%s) element (%d,%d)",
              variant == 0 ? "tensor" : "rows", r, c);
      }
  }

  // ---- dK / dV accumulator (64 keys x columns [128 wg, +128)) -> the tile ->
  // TMA store boxes {64, 64} at tile + c * kBN * 128 (column block c).
  {
    Smem16 t(Cfg::kKVBytes);
    std::vector<int> wr(t.v.size(), 0);
    for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg)
      for (int w = 0; w < 4; ++w)
        for (int l = 0; l < 32; ++l)
          for (int j = 0; j < kWD / 8; ++j)
            for (int h = 0; h < 2; ++h) {
              const uint32_t off = Epi::kv_offset(wg, w, l, j, h);
              CHECK(off % 4 == 0, "dK/dV pair offset %u not 4-byte aligned", off);
              for (int e = 0; e < 2; ++e)
                t.put(off + 2 * e, ident(7, 16 * w + l / 4 + 8 * h, kWD * wg + 8 * j + 2 * (l % 4) + e), wr.data());
            }
    for (size_t i = 0; i < wr.size(); ++i) CHECK(wr[i] == 1, "dK/dV tile element %zu written %d times", i, wr[i]);
    for (int c = 0; c < kD / 64; ++c) {
      const uint32_t base = uint32_t(c * kBN * 128);
      CHECK(base % 1024 == 0, "TMA store box base %u", base);
      for (int r = 0; r < kBN; ++r)
        for (int cc = 0; cc < 64; ++cc)
          CHECK(t.get(base + swz(uint32_t(r * 128 + 2 * cc))) == ident(7, r, 64 * c + cc), "dK/dV store box c%d (%d,%d)",
                c, r, cc);
    }
  }
  std::printf("  layouts: %s\n", g_fail == fail0 ? "ok" : "FAILED");
}

// ---------------------------------------------------------------- head-dim pair
// The pair 192 / 128 (Cfg::kPair, the column split on 64 x 64): the plan with
// V / dO stages of their own, S over 192 and dP over 128 columns, and the
// per-WG column blocks of dK, dV, dQ (every column of each made by exactly
// one WG, read from the right column of Q / dO / K), the epilogue's dK / dV
// blocks through the tiles to the TMA store boxes. The P / dS tiles and the
// dQ staging are the hdim-256 config's functions on the same 64 x 64 shape
// (checked there).
template <typename Cfg>
static void check_config_pair() {
  using C = BwdColumnSplit<__nv_bfloat16, Cfg, false, true>;
  using Epi = BwdEpilogue<BwdMainloop<__nv_bfloat16, Cfg, false, true, false, false>>;
  constexpr int kD = Cfg::kHeadDim, kDv = Cfg::kHeadDimV, kBM = Cfg::kBlockM, kBN = Cfg::kBlockN;
  constexpr int kWN = C::kWN;
  static_assert(Cfg::kPair && kBM == 64 && kBN == 64, "the pair's tile");
  std::printf("config D=%d D_v=%d BM=%d BN=%d (column split, per-WG column blocks, dO stages %d): smem %d B "
              "(+1 KB slack)\n",
              kD, kDv, kBM, kBN, Cfg::kStagesDo, Cfg::kSmemBytes);
  const int fail0 = g_fail;
  {
    struct R {
      const char* n;
      int off, bytes;
    } rs[] = {{"K", Cfg::kOffK, Cfg::kKVBytes},
              {"V", Cfg::kOffV, Cfg::kVBytes},
              {"Q", Cfg::kOffQ, Cfg::kStages * Cfg::kQBytes},
              {"dO", Cfg::kOffdO, Cfg::kStagesDo * Cfg::kDoBytes},
              {"dS", Cfg::kOffdS, 2 * Cfg::kDsBytes},
              {"P", Cfg::kOffP, 2 * Cfg::kDsBytes},
              {"dQ", Cfg::kOffdQ, Cfg::kConsumerWGs * Cfg::kDqWGBytes},
              {"LSE", Cfg::kOffLse, Cfg::kStages * Cfg::kStatBytes},
              {"delta", Cfg::kOffDelta, Cfg::kStagesDo * Cfg::kStatBytes},
              {"bars", Cfg::kOffBar, 8 * Cfg::kNumBars}};
    for (size_t i = 0; i + 1 < sizeof(rs) / sizeof(rs[0]); ++i)
      CHECK(rs[i].off + rs[i].bytes <= rs[i + 1].off, "%s overlaps %s", rs[i].n, rs[i + 1].n);
    CHECK(Cfg::kKVBytes == kBN * kD * 2 && Cfg::kVBytes == kBN * kDv * 2 && Cfg::kQBytes == kBM * kD * 2 &&
              Cfg::kDoBytes == kBM * kDv * 2,
          "tile sizes");
    CHECK(Cfg::kSmemAlloc <= 227 * 1024, "plan > 227 KB");
    BwdSmem<Cfg> sm{0};
    for (int st = 0; st < Cfg::kStagesDo; ++st)
      CHECK(sm.dout(st) == uint32_t(Cfg::kOffdO + st * Cfg::kDoBytes) && sm.dout(st) % 1024 == 0, "dO stage %d", st);
  }

  Smem16 sm(Cfg::kOffdS);  // K, V, Q stage 0, dO stage 0
  for (int cb = 0; cb < kD / 64; ++cb) {
    tma_load_box16(sm, Cfg::kOffK + cb * kBN * 128, kBN, ident, kTagK, 0, 64 * cb);
    tma_load_box16(sm, Cfg::kOffQ + cb * kBM * 128, kBM, ident, kTagQ, 0, 64 * cb);
  }
  for (int cb = 0; cb < kDv / 64; ++cb) {
    tma_load_box16(sm, Cfg::kOffV + cb * kBN * 128, kBN, ident, kTagV, 0, 64 * cb);
    tma_load_box16(sm, Cfg::kOffdO + cb * kBM * 128, kBM, ident, kTagDO, 0, 64 * cb);
  }
  std::vector<int> dk_cols(kD, 0), dv_cols(kDv, 0), dq_cols(kD, 0);
  for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg) {
    // ---- S = Q K_wg^T over kD, dP = dO V_wg^T over kDv
    for (int pass = 0; pass < 2; ++pass) {
      const int depth = pass == 0 ? kD : kDv;
      const int ta = pass == 0 ? kTagQ : kTagDO, tb = pass == 0 ? kTagK : kTagV;
      const int oa = pass == 0 ? Cfg::kOffQ : Cfg::kOffdO, ob = pass == 0 ? Cfg::kOffK : Cfg::kOffV;
      for (int kk = 0; kk < depth / 16; ++kk)
        for (int k = 0; k < 16; ++k) {
          const uint64_t da = step_desc(C::sdp_desc_a(oa), typename C::SdpStepA{}, kk);
          for (int m = 0; m < kBM; ++m)
            CHECK(sm.get(kmajor_addr(da, m, k)) == ident(ta, m, 16 * kk + k), "%s A kk%d (m%d,k%d)",
                  pass ? "dP" : "S", kk, m, k);
          const uint64_t db = step_desc(C::sdp_desc_b(wg, ob), typename C::SdpStepB{}, kk);
          for (int n = 0; n < kWN; ++n)
            CHECK(sm.get(kmajor_addr(db, n, k)) == ident(tb, kWN * wg + n, 16 * kk + k), "%s B wg%d kk%d (n%d,k%d)",
                  pass ? "dP" : "S", wg, kk, n, k);
        }
    }
    // ---- dV block dv_block(wg) (N = 64) from dO; dK blocks [dk_block0, +dk_blocks) from Q
    const int vb = C::dv_block(wg), kb0 = C::dk_block0(wg), kbs = C::dk_blocks(wg);
    for (int kk = 0; kk < kBM / 16; ++kk) {
      const uint64_t ddo = step_desc(C::dkv_desc_b_block(vb, Cfg::kOffdO), typename C::DkvStepB{}, kk);
      const uint64_t dq = step_desc(C::dkv_desc_b_block(kb0, Cfg::kOffQ), typename C::DkvStepB{}, kk);
      for (int k = 0; k < 16; ++k) {
        for (int n = 0; n < 64; ++n)
          CHECK(sm.get(mnmajor_addr(ddo, k, n)) == ident(kTagDO, 16 * kk + k, 64 * vb + n), "dV B wg%d kk%d (k%d,n%d)",
                wg, kk, k, n);
        for (int n = 0; n < 64 * kbs; ++n)
          CHECK(sm.get(mnmajor_addr(dq, k, n)) == ident(kTagQ, 16 * kk + k, 64 * kb0 + n), "dK B wg%d kk%d (k%d,n%d)",
                wg, kk, k, n);
      }
    }
    for (int n = 0; n < 64; ++n) ++dv_cols[64 * vb + n];
    for (int n = 0; n < 64 * kbs; ++n) ++dk_cols[64 * kb0 + n];
    CHECK(64 * kbs / 2 <= C::kKR && 32 <= C::kVR, "dK / dV registers wg%d", wg);
    // ---- dQ slices: B = K MN-major at Cfg::dq_col0(wg, sl)
    for (int sl = 0; sl < Cfg::dq_slices(wg); ++sl) {
      const int c0 = Cfg::dq_col0(wg, sl);
      for (int kk = 0; kk < kBN / 16; ++kk) {
        const uint64_t d = step_desc(C::dq_desc_b(wg, sl, Cfg::kOffK), typename C::DqStepB{}, kk);
        for (int k = 0; k < 16; ++k)
          for (int n = 0; n < Cfg::kDqCols; ++n)
            CHECK(sm.get(mnmajor_addr(d, k, n)) == ident(kTagK, 16 * kk + k, c0 + n), "dQ B wg%d sl%d kk%d (k%d,n%d)",
                  wg, sl, kk, k, n);
      }
      for (int n = 0; n < Cfg::kDqCols; ++n) ++dq_cols[c0 + n];
    }
  }
  for (int c = 0; c < kD; ++c) CHECK(dk_cols[c] == 1 && dq_cols[c] == 1, "column %d: dK by %d WGs, dQ by %d", c,
                                     dk_cols[c], dq_cols[c]);
  for (int c = 0; c < kDv; ++c) CHECK(dv_cols[c] == 1, "dV column %d made by %d WGs", c, dv_cols[c]);
  // Balance: 4 column-block GEMMs per WG and step.
  for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg)
    CHECK(C::dk_blocks(wg) + 1 + Cfg::dq_slices(wg) == 4, "wg%d: GEMMs per step", wg);

  // ---- dK / dV accumulators (every key; the WG's blocks) -> the K / V tiles
  // (store_kv_blocks' offsets) -> TMA store boxes {64, 64} per column block.
  for (int tensor = 0; tensor < 2; ++tensor) {
    const int cols = tensor == 0 ? kD : kDv;
    Smem16 t(kBN * cols * 2);
    std::vector<int> wr(t.v.size(), 0);
    for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg) {
      const int cb0 = tensor == 0 ? C::dk_block0(wg) : C::dv_block(wg);
      const int blocks = tensor == 0 ? C::dk_blocks(wg) : 1;
      for (int w = 0; w < 4; ++w)
        for (int l = 0; l < 32; ++l)
          for (int j = 0; j < 8 * blocks; ++j)
            for (int h = 0; h < 2; ++h) {
              const uint32_t off = Epi::kv_offset_at(0, cb0, w, l, j, h);
              CHECK(off % 4 == 0 && off + 4 <= uint32_t(kBN * cols * 2), "dK/dV pair offset %u", off);
              if (off % 4 || off + 4 > uint32_t(kBN * cols * 2)) continue;
              for (int e = 0; e < 2; ++e)
                t.put(off + 2 * e, ident(7, 16 * w + l / 4 + 8 * h, 64 * cb0 + 8 * j + 2 * (l % 4) + e), wr.data());
            }
    }
    for (size_t i = 0; i < wr.size(); ++i)
      CHECK(wr[i] == 1, "%s tile element %zu written %d times", tensor ? "dV" : "dK", i, wr[i]);
    for (int c = 0; c < cols / 64; ++c)
      for (int r = 0; r < kBN; ++r)
        for (int cc = 0; cc < 64; ++cc)
          CHECK(t.get(uint32_t(c * kBN * 128) + swz(uint32_t(r * 128 + 2 * cc))) == ident(7, r, 64 * c + cc),
                "%s store box c%d (%d,%d)", tensor ? "dV" : "dK", c, r, cc);
  }
  std::printf("  layouts: %s\n", g_fail == fail0 ? "ok" : "FAILED");
}

// The pair 192 / 128 on 64 x 96 (Cfg::kDkvSwapAB, bwd_pair_split.cuh): the
// plan; S / dP over each WG's 48 keys (rows 48 wg of K / V); P^T / dS^T
// accumulators (64 queries x the WG's 48 keys) -> A-fragment packing ->
// stmatrix.trans into the [key][query] tiles (every element once, no bank
// conflicts) -> read back as dV^T's / dK^T's B (K-major, n = the WG's keys,
// k = query) and dQ's A (MN-major, m = query, k = key); dV^T's / dK^T's A
// (dO / Q column block cb read MN-major); dQ's B (K MN-major at
// Cfg::dq_col0) with every dQ column made by one WG; the epilogue's dK^T /
// dV^T blocks packed and written back transposed by the same stmatrix.trans
// into the K / V tiles, read by each WG's TMA store boxes {64, 48}.
template <typename Cfg>
static void check_config_pair_swapped() {
  using C = BwdPairSplit<__nv_bfloat16, Cfg, false, true>;
  using Epi = BwdEpilogue<BwdMainloop<__nv_bfloat16, Cfg, false, true, false, false>>;
  constexpr int kD = Cfg::kHeadDim, kDv = Cfg::kHeadDimV, kBM = Cfg::kBlockM, kBN = Cfg::kBlockN;
  constexpr int kWN = C::kWN;
  static_assert(Cfg::kPair && Cfg::kDkvSwapAB && kBM == 64 && kBN == 96, "the pair's 64 x 96 tile");
  static_assert(std::is_same_v<typename BwdMainloop<__nv_bfloat16, Cfg, false, true, false, false>::Split, C>,
                "the mainloop runs the pair split");
  std::printf("config D=%d D_v=%d BM=%d BN=%d (dKV_swapAB, 48 keys per WG, dO stages %d): smem %d B "
              "(+1 KB slack)\n",
              kD, kDv, kBM, kBN, Cfg::kStagesDo, Cfg::kSmemBytes);
  const int fail0 = g_fail;
  {
    struct R {
      const char* n;
      int off, bytes;
    } rs[] = {{"K", Cfg::kOffK, Cfg::kKVBytes},
              {"V", Cfg::kOffV, Cfg::kVBytes},
              {"Q", Cfg::kOffQ, Cfg::kStages * Cfg::kQBytes},
              {"dO", Cfg::kOffdO, Cfg::kStagesDo * Cfg::kDoBytes},
              {"dS^T", Cfg::kOffdS, 2 * Cfg::kDsBytes},
              {"P^T", Cfg::kOffP, 2 * Cfg::kDsBytes},
              {"dQ", Cfg::kOffdQ, Cfg::kConsumerWGs * Cfg::kDqWGBytes},
              {"LSE", Cfg::kOffLse, Cfg::kStages * Cfg::kStatBytes},
              {"delta", Cfg::kOffDelta, Cfg::kStagesDo * Cfg::kStatBytes},
              {"bars", Cfg::kOffBar, 8 * Cfg::kNumBars}};
    for (size_t i = 0; i + 1 < sizeof(rs) / sizeof(rs[0]); ++i)
      CHECK(rs[i].off + rs[i].bytes <= rs[i + 1].off, "%s overlaps %s", rs[i].n, rs[i + 1].n);
    CHECK(Cfg::kKVBytes == kBN * kD * 2 && Cfg::kVBytes == kBN * kDv * 2 && Cfg::kQBytes == kBM * kD * 2 &&
              Cfg::kDoBytes == kBM * kDv * 2 && Cfg::kDsBytes == kBN * 128,
          "tile sizes");
    CHECK(Cfg::kSmemAlloc <= 227 * 1024, "plan > 227 KB");
    CHECK(Cfg::kOffP % 1024 == 0 && Cfg::kOffdS % 1024 == 0 && Cfg::kDsBytes % 1024 == 0,
          "P^T / dS^T tiles not 1 KB aligned");
    CHECK(Epi::kStoreRows == kWN, "dK / dV store boxes of %d rows, want the WG's %d keys", Epi::kStoreRows, kWN);
  }

  Smem16 sm(Cfg::kOffdQ);  // the 16-bit part of the plan
  for (int cb = 0; cb < kD / 64; ++cb) {
    tma_load_box16(sm, Cfg::kOffK + cb * kBN * 128, kBN, ident, kTagK, 0, 64 * cb);
    tma_load_box16(sm, Cfg::kOffQ + cb * kBM * 128, kBM, ident, kTagQ, 0, 64 * cb);
  }
  for (int cb = 0; cb < kDv / 64; ++cb) {
    tma_load_box16(sm, Cfg::kOffV + cb * kBN * 128, kBN, ident, kTagV, 0, 64 * cb);
    tma_load_box16(sm, Cfg::kOffdO + cb * kBM * 128, kBM, ident, kTagDO, 0, 64 * cb);
  }
  std::vector<int> keys(kBN, 0), dq_cols(kD, 0);
  for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg) {
    // ---- S = Q K_wg^T over kD, dP = dO V_wg^T over kDv
    for (int pass = 0; pass < 2; ++pass) {
      const int depth = pass == 0 ? kD : kDv;
      const int ta = pass == 0 ? kTagQ : kTagDO, tb = pass == 0 ? kTagK : kTagV;
      const int oa = pass == 0 ? Cfg::kOffQ : Cfg::kOffdO, ob = pass == 0 ? Cfg::kOffK : Cfg::kOffV;
      for (int kk = 0; kk < depth / 16; ++kk)
        for (int k = 0; k < 16; ++k) {
          const uint64_t da = step_desc(C::sdp_desc_a(oa), typename C::SdpStepA{}, kk);
          for (int m = 0; m < kBM; ++m)
            CHECK(sm.get(kmajor_addr(da, m, k)) == ident(ta, m, 16 * kk + k), "%s A kk%d (m%d,k%d)",
                  pass ? "dP" : "S", kk, m, k);
          const uint64_t db = step_desc(C::sdp_desc_b(wg, ob), typename C::SdpStepB{}, kk);
          for (int n = 0; n < kWN; ++n)
            CHECK(sm.get(kmajor_addr(db, n, k)) == ident(tb, kWN * wg + n, 16 * kk + k), "%s B wg%d kk%d (n%d,k%d)",
                  pass ? "dP" : "S", wg, kk, n, k);
        }
    }
    for (int n = 0; n < kWN; ++n) ++keys[kWN * wg + n];
    // ---- dV^T / dK^T column block cb: A = dO / Q MN-major (k = query, m = column 64 cb + m)
    for (int pass = 0; pass < 2; ++pass) {
      const int blocks = pass == 0 ? C::kVB : C::kKB, tag = pass == 0 ? kTagDO : kTagQ;
      const int tile = pass == 0 ? Cfg::kOffdO : Cfg::kOffQ;
      for (int cb = 0; cb < blocks; ++cb)
        for (int kk = 0; kk < kBM / 16; ++kk) {
          const uint64_t d = step_desc(C::dkv_desc_a(cb, tile), typename C::DkvStepA{}, kk);
          for (int k = 0; k < 16; ++k)
            for (int m = 0; m < 64; ++m)
              CHECK(sm.get(mnmajor_addr(d, k, m)) == ident(tag, 16 * kk + k, 64 * cb + m),
                    "%s A cb%d kk%d (k%d,m%d)", pass ? "dK^T" : "dV^T", cb, kk, k, m);
        }
    }
    // ---- dQ slices: B = K MN-major (k = key, n = column Cfg::dq_col0(wg, sl) + n), K = 96 keys
    for (int sl = 0; sl < Cfg::dq_slices(wg); ++sl) {
      const int c0 = Cfg::dq_col0(wg, sl);
      for (int kk = 0; kk < kBN / 16; ++kk) {
        const uint64_t d = step_desc(C::dq_desc_b(wg, sl, Cfg::kOffK), typename C::DqStepB{}, kk);
        for (int k = 0; k < 16; ++k)
          for (int n = 0; n < Cfg::kDqCols; ++n)
            CHECK(sm.get(mnmajor_addr(d, k, n)) == ident(kTagK, 16 * kk + k, c0 + n), "dQ B wg%d sl%d kk%d (k%d,n%d)",
                  wg, sl, kk, k, n);
      }
      for (int n = 0; n < Cfg::kDqCols; ++n) ++dq_cols[c0 + n];
    }
  }
  for (int n = 0; n < kBN; ++n) CHECK(keys[n] == 1, "key %d owned by %d WGs", n, keys[n]);
  for (int c = 0; c < kD; ++c) CHECK(dq_cols[c] == 1, "dQ column %d made by %d WGs", c, dq_cols[c]);

  // A WG's 64 x 48 accumulator (rows x its keys), packed as acc_to_a, through
  // stmatrix.trans at C::t_offset into a [key][64] tile at `base`: stored
  // row c of matrix i receives column c of R_i, R_i[r][c] being lane
  // 4 r + c / 2's half c % 2. id(row, key) names each element.
  auto store_t = [&](Smem16& img, uint32_t base, int wg, int64_t (*id)(int, int, int), int tag, int row_off,
                     std::vector<int>& writes) {
    constexpr int kPK = C::kPK;
    for (int w = 0; w < 4; ++w) {
      std::vector<int64_t> regs(32 * kPK * 4 * 2);
      auto R = [&](int l, int k, int i, int hf) -> int64_t& { return regs[((l * kPK + k) * 4 + i) * 2 + hf]; };
      for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        for (int k = 0; k < kPK; ++k)
          for (int i = 0; i < 4; ++i)
            for (int hf = 0; hf < 2; ++hf) {
              const int idx = 8 * k + 2 * i + hf;  // accumulator register (acc_to_a pairing)
              const int j = idx / 4, h = (idx / 2) % 2, e = idx % 2;
              R(l, k, i, hf) = id(tag, row_off + 16 * w + g + 8 * h, kWN * wg + 8 * j + 2 * t + e);
            }
      }
      for (int k = 0; k < kPK; ++k)
        for (int i = 0; i < 4; ++i) {
          int chunks = 0;
          for (int c = 0; c < 8; ++c) {
            const uint32_t row_addr = base + C::t_offset(wg, w, 8 * i + c, k);
            CHECK(row_addr % 16 == 0, "stmatrix.trans row address %u not 16-byte aligned", row_addr);
            chunks |= 1 << ((row_addr / 16) % 8);
            for (int r = 0; r < 8; ++r) img.put(row_addr + 2 * r, R(4 * r + c / 2, k, i, c % 2), writes.data());
          }
          CHECK(chunks == 0xFF, "stmatrix.trans wg%d warp%d k%d matrix %d: bank conflicts", wg, w, k, i);
        }
    }
  };
  // ---- P^T / dS^T: element (query, key) at [key][query]
  {
    const uint32_t base = Cfg::kOffdS;  // dS^T buffer 0 (the P^T buffers have the same layout)
    std::vector<int> writes(sm.v.size(), 0);
    for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg) store_t(sm, base, wg, ident, kTagDS, 0, writes);
    for (uint32_t b = base; b < base + Cfg::kDsBytes; b += 2)
      CHECK(writes[b / 2] == 1, "dS^T tile element at %u written %d times", b, writes[b / 2]);
    for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg)
      for (int kk = 0; kk < kBM / 16; ++kk) {
        const uint64_t d = step_desc(C::dkv_desc_b(wg, base), typename C::DkvStepB{}, kk);
        for (int n = 0; n < kWN; ++n)
          for (int k = 0; k < 16; ++k)
            CHECK(sm.get(kmajor_addr(d, n, k)) == ident(kTagDS, 16 * kk + k, kWN * wg + n),
                  "dK^T / dV^T B (dS^T / P^T) wg%d kk%d (n%d,k%d)", wg, kk, n, k);
      }
    for (int kk = 0; kk < kBN / 16; ++kk) {
      const uint64_t d = step_desc(C::dq_desc_a(base), typename C::DqStepA{}, kk);
      for (int k = 0; k < 16; ++k)
        for (int m = 0; m < kBM; ++m)
          CHECK(sm.get(mnmajor_addr(d, k, m)) == ident(kTagDS, m, 16 * kk + k), "dQ A (dS) kk%d (k%d,m%d)", kk, k, m);
    }
  }
  // ---- dK^T / dV^T blocks (rows = columns 64 cb + r, the WG's keys) -> the
  // K / V tiles (block cb at cb * kBN * 128) -> the WG's TMA store boxes
  // {64 columns, 48 keys} at tile + cb * kBN * 128 + 48 wg * 128.
  for (int tensor = 0; tensor < 2; ++tensor) {
    const int blocks = tensor == 0 ? C::kKB : C::kVB;
    Smem16 t(kBN * blocks * 128);
    std::vector<int> wr(t.v.size(), 0);
    for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg)
      for (int cb = 0; cb < blocks; ++cb) store_t(t, uint32_t(cb * kBN * 128), wg, ident, 7, 64 * cb, wr);
    for (size_t i = 0; i < wr.size(); ++i)
      CHECK(wr[i] == 1, "%s tile element %zu written %d times", tensor ? "dV" : "dK", i, wr[i]);
    for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg)
      for (int cb = 0; cb < blocks; ++cb) {
        const uint32_t box = uint32_t(cb * kBN * 128 + kWN * wg * 128);
        CHECK(box % 1024 == 0, "TMA store box base %u not 1 KB aligned", box);
        for (int r = 0; r < kWN; ++r)
          for (int cc = 0; cc < 64; ++cc)
            CHECK(t.get(box + swz(uint32_t(r * 128 + 2 * cc))) == ident(7, 64 * cb + cc, kWN * wg + r),
                  "%s store box wg%d cb%d (%d,%d)", tensor ? "dV" : "dK", wg, cb, r, cc);
      }
  }
  std::printf("  layouts: %s\n", g_fail == fail0 ? "ok" : "FAILED");
}

// ---------------------------------------------------------------- masks
static bool visible_ref(const MaskInfo& mi, int i, int k, const int* qs, const int* ks) {
  if (k >= mi.seqlen_k) return false;
  const int off = mi.seqlen_k - mi.seqlen_q;
  if (mi.wl >= 0 && k < i + off - mi.wl) return false;
  if (mi.wr >= 0 && k > i + off + mi.wr) return false;
  if (qs && qs[i] != ks[k]) return false;
  return true;
}

template <int kBM, int kSegUnroll = 0>
static void check_masks() {
  const int fail0 = g_fail;
  std::mt19937 rng(7);
  int cases = 0;
  const int lens[] = {1, 5, 37, 53, 64, 65, 79, 80, 81, 127, 128, 129, 160, 161, 200, 300, 517};
  const int wins[] = {-1, 0, 1, 3, 7, 20, 64, 100, 150};
  for (int T : lens)
    for (int S : lens)
      for (int wl : wins)
        for (int wr : wins) {
          if ((rng() % 4) != 0) continue;  // a random quarter of the grid
          for (int seg = 0; seg < 2; ++seg) {
            ++cases;
            std::vector<int> qs(T), ks(S);
            if (seg) {
              for (int& x : qs) x = 0;
              int id = 0;
              for (int i = 0; i < T; ++i) qs[i] = (id += (rng() % 9 == 0)) % 3;
              id = 0;
              for (int i = 0; i < S; ++i) ks[i] = (id += (rng() % 9 == 0)) % 3;
            }
            MaskInfo mi{};
            mi.seqlen_q = T;
            mi.seqlen_k = S;
            mi.off = S - T;
            mi.wl = wl;
            mi.wr = wr;
            mi.q_seg = seg ? qs.data() : nullptr;
            mi.kv_seg = seg ? ks.data() : nullptr;
            const int nb = (S + 127) / 128;
            for (int n = 0; n < nb; ++n) {
              int first, last;
              mi.BlockMath::q_block_range(n * 128, 128, kBM, first, last);
              // every query block with a visible pair in this KV block is in range
              for (int i = 0; i < T; ++i)
                for (int k = n * 128; k < std::min(S, n * 128 + 128); ++k)
                  if (visible_ref(mi, i, k, nullptr, nullptr) && !(i / kBM >= first && i / kBM < last)) {
                    CHECK(false, "q_block_range T=%d S=%d wl=%d wr=%d n=%d: row %d key %d outside [%d,%d)", T, S, wl, wr,
                          n, i, k, first, last);
                    i = T;
                    break;
                  }
              for (int mb = first; mb < last; ++mb)
                for (int wg = 0; wg < 2; ++wg) {
                  const int m0 = mb * kBM, n0 = n * 128 + 64 * wg;
                  const bool needs = mi.block_needs_mask_by_position(m0, kBM, n0, 64);
                  for (int w = 0; w < 4; ++w)
                    for (int l = 0; l < 32; ++l) {
                      float s[kBM / 2];
                      for (float& x : s) x = 1.f;
                      const int key0 = n0 + 16 * w + l / 4, q0 = m0 + 2 * (l % 4);
                      if (needs) apply_mask_t<false, kSegUnroll>(s, mi, 0, key0, q0, false);
                      for (int j = 0; j < kBM / 8; ++j)
                        for (int h = 0; h < 2; ++h)
                          for (int e = 0; e < 2; ++e) {
                            const int key = key0 + 8 * h, q = q0 + 8 * j + e;
                            if (q >= T) continue;  // P = 0 through the staged LSE (+inf)
                            const bool vis = visible_ref(mi, q, key, seg ? qs.data() : nullptr, ks.data());
                            const bool kept = s[4 * j + 2 * h + e] != -INFINITY;
                            CHECK(vis == kept, "mask T=%d S=%d wl=%d wr=%d seg=%d key %d query %d: visible %d kept %d (needs %d)",
                                  T, S, wl, wr, seg, key, q, vis, kept, needs);
                          }
                    }
                }
            }
          }
        }
  std::printf("masks (kBlockM %d, segment bits unrolled %d, %d cases): %s\n", kBM, kSegUnroll, cases,
              g_fail == fail0 ? "ok" : "FAILED");
}

// The hdim-256 consumer masks S (queries x keys) with the forward's
// apply_mask: warpgroup wg holds keys [n0 + 32 wg, +32) of a 64-key block.
static void check_masks_hd256() {
  constexpr int kBM = 64, kBN = 64, kWN = 32;
  const int fail0 = g_fail;
  std::mt19937 rng(11);
  int cases = 0;
  const int lens[] = {1, 5, 37, 53, 63, 64, 65, 127, 128, 129, 200, 300};
  const int wins[] = {-1, 0, 1, 3, 7, 20, 64, 100};
  for (int T : lens)
    for (int S : lens)
      for (int wl : wins)
        for (int wr : wins) {
          if ((rng() % 4) != 0) continue;
          for (int seg = 0; seg < 2; ++seg) {
            ++cases;
            std::vector<int> qs(T), ks(S);
            if (seg) {
              int id = 0;
              for (int i = 0; i < T; ++i) qs[i] = (id += (rng() % 9 == 0)) % 3;
              id = 0;
              for (int i = 0; i < S; ++i) ks[i] = (id += (rng() % 9 == 0)) % 3;
            }
            MaskInfo mi{};
            mi.seqlen_q = T;
            mi.seqlen_k = S;
            mi.off = S - T;
            mi.wl = wl;
            mi.wr = wr;
            mi.q_seg = seg ? qs.data() : nullptr;
            mi.kv_seg = seg ? ks.data() : nullptr;
            const int nb = (S + kBN - 1) / kBN;
            for (int n = 0; n < nb; ++n) {
              int first, last;
              mi.BlockMath::q_block_range(n * kBN, kBN, kBM, first, last);
              for (int i = 0; i < T; ++i)
                for (int k = n * kBN; k < std::min(S, n * kBN + kBN); ++k)
                  if (visible_ref(mi, i, k, nullptr, nullptr) && !(i / kBM >= first && i / kBM < last)) {
                    CHECK(false, "q_block_range(64) T=%d S=%d wl=%d wr=%d n=%d: row %d key %d outside [%d,%d)", T, S,
                          wl, wr, n, i, k, first, last);
                    i = T;
                    break;
                  }
              for (int mb = first; mb < last; ++mb)
                for (int wg = 0; wg < 2; ++wg) {
                  const int m0 = mb * kBM, n0 = n * kBN + kWN * wg;
                  const bool needs = mi.block_needs_mask_by_position(m0, kBM, n0, kWN);
                  for (int w = 0; w < 4; ++w)
                    for (int l = 0; l < 32; ++l) {
                      float s[kWN / 2];
                      for (float& x : s) x = 1.f;
                      const int row0 = m0 + 16 * w + l / 4, key0 = n0 + 2 * (l % 4);
                      if (needs) apply_mask<false>(s, mi, 0, row0, key0, false);
                      for (int j = 0; j < kWN / 8; ++j)
                        for (int h = 0; h < 2; ++h)
                          for (int e = 0; e < 2; ++e) {
                            const int q = row0 + 8 * h, key = key0 + 8 * j + e;
                            if (q >= T) continue;  // P = 0 through the staged LSE (+inf)
                            const bool vis = visible_ref(mi, q, key, seg ? qs.data() : nullptr, ks.data());
                            const bool kept = s[4 * j + 2 * h + e] != -INFINITY;
                            CHECK(vis == kept, "mask(256) T=%d S=%d wl=%d wr=%d seg=%d key %d query %d: visible %d kept %d",
                                  T, S, wl, wr, seg, key, q, vis, kept);
                          }
                    }
                }
            }
          }
        }
  std::printf("masks (hdim 256: 64 x 64 blocks, S per key half, %d cases): %s\n", cases,
              g_fail == fail0 ? "ok" : "FAILED");
}

static void check_scheduler() {
  const int fail0 = g_fail;
  for (int batch : {1, 2, 3})
    for (int hk : {1, 2, 5})
      for (int group : {1, 4})
        for (int sq : {1, 300, 8192, 100000})
          for (int sk : {1, 130, 8192})
            for (int causal = 0; causal < 4; ++causal) {  // 2, 3: hdim 256 (64-key blocks)
              const int d = causal < 2 ? 128 : 256, bn = causal < 2 ? 128 : 64;
              const BwdOrders s = make_bwd_orders(batch, hk, group, sq, sk, d, bn, causal % 2);
              for (int rev = 0; rev < 2; ++rev) {  // decode<true>: the deterministic order
              std::vector<int> seen(size_t(s.total), 0);
              for (int t = 0; t < s.total; ++t) {
                int n, h, b;
                if (rev)
                  s.decode<true>(t, n, h, b);
                else
                  s.decode(t, n, h, b);
                const bool ok = n >= 0 && n < s.num_n_blocks && h >= 0 && h < hk && b >= 0 && b < batch;
                CHECK(ok, "scheduler tile %d -> (%d,%d,%d)", t, n, h, b);
                if (ok) ++seen[(size_t(b) * hk + h) * s.num_n_blocks + n];
              }
              for (int x : seen) CHECK(x == 1, "scheduler: a tile decoded %d times", x);
              }
            }
  std::printf("tile scheduler: %s\n", g_fail == fail0 ? "ok" : "FAILED");
}

// Deterministic mode (BwdDqAccumulator::store kDet, BwdTileOrder<true>,
// dq_pred_range): for every query block m the KV blocks that add into it
// form an interval; block n waits for n + 1 exactly when n + 1 adds too; the
// tile it waits for has a smaller tile index (decode<true>). Then a model of
// the protocol: P SMs take tiles in claim order, each CTA's dQ writes in
// sweep order (q head of the group, query block) wait for their
// predecessor's write; random interleavings must finish (no deadlock) with
// every dQ tile written in descending KV-block order. The same model with
// the ascending (non-deterministic) tile order must deadlock for a small P
// (shows the model catches a wrong order).
static bool simulate_det(const MaskInfo& mi, const BwdOrders& s, int group, int bn, int bm, int sms,
                         bool reverse, std::mt19937& rng, bool* order_ok) {
  const int M = (mi.seqlen_q + bm - 1) / bm, N = s.num_n_blocks;
  const int heads = s.num_heads_k * group, batch = s.num_bh / s.num_heads_k;
  std::vector<int> sem(size_t(batch) * heads * M, 0), last_n(sem.size(), INT32_MAX);
  struct Cta {
    int n, hk, b, step, iters, mf, ml, pf, pl;
  };
  std::vector<Cta> live;
  int next = 0;
  *order_ok = true;
  auto claim = [&] {
    Cta c{};
    if (reverse)
      s.decode<true>(next, c.n, c.hk, c.b);
    else
      s.decode<false>(next, c.n, c.hk, c.b);
    ++next;
    mi.BlockMath::q_block_range(c.n * bn, bn, bm, c.mf, c.ml);
    c.iters = (c.ml - c.mf) * group;
    c.step = 0;
    dq_pred_range(mi, c.n, N, bn, bm, c.pf, c.pl);
    live.push_back(c);
  };
  while (next < s.total && int(live.size()) < sms) claim();
  while (!live.empty()) {
    // CTAs that can make progress: finished, or their next write's predecessor is done.
    std::vector<int> ready;
    for (int i = 0; i < int(live.size()); ++i) {
      const Cta& c = live[i];
      if (c.step == c.iters) {
        ready.push_back(i);
        continue;
      }
      const int hq = c.hk * group + c.step / (c.ml - c.mf), m = c.mf + c.step % (c.ml - c.mf);
      const size_t idx = (size_t(c.b) * heads + hq) * M + m;
      if (!(m >= c.pf && m < c.pl) || sem[idx] == c.n + 2) ready.push_back(i);
    }
    if (ready.empty()) return false;  // deadlock
    const int i = ready[rng() % ready.size()];
    Cta& c = live[i];
    if (c.step == c.iters) {
      live.erase(live.begin() + i);
      if (next < s.total) claim();
      continue;
    }
    const int hq = c.hk * group + c.step / (c.ml - c.mf), m = c.mf + c.step % (c.ml - c.mf);
    const size_t idx = (size_t(c.b) * heads + hq) * M + m;
    if (c.n >= last_n[idx]) *order_ok = false;  // must descend
    last_n[idx] = c.n;
    sem[idx] = c.n + 1;
    ++c.step;
  }
  return true;
}

static void check_det_order() {
  const int fail0 = g_fail;
  std::mt19937 rng(5);
  int cases = 0, mutation_deadlocks = 0, mutation_cases = 0;
  const int lens[] = {1, 37, 64, 65, 128, 129, 300, 517, 1000};
  const int wins[] = {-1, 0, 3, 20, 100, 300};
  struct Blocks {
    int bn, bm;
  };
  for (Blocks bl : {Blocks{128, 128}, Blocks{128, 64}, Blocks{64, 64}})
    for (int T : lens)
      for (int S : lens)
        for (int wl : wins)
          for (int wr : wins) {
            if (rng() % 3 != 0) continue;
            ++cases;
            MaskInfo mi{};
            mi.seqlen_q = T;
            mi.seqlen_k = S;
            mi.off = S - T;
            mi.wl = wl;
            mi.wr = wr;
            const int N = (S + bl.bn - 1) / bl.bn, M = (T + bl.bm - 1) / bl.bm;
            for (int m = 0; m < M; ++m) {
              int lo = -1, hi = -1, count = 0;
              for (int n = 0; n < N; ++n) {
                int f, l;
                mi.BlockMath::q_block_range(n * bl.bn, bl.bn, bl.bm, f, l);
                if (m >= f && m < l) {
                  if (lo < 0) lo = n;
                  hi = n;
                  ++count;
                }
              }
              CHECK(count == 0 || count == hi - lo + 1,
                    "det: T=%d S=%d wl=%d wr=%d bn=%d bm=%d: KV blocks of query block %d not an interval", T, S,
                    wl, wr, bl.bn, bl.bm, m);
              for (int n = lo; count > 0 && n <= hi; ++n) {
                int pf, pl;
                dq_pred_range(mi, n, N, bl.bn, bl.bm, pf, pl);
                CHECK((m >= pf && m < pl) == (n < hi), "det: T=%d S=%d wl=%d wr=%d: block %d, query block %d: waits %d, want %d",
                      T, S, wl, wr, n, m, int(m >= pf && m < pl), int(n < hi));
              }
            }
            const int group = 1 + int(rng() % 3), hk = 1 + int(rng() % 3), batch = 1 + int(rng() % 2);
            const bool causal_like = wr >= 0 && wl < 0;
            const BwdOrders sc = make_bwd_orders(batch, hk, group, T, S, 128, bl.bn, causal_like);
            // Waited-for tile index < waiting tile index.
            std::vector<int> index(size_t(sc.total));
            for (int t = 0; t < sc.total; ++t) {
              int n, h, b;
              sc.decode<true>(t, n, h, b);
              index[(size_t(b) * hk + h) * N + n] = t;
            }
            for (int b = 0; b < batch; ++b)
              for (int h = 0; h < hk; ++h)
                for (int n = 0; n + 1 < N; ++n)
                  CHECK(index[(size_t(b) * hk + h) * N + n + 1] < index[(size_t(b) * hk + h) * N + n],
                        "det: tile of block %d does not precede block %d's", n + 1, n);
            for (int sms : {1, 2, 3, 7}) {
              bool order_ok = false;
              const bool done = simulate_det(mi, sc, group, bl.bn, bl.bm, sms, true, rng, &order_ok);
              CHECK(done, "det model: deadlock T=%d S=%d wl=%d wr=%d bn=%d bm=%d SMs=%d", T, S, wl, wr, bl.bn, bl.bm,
                    sms);
              CHECK(order_ok, "det model: a dQ tile not added in descending KV-block order (T=%d S=%d)", T, S);
            }
            if (N >= 2) {  // mutation: ascending tile order, 1 SM
              bool order_ok = false;
              ++mutation_cases;
              mutation_deadlocks += !simulate_det(mi, sc, group, bl.bn, bl.bm, 1, false, rng, &order_ok);
            }
          }
  std::printf("deterministic dQ order (%d cases; mutation: ascending tile order deadlocks %d of %d with 1 SM): %s\n",
              cases, mutation_deadlocks, mutation_cases, g_fail == fail0 ? "ok" : "FAILED");
  CHECK(mutation_deadlocks > 0, "det model: the mutation never deadlocked");
}

int main() {
  check_config<BwdConfigFor<64>::type>();
  check_config<BwdConfigFor<128>::type>();
  check_config<BwdConfigHd128Bm80>();
  check_config_hd256<BwdConfigFor<256>::type>();
  check_dropout_hd256();
  check_config_pair<BwdPairConfig64>();
  check_config_pair_swapped<BwdPairConfigFor<192, 128>::type>();
  check_masks<128>();
  check_masks<64>();
  check_masks<80>();
  check_masks<80, 5>();
  check_masks_hd256();
  check_scheduler();
  check_det_order();
  std::printf("%s (%d failed checks)\n", g_fail ? "FAILED" : "ALL OK", g_fail);
  return g_fail ? 1 : 0;
}
