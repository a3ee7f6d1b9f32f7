// The FP8 forward's V transpose in shared memory (run by the producer
// warpgroup's transposer warps, mainloop.cuh): one KV block of V, loaded by
// TMA in its natural layout, rewritten as the K-major V^T operand of the PV
// GEMM. Layout math only (host and device), so that a CPU check
// (cuda/tests/sm90_fp8_vt_check.cpp) can prove the mapping and its bank
// behaviour; the device loop is VTranspose::run in v_transpose.cuh.
//
// Source, one stage of V (what TMA writes): kHeadDim / R column blocks of
// [kBlockN keys][R bytes], R = 128 with the 128B swizzle (chunk c of key k at
// c ^ (k % 8)), or R = 64 for a head dim of 64 with the 64B swizzle (chunk c
// of key k at c ^ ((k / 2) % 4)):
//   (d / R) * kBlockN * R + swizzle(k * R + d % R).
// Destination, one stage of V^T (what wgmma reads K-major, 128B swizzle):
// kAtoms = ceil(kBlockN / 128) atoms of [kHeadDim rows][128 keys], the last
// one partly used when kBlockN % 128 != 0 (the PV GEMM's k-steps of 32 keys
// walk into the next atom after four steps); logical key position kappa of
// row d at
//   (kappa / 128) * kHeadDim * 128 + d * 128 + ((((kappa % 128) / 16) ^ (d % 8)) * 16) + kappa % 16,
// where position kappa holds physical key vt_key(kappa) (the permutation of
// scheme.py's v_key_permutation within each group of 32 keys: the PV GEMM's
// A operand is the softmax accumulator packed in place, acc_to_a, whose k
// index is this permutation of the key index).
//
// Work unit (a step): 32 keys x 16 head-dim bytes, FlashAttention-3's
// LDSM.T + byte permute + STSM. Step s takes the d-chunk c = s / kGroups
// (bytes 16c .. 16c + 15) and the keys 32 g + 0..31, g = s % kGroups
// (kGroups = kBlockN / 32 groups of keys):
// - ldmatrix.x4.trans (16-bit elements): lane l gives the address of key
//   32 g + l, chunk c, so matrix i (lanes 8i .. 8i + 7) is keys 32 g + 8 i +
//   0..7 x 16 bytes. Lane t receives in register i the 16-bit column t / 4 of
//   rows 2 (t % 4) and 2 (t % 4) + 1: bytes [k.d0, k.d1, k+1.d0, k+1.d1],
//   k = 32 g + 8 i + 2 (t % 4), d0 = 16 c + 2 (t / 4), d1 = d0 + 1.
// - Two byte permutes per register pair (2p, 2p + 1), p = 0, 1 (keys k and
//   k + 8): prmt 0x6420 = [k.d0, k+1.d0, k+8.d0, k+9.d0], the V^T word of row
//   d0 at positions 16 (2g + p) + 4 (t % 4) + 0..3 (which vt_key maps to
//   exactly these keys), and prmt 0x7531 the word of row d1.
// - stmatrix.x4 (not transposed): lane t gives register j as row t / 4 of
//   matrix j, bytes 4 (t % 4) .. + 3; lane 8 j + r the address of row r.
//   Matrices 2p and 2p + 1 are the 16-byte chunk 2 (g % 4) + p of the rows
//   16 c + 0..15 of atom g / 4: row r of matrix j is V^T row 16 c + 2 r + e, e = (j % 2) ^ (r >= 4),
//   so that each matrix's eight rows have distinct d % 8 (distinct bank
//   groups after the swizzle). Lanes t >= 16 (rows r >= 4) therefore put
//   the d1 word in register 2p and the d0 word in 2p + 1: the permute
//   selectors are a register per lane (sel).
// Banks: a matrix of ldmatrix / stmatrix is one wavefront when its eight
// 16-byte rows lie in distinct bank groups (16-byte columns of a 128-byte
// line). Loads: the eight rows are 8 consecutive keys, whose swizzled chunks
// (128B: c ^ k % 8; 64B: two keys per line, 4 (k % 2) + (c ^ (k / 2) % 4))
// are distinct; stores: distinct d % 8 as above. So each x4 instruction
// takes four wavefronts, the minimum for 512 bytes (the CPU check verifies
// every instruction).
// Addresses: per lane a base (src_lane, dst_lane) and per step a compile-time
// XOR (the swizzled chunk) and a compile-time addend (keys, rows, column
// blocks, V^T atoms); the XOR and the addend (and the 1 KB aligned stage
// base) touch disjoint bits, so they commute.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JF_HD __host__ __device__ __forceinline__
#else
#define JF_HD inline
#endif

namespace jax_flash::sm90 {

// Bytes of one V^T stage: whole 128-key atoms of [head_dim rows][128 bytes].
constexpr int vt_stage_bytes(int head_dim, int block_n) { return (block_n + 127) / 128 * head_dim * 128; }

template <int kHeadDim_, int kBlockN_>
struct VTransposeLayout {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static_assert(kBlockN % 32 == 0 && kBlockN <= 256, "whole groups of 32 keys (one e4m3 wgmma k-step each)");
  static_assert(kHeadDim % 128 == 0 || kHeadDim == 64, "whole 128-byte column blocks of V, or one 64-byte row");
  static constexpr int kRowBytes = kHeadDim < 128 ? kHeadDim : 128;  // R: a V row in shared memory
  static constexpr int kChunksPerRow = kRowBytes / 16;                // 16-byte chunks of a V row
  static constexpr int kChunks = kHeadDim / 16;                       // d-chunks of a key
  static constexpr int kGroups = kBlockN / 32;                        // 32-key groups of a stage
  static constexpr int kAtoms = (kBlockN + 127) / 128;                // 128-key atoms of a V^T stage
  static constexpr int kAtomBytes = kHeadDim * 128;                   // [kHeadDim rows][128 keys]
  static constexpr int kStageBytes = kBlockN * kHeadDim;              // V (natural layout)
  static constexpr int kVtStageBytes = vt_stage_bytes(kHeadDim, kBlockN);  // V^T (whole atoms)
  static_assert(kVtStageBytes == kAtoms * kAtomBytes);
  static constexpr int kSteps = kGroups * kChunks;  // 512-byte steps per stage

  // Physical key (within the block) at logical V^T position kappa (a
  // permutation within each group of 32).
  JF_HD static int vt_key(int kappa) {
    return 16 * (kappa / 16) + 8 * ((kappa % 4) / 2) + 2 * ((kappa % 16) / 4) + kappa % 2;
  }
  // Byte offset of (key k, head-dim byte d) in a V stage.
  JF_HD static uint32_t src_offset(int k, int d) {
    const uint32_t a = uint32_t(k * kRowBytes + d % kRowBytes);
    const uint32_t swz = kRowBytes == 128 ? (a >> 7) & 7 : (a >> 7) & 3;
    return uint32_t((d / kRowBytes) * kBlockN * kRowBytes) + (a ^ (swz << 4));
  }
  // Byte offset of (row d, key position x < 128) in a V^T atom.
  JF_HD static uint32_t atom_offset(int d, int x) {
    return uint32_t(d * 128 + (((x / 16) ^ (d % 8)) * 16) + x % 16);
  }
  // Byte offset of (row d, logical key position kappa) in a V^T stage.
  JF_HD static uint32_t dst_offset(int d, int kappa) {
    return uint32_t((kappa / 128) * kAtomBytes) + atom_offset(d, kappa % 128);
  }

  // Step s: the d-chunk c = s / kGroups (bytes 16c .. 16c + 15) and the keys
  // 32 g + 0..31, g = s % kGroups (see the top of the file).
  static constexpr int chunk(int s) { return s / kGroups; }
  static constexpr int group(int s) { return s % kGroups; }
  // The steps of transposer warp w of `warps`: [first_step(w), first_step(w + 1)).
  static constexpr int first_step(int w, int warps) { return kSteps * w / warps; }

  // ldmatrix row address of lane l at step s: (src_lane(l) ^ src_xor(s)) +
  // src_add(s) = src_offset(32 g + l, 16 c). The XOR only touches bits 4..6
  // (the chunk within a swizzle row), which src_add (and the 1 KB aligned
  // stage base) never set.
  JF_HD static uint32_t src_lane(int lane) { return src_offset(lane, 0); }
  static constexpr uint32_t src_xor(int s) { return uint32_t(16 * (chunk(s) % kChunksPerRow)); }
  static constexpr uint32_t src_add(int s) {
    return uint32_t((chunk(s) / kChunksPerRow) * kBlockN * kRowBytes + 32 * group(s) * kRowBytes);
  }
  // stmatrix row address of lane l = 8 j + r at step s: (dst_lane(l) ^
  // dst_xor(s)) + dst_add(s) = dst_offset(16 c + dst_row(l), 16 (2 g + j / 2)).
  // The XOR only touches bits 5..6 (the 32-key group within its atom, of
  // the swizzled chunk), which dst_add (rows and atoms, multiples of 2 KB)
  // and the stage base never set.
  JF_HD static int dst_row(int lane) {
    const int r = lane % 8;
    return 2 * r + (((lane / 8) % 2) ^ (r >= 4 ? 1 : 0));
  }
  JF_HD static uint32_t dst_lane(int lane) { return atom_offset(dst_row(lane), 16 * (lane / 16)); }
  static constexpr uint32_t dst_xor(int s) { return uint32_t(32 * (group(s) % 4)); }
  static constexpr uint32_t dst_add(int s) {
    return uint32_t(16 * 128 * chunk(s) + (group(s) / 4) * kAtomBytes);
  }
  // The row addresses as the device computes them (VTranspose), from the
  // stage base (1 KB aligned) and the lane's base: the loads XOR the lane
  // base only, the stores the whole address (see v_transpose.cuh for why).
  JF_HD static uint32_t load_addr(uint32_t stage, uint32_t lane_base, int s) {
    return (lane_base ^ src_xor(s)) + stage + src_add(s);
  }
  JF_HD static uint32_t store_addr(uint32_t stage, uint32_t lane_base, int s) {
    return (lane_base + stage + dst_add(s)) ^ dst_xor(s);
  }
  // Byte-permute selector of the word lane t stores as register 2p (row
  // d0 for t < 16, d1 from t = 16 on); register 2p + 1 takes sel ^ 0x1111.
  JF_HD static uint32_t sel(int lane) { return lane < 16 ? 0x6420u : 0x7531u; }
};

// One lane's ldmatrix.trans registers (pairs (0, 1) and (2, 3): keys k, k + 8)
// -> its four stmatrix registers. perm(x, y, s) is __byte_perm: byte i of the
// result is byte (s >> 4i) & 7 of {y, x}.
template <typename Perm>
JF_HD void transpose_pairs(const uint32_t (&in)[4], uint32_t (&out)[4], uint32_t sel, Perm perm) {
  const uint32_t sel1 = sel ^ 0x1111u;  // 0x6420 <-> 0x7531
  out[0] = perm(in[0], in[1], sel);
  out[1] = perm(in[0], in[1], sel1);
  out[2] = perm(in[2], in[3], sel);
  out[3] = perm(in[2], in[3], sel1);
}

}  // namespace jax_flash::sm90
