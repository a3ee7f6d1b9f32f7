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
template <bool kFp8, int kD, int kMT, int kN, int kStages, int kCtas, int kCombine = -1>
cudaError_t launch_variant(const DecodeParams& p, cudaStream_t stream) {
  using Cfg = DecodeConfig<kD, kMT, kFp8, kN, kStages, kCtas>;
  if (!jax_flash::decode::decode_supported(p) || p.kv_fp8 != kFp8 || p.dtype != jax_flash::DType::kBFloat16 ||
      jax_flash::rounded_head_dim(p.head_dim) != kD || p.sm.softcap_pre != 0.f)
    return cudaErrorInvalidValue;
  if (int64_t(p.batch) * p.num_heads * p.seqlen_q == 0) return cudaSuccess;
  cudaError_t err = jax_flash::decode::launch_decode_kernel<Cfg>(
      jax_flash::decode::decode_kernel<__nv_bfloat16, kD, kMT, false, kFp8, Cfg>, p, stream);
  if (err != cudaSuccess) return err;
  const CombineKind kind =
      kCombine < 0 ? jax_flash::decode::decode_combine_kind(p.num_splits) : CombineKind(kCombine);
  return jax_flash::decode::launch_decode_combine<__nv_bfloat16>(p, stream, kind);
}

template <bool kFp8, int kD, int kMT, int kN, int kStages, int kCtas>
constexpr Variant variant(const char* name) {
  return {name, kFp8, kD, kMT * 16, kN, kStages, kCtas,
          DecodeConfig<kD, kMT, kFp8, kN, kStages, kCtas>::kSmemBytes,
          launch_variant<kFp8, kD, kMT, kN, kStages, kCtas>};
}

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
