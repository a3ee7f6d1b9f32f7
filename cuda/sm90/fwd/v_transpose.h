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
// [kHeadDim rows][128 keys]; logical key position kappa of row d at
//   d * 128 + (((kappa / 16) ^ (d % 8)) * 16) + kappa % 16,
// where position kappa holds physical key vt_key(kappa) (the permutation of
// scheme.py's v_key_permutation: the PV GEMM's A operand is the softmax
// accumulator packed in place, acc_to_a, whose k index is this permutation of
// the key index).
//
// Work unit: 4 keys x 4 bytes of the head dim. The unit (w, q) takes the four
// keys of V^T word w (positions 4w..4w+3 of a row, w < 32) and the head-dim
// bytes 4q..4q+3: four 32-bit loads (one per key), a 4x4 byte transpose in
// registers (8 byte permutes), four 32-bit stores (one per V^T row). Lane l of
// a transposer warp takes w = l and, at step s, the quad
//   q = Q * (s / Q) + ((l ^ s) % Q),  Q = R / 4 quads per source row.
// With l = 4b + a, R = 128: the loads of one instruction hit banks
// 4 ((b ^ (s / 4 % 8)) ^ (2a + j % 2)) + (a ^ (s % 4)) and the stores banks
// 4 (b ^ (4 ((a ^ s) % 2) + j)) + a: both one-to-one in l. R = 64: two keys
// share a 128-byte bank row, so lanes 16..31 load their keys in the order
// 1, 0, 3, 2 (load_key) to put the other key parity on the other half of the
// banks. No bank conflicts either way (the CPU check verifies every
// instruction).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JF_HD __host__ __device__ __forceinline__
#else
#define JF_HD inline
#endif

namespace jax_flash::sm90 {

template <int kHeadDim_, int kBlockN_ = 128>
struct VTransposeLayout {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static_assert(kBlockN == 128, "one V^T row = one 128-byte swizzle row of keys");
  static_assert(kHeadDim % 128 == 0 || kHeadDim == 64, "whole 128-byte column blocks of V, or one 64-byte row");
  static constexpr int kRowBytes = kHeadDim < 128 ? kHeadDim : 128;  // R: a V row in shared memory
  static constexpr int kQuads = kRowBytes / 4;                        // Q
  static constexpr int kStageBytes = kBlockN * kHeadDim;  // either layout
  static constexpr int kSteps = kHeadDim / 4;             // units per lane (one per q)

  // Physical key (within the block) at logical V^T position kappa.
  JF_HD static int vt_key(int kappa) {
    return 16 * (kappa / 16) + 8 * ((kappa % 4) / 2) + 2 * ((kappa % 16) / 4) + kappa % 2;
  }
  // Byte offset of (key k, head-dim byte d) in a V stage.
  JF_HD static uint32_t src_offset(int k, int d) {
    const uint32_t a = uint32_t(k * kRowBytes + d % kRowBytes);
    const uint32_t swz = kRowBytes == 128 ? (a >> 7) & 7 : (a >> 7) & 3;
    return uint32_t((d / kRowBytes) * kBlockN * kRowBytes) + (a ^ (swz << 4));
  }
  // Byte offset of (row d, logical key position kappa) in a V^T stage.
  JF_HD static uint32_t dst_offset(int d, int kappa) {
    return uint32_t(d * 128 + (((kappa / 16) ^ (d % 8)) * 16) + kappa % 16);
  }
  // The head-dim quad of lane l at step s (see the top of the file).
  JF_HD static int quad(int lane, int s) { return kQuads * (s / kQuads) + ((lane ^ s) % kQuads); }
  // Key j (0..3) of V^T word w: position 4w + j.
  JF_HD static int unit_key(int w, int j) { return vt_key(4 * w + j); }
  // Whether lane l loads its unit's keys in the order 1, 0, 3, 2.
  JF_HD static bool swapped(int lane) { return kRowBytes == 64 && lane >= 16; }
  // The key of lane l's j-th load, and the loaded words back in key order.
  JF_HD static int load_key(int lane, int j) { return unit_key(lane, swapped(lane) ? j ^ 1 : j); }
  JF_HD static void key_order(uint32_t (&in)[4], int lane) {
    if (swapped(lane)) {
      const uint32_t t0 = in[0], t2 = in[2];
      in[0] = in[1];
      in[1] = t0;
      in[2] = in[3];
      in[3] = t2;
    }
  }
};

// 4x4 byte transpose: out[i] byte j = in[j] byte i. sel(x, y, s) is
// __byte_perm: byte i of the result is byte (s >> 4i) & 7 of {y, x}.
template <typename Perm>
JF_HD void transpose_4x4_bytes(const uint32_t (&in)[4], uint32_t (&out)[4], Perm sel) {
  const uint32_t t0 = sel(in[0], in[1], 0x5140u);  // in0.b0 in1.b0 in0.b1 in1.b1
  const uint32_t t1 = sel(in[0], in[1], 0x7362u);  // in0.b2 in1.b2 in0.b3 in1.b3
  const uint32_t t2 = sel(in[2], in[3], 0x5140u);
  const uint32_t t3 = sel(in[2], in[3], 0x7362u);
  out[0] = sel(t0, t2, 0x5410u);  // in0.b0 in1.b0 in2.b0 in3.b0
  out[1] = sel(t0, t2, 0x7632u);  // byte 1 of each
  out[2] = sel(t1, t3, 0x5410u);
  out[3] = sel(t1, t3, 0x7632u);
}

}  // namespace jax_flash::sm90
