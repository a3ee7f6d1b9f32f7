// Tile configurations of the FP8-cache decode kernel other than production's
// (decode_params.h's decode_tile), for the self-test (correctness on the
// emulator or GPU) and its --bench mode (which one streams fastest). The
// extension never contains them.
//
// A variant is the production kernel (decode_kernel) with an explicit
// DecodeConfig: keys per stage, ring depth, CTAs per SM the
// registers are bounded for, and 16 or 32 rows per CTA (16-row CTAs serve
// any seqlen_q * group; more rows take several row blocks, each reading the
// keys). bf16 Q / O, no softcap (the softcap is the same code in every
// configuration and is tested on production's).
#pragma once

#include <cuda_bf16.h>

#include "decode/decode.h"
#include "decode/decode_launch.cuh"
#include "decode/decode_plan.h"
#include "jax_flash/head_dim.h"

namespace decode_variants {

using jax_flash::decode::DecodeConfig;
using jax_flash::decode::DecodeParams;

struct Variant {
  const char* name;
  int head_dim, rows, block_n, stages, min_ctas, smem_bytes;
  cudaError_t (*launch)(const DecodeParams&, cudaStream_t);
};

template <int kD, int kMT, int kN, int kStages, int kCtas>
cudaError_t launch_fp8_variant(const DecodeParams& p, cudaStream_t stream) {
  using Cfg = DecodeConfig<kD, kMT, true, kN, kStages, kCtas>;
  if (!jax_flash::decode::decode_supported(p) || !p.kv_fp8 || p.dtype != jax_flash::DType::kBFloat16 ||
      jax_flash::rounded_head_dim(p.head_dim) != kD || p.sm.softcap_pre != 0.f)
    return cudaErrorInvalidValue;
  if (int64_t(p.batch) * p.num_heads * p.seqlen_q == 0) return cudaSuccess;
  cudaError_t err = jax_flash::decode::launch_decode_kernel<Cfg>(
      jax_flash::decode::decode_kernel<__nv_bfloat16, kD, kMT, false, true, Cfg>, p, stream);
  if (err != cudaSuccess) return err;
  return jax_flash::decode::launch_decode_combine<__nv_bfloat16>(p, stream);
}

template <int kD, int kMT, int kN, int kStages, int kCtas>
constexpr Variant fp8_variant(const char* name) {
  return {name, kD, kMT * 16, kN, kStages, kCtas,
          DecodeConfig<kD, kMT, true, kN, kStages, kCtas>::kSmemBytes,
          launch_fp8_variant<kD, kMT, kN, kStages, kCtas>};
}

// Bytes in flight per SM (H200, 228 KB): CTAs x (stages - 1) x stage bytes,
// a stage of 64 keys 16.5 KB, of 128 keys 33 KB at head_dim 128.
inline const Variant kVariants[] = {
    fp8_variant<128, 1, 128, 2, 3>("fp8 d128 16r 128x2 3cta"),  // 100 KB (production's tile)
    fp8_variant<128, 1, 64, 4, 3>("fp8 d128 16r 64x4 3cta"),    // 148 KB
    fp8_variant<128, 1, 128, 3, 2>("fp8 d128 16r 128x3 2cta"),  // 132 KB
    fp8_variant<128, 1, 64, 5, 2>("fp8 d128 16r 64x5 2cta"),    // 132 KB
    fp8_variant<128, 1, 64, 3, 3>("fp8 d128 16r 64x3 3cta"),    //  99 KB (control: 64-key overheads)
};

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
