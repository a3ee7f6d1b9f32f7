// Kernel configurations of the decoding kernels other than production's
// (decode_params.h's decode_tile), for the self-test (correctness on the
// emulator or GPU) and its --bench mode (which one streams fastest). The
// extension never contains them.
//
// A variant is the production kernel (decode_kernel) with an explicit
// DecodeConfig: the cache (bf16 or FP8), keys per stage, ring depth, CTAs
// per SM the registers are bounded for, and 16 or 32 rows per CTA (16-row
// CTAs serve any seqlen_q * group; more rows take several row blocks, each
// reading the keys, the second from L2 when both run at once). bf16 Q / O,
// no softcap (the softcap is the same code in every configuration and is
// tested on production's). The splits are merged by the policy's combine
// kernel unless the variant names one.
#pragma once

#include <cuda_bf16.h>

#include "decode/decode.h"
#include "decode/decode_launch.cuh"
#include "decode/decode_plan.h"
#include "jax_flash/head_dim.h"

namespace decode_variants {

using jax_flash::decode::CombineKind;
using jax_flash::decode::DecodeConfig;
using jax_flash::decode::DecodeParams;

struct Variant {
  const char* name;
  bool fp8;
  int head_dim, rows, block_n, stages, min_ctas, smem_bytes;
  cudaError_t (*launch)(const DecodeParams&, cudaStream_t);
};

// kCombine: -1 the policy's (decode_combine_kind), else a CombineKind.
template <typename Cfg, int kCombine = -1>
cudaError_t launch_variant(const DecodeParams& p, cudaStream_t stream) {
  if (!jax_flash::decode::decode_supported(p) || p.kv_fp8 != Cfg::kFp8 ||
      p.dtype != jax_flash::DType::kBFloat16 || jax_flash::rounded_head_dim(p.head_dim) != Cfg::kHeadDim ||
      p.sm.softcap_pre != 0.f)
    return cudaErrorInvalidValue;
  if (int64_t(p.batch) * p.num_heads * p.seqlen_q == 0) return cudaSuccess;
  cudaError_t err = jax_flash::decode::launch_decode_kernel<Cfg>(
      jax_flash::decode::decode_kernel<__nv_bfloat16, Cfg::kHeadDim, Cfg::kMT, false, Cfg::kFp8, Cfg>, p,
      stream);
  if (err != cudaSuccess) return err;
  const CombineKind kind =
      kCombine < 0 ? jax_flash::decode::decode_combine_kind(p.num_splits) : CombineKind(kCombine);
  return jax_flash::decode::launch_decode_combine<__nv_bfloat16>(p, stream, kind);
}

template <typename Cfg, int kCombine = -1>
constexpr Variant variant_of(const char* name) {
  return {name,          Cfg::kFp8,         Cfg::kHeadDim, Cfg::kRows, Cfg::kBlockN, Cfg::kStages,
          Cfg::kMinCtas, Cfg::kSmemBytes, launch_variant<Cfg, kCombine>};
}
template <bool kFp8, int kD, int kMT, int kN, int kStages, int kCtas>
constexpr Variant variant(const char* name) {
  return variant_of<DecodeConfig<kD, kMT, kFp8, kN, kStages, kCtas>>(name);
}

// The 16-bit tile load before the one-page fast path (each 16-byte chunk
// with its own row, page lookup and 64-bit offset), for the bench's
// old-against-new rows: production's configurations with Q in shared memory
// as distinct types, whose load_kv_tile is specialised below.
template <int kMT>
struct PerChunkLoad : DecodeConfig<128, kMT, false, 64, 3, 0, false> {};

template <typename Element, typename Cfg>
JF_DEVICE void load_kv_tile_per_chunk(uint32_t sK, uint32_t sV, const DecodeParams& p,
                                      const jax_flash::decode::DecodeBlock& d, int n0, int tid) {
  using KTile = typename Cfg::KTile;
  constexpr int kChunks = Cfg::kHeadDim / 8;
  constexpr int kTotal = Cfg::kBlockN * kChunks;
  const Element* k = static_cast<const Element*>(p.k);
  const Element* v = static_cast<const Element*>(p.v);
  const int32_t* table = p.page_table + int64_t(d.b) * p.max_pages;
  const int ps = p.page_size;
  const int page0 = n0 / ps;
  const bool one_page = (n0 + Cfg::kBlockN - 1) / ps == page0;
  const int64_t tile_base =
      one_page ? jax_flash::decode::page_base(p, table, page0) + int64_t(n0 - page0 * ps) * p.kv_row_stride : 0;
  const int64_t head = int64_t(d.hk) * p.kv_head_stride;
#pragma unroll
  for (int i = 0; i < kTotal / Cfg::kThreads; ++i) {
    const int idx = tid + i * Cfg::kThreads;
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    const int j = n0 + r;
    const bool ok = j < d.blk.seqlen_k && c < p.head_dim;
    int64_t off = 0;
    if (ok) {
      off = one_page ? tile_base + int64_t(r) * p.kv_row_stride
                     : jax_flash::decode::page_base(p, table, j / ps) + int64_t(j % ps) * p.kv_row_stride;
      off += head + c;
    }
    const uint32_t so = KTile::offset(r, c);
    jax_flash::sm80::cp_async_16(sK + so, k + off, ok);
    jax_flash::sm80::cp_async_16(sV + so, v + off, ok);
  }
}

}  // namespace decode_variants

namespace jax_flash::decode {
template <>
JF_DEVICE void load_kv_tile<__nv_bfloat16, decode_variants::PerChunkLoad<1>>(
    uint32_t sK, uint32_t sV, const DecodeParams& p, const DecodeBlock& d, int n0, int tid) {
  decode_variants::load_kv_tile_per_chunk<__nv_bfloat16, decode_variants::PerChunkLoad<1>>(sK, sV, p, d, n0, tid);
}
template <>
JF_DEVICE void load_kv_tile<__nv_bfloat16, decode_variants::PerChunkLoad<2>>(
    uint32_t sK, uint32_t sV, const DecodeParams& p, const DecodeBlock& d, int n0, int tid) {
  decode_variants::load_kv_tile_per_chunk<__nv_bfloat16, decode_variants::PerChunkLoad<2>>(sK, sV, p, d, n0, tid);
}
}  // namespace jax_flash::decode

namespace decode_variants {

// Bytes in flight per SM (H200, 228 KB): CTAs x (stages - 1) x stage bytes;
// at head_dim 128 a stage of 64 keys is 16.5 KB in e4m3, 32 KB in bf16.
inline const Variant kVariants[] = {
    variant<true, 128, 1, 128, 2, 3>("fp8 d128 16r 128x2 3cta"),  // 100 KB (production's tile)
    variant<true, 128, 1, 64, 4, 3>("fp8 d128 16r 64x4 3cta"),    // 148 KB
    variant<true, 128, 1, 128, 3, 2>("fp8 d128 16r 128x3 2cta"),  // 132 KB
    variant<true, 128, 1, 64, 5, 2>("fp8 d128 16r 64x5 2cta"),    // 132 KB
    variant<true, 128, 1, 64, 3, 3>("fp8 d128 16r 64x3 3cta"),    //  99 KB (control: 64-key overheads)
    // bf16: production's 16-row tile with the registers bounded for 2 CTAs;
    // on 32 packed rows (T_new * group) two 16-row blocks where production
    // runs one 32-row CTA (half the products per warp and key, 168 against
    // 248 registers; the keys read twice, the second time from L2).
    variant<false, 128, 1, 64, 3, 2>("bf16 d128 16r 64x3 2cta"),    // 128 KB
    // 32 keys per warp: half the barriers, page lookups and softmax steps
    // per key, one CTA per SM.
    variant<false, 128, 1, 128, 3, 1>("bf16 d128 16r 128x3 1cta"),  // 128 KB
    // Three CTAs with one tile in flight each: more warps to hide each
    // tile's latency, fewer bytes in flight.
    variant<false, 128, 1, 64, 2, 3>("bf16 d128 16r 64x2 3cta"),    //  96 KB
    // Production's 16-row bf16 kernel with Q read from shared memory by
    // every tile's product (decode_q_in_registers off).
    variant_of<DecodeConfig<128, 1, false, 64, 3, 0, false>>("bf16 d128 16r Q from smem"),
    // The bf16 call as it was before the one-page tile load, Q in
    // registers and the CTA-per-row combine: 16 rows (T_new * group <= 16),
    // 32 rows; the warp-per-row combine at any split count.
    variant_of<PerChunkLoad<1>, int(CombineKind::kWarpPerRow)>("bf16 d128 16r before (per-chunk)"),
    variant_of<PerChunkLoad<2>, int(CombineKind::kWarpPerRow)>("bf16 d128 32r before (per-chunk)"),
};

// The production kernels merged by one combine kernel or the other (the
// bench's combine rows).
template <CombineKind kKind>
cudaError_t launch_with_combine(const DecodeParams& p, cudaStream_t stream) {
  const cudaError_t err = jax_flash::decode::run_decode_split(p, stream);
  if (err != cudaSuccess) return err;
  return jax_flash::decode::run_decode_combine(p, kKind, stream);
}

// The CTAs of a variant that fit an SM with smem_per_sm bytes (1 KB reserved
// per CTA), and its split count for a call (decode_plan.h's policy).
inline int variant_ctas_per_sm(const Variant& v, int smem_per_sm) {
  return std::max(1, std::min(16, smem_per_sm / (v.smem_bytes + 1024)));
}
inline int variant_num_splits(const Variant& v, int64_t batch_heads_k, int seqlen_q, int group, int max_seqlen,
                              int num_sms, int smem_per_sm) {
  const int64_t row_blocks = (int64_t(seqlen_q) * group + v.rows - 1) / v.rows;
  return jax_flash::decode::decode_num_splits_for(batch_heads_k * row_blocks, max_seqlen, v.block_n,
                                                  int64_t(num_sms) * variant_ctas_per_sm(v, smem_per_sm));
}

}  // namespace decode_variants
