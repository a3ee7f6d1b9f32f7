// sm90 backward: capability checks (bwd_supported) and dispatch to the
// (dtype, head-dim bucket) instantiation, or the (dtype, head-dim pair) one
// when v's head dim differs from q's and k's. Anything not served here
// answers cudaErrorNotSupported so that the caller runs
// jax_flash::sm80::run_bwd: deterministic mode without its workspace
// (BwdParams::sm90_dq_semaphore), head dims above 256, a value head dim
// other than q's and k's outside Sm90BwdHeadDimPairs (and a pair's dropout),
// non-sm_90 devices, TMA-incompatible layouts.
#include <cstdint>

#include "bwd_config.cuh"
#include "bwd_instantiations.h"
#include "bwd_policy.h"
#include "sm90/common/device_info.h"
#include "jax_flash/dispatch.h"
#include "jax_flash/head_dim.h"
#include "jax_flash/mask_info.h"
#include "jax_flash/support.h"
#include "sm90/launch.h"

namespace jax_flash::sm90 {
#ifndef JAX_FLASH_DISABLE_BACKWARD
namespace {

// The shared memory of the tile bwd_default_tile picks (bwd_launch_templates.cuh),
// with dropout's buffers for a dropout call, or of the head-dim pair's.
bool bucket_compiled_and_ok(const BwdParams& p, const DeviceInfo& dev, BwdTileChoice tile) {
  if (p.head_dim_v != p.head_dim)
    return dispatch_head_dim_pair(Sm90BwdHeadDimPairs{}, p.head_dim, p.head_dim_v, false, [&](auto pair) {
      using P = decltype(pair);
      return BwdPairConfigFor<P::kHeadDim, P::kHeadDimV>::type::kSmemAlloc <= dev.smem_optin;
    });
  return dispatch_head_dim(Sm90BwdHeadDims{}, Sm90BwdHeadDims::bucket(p.head_dim), false, [&](auto d) {
    using Cfg = typename BwdConfigFor<decltype(d)::value>::type;
    const int smem = tile == BwdTileChoice::kBlockM80 ? BwdConfigHd128Bm80::kSmemAlloc
                     : p.dropout.enabled()            ? BwdDropoutConfig<Cfg>::kSmemAlloc
                                                      : Cfg::kSmemAlloc;
    return smem <= dev.smem_optin;
  });
}

// Keys per CTA of the bucket's tiles (the kBlockM 80 tile has the bucket's),
// or of the head-dim pair's (0: not compiled).
int bwd_block_n(const BwdParams& p, int bucket) {
  if (p.head_dim_v != p.head_dim)
    return dispatch_head_dim_pair(Sm90BwdHeadDimPairs{}, p.head_dim, p.head_dim_v, 0, [](auto pair) {
      using P = decltype(pair);
      return BwdPairConfigFor<P::kHeadDim, P::kHeadDimV>::type::kBlockN;
    });
  return dispatch_head_dim(Sm90BwdHeadDims{}, bucket, 0,
                           [](auto d) { return BwdConfigFor<decltype(d)::value>::type::kBlockN; });
}

template <typename Element>
cudaError_t bwd_dtype(const BwdParams& p, cudaStream_t stream) {
  if (p.dropout.enabled()) {
    return dispatch_head_dim(Sm90BwdDropoutHeadDims{}, Sm90BwdDropoutHeadDims::bucket(p.head_dim),
                             cudaErrorNotSupported,
                             [&](auto d) { return run_bwd_dropout_hdim<Element, decltype(d)::value>(p, stream); });
  }
  if (p.head_dim_v != p.head_dim)
    return dispatch_head_dim_pair(Sm90BwdHeadDimPairs{}, p.head_dim, p.head_dim_v, cudaErrorNotSupported,
                                  [&](auto pair) {
                                    using P = decltype(pair);
                                    return run_bwd_hdim<Element, P::kHeadDim, P::kHeadDimV>(p, stream);
                                  });
  return dispatch_head_dim(Sm90BwdHeadDims{}, Sm90BwdHeadDims::bucket(p.head_dim), cudaErrorNotSupported,
                           [&](auto d) { return run_bwd_hdim<Element, decltype(d)::value>(p, stream); });
}

}  // namespace
#endif  // !JAX_FLASH_DISABLE_BACKWARD

#ifdef JAX_FLASH_DISABLE_BACKWARD
bool bwd_supported(const BwdParams&) { return false; }
#else
bool bwd_supported(const BwdParams& p) {
  // Dropout: the buckets of Sm90BwdDropoutHeadDims without softcap; the
  // sm80 backward serves the rest. Its tile is the bucket's (not kBlockM 80).
  if (p.dropout.enabled() &&
      (p.softcap > 0.f || Sm90BwdDropoutHeadDims::bucket(p.head_dim) == 0))
    return false;
  // Deterministic (fixed dQ order through semaphores, bwd_dq.cuh): needs
  // the semaphore workspace (and runs the bucket's tile, bwd_default_tile).
  if (p.deterministic &&
      (p.sm90_dq_semaphore == nullptr || (reinterpret_cast<uintptr_t>(p.sm90_dq_semaphore) & 3) != 0))
    return false;
  // Its dQ order follows the positional query-block ranges, which diagonal
  // shifts (packed sequences of unequal lengths) invalidate: sm80 serves those.
  if (p.deterministic && p.q_shift != nullptr) return false;
  if (!problem_ok(p) || !bwd_buffers_ok(p) || !dq_accum_ok(p)) return false;
  // One head dim for q, k and v, or a head-dim pair with sm90 kernels (served
  // exactly; no dropout kernels); the sm80 family serves the other pairs.
  if (p.head_dim_v != p.head_dim &&
      (!Sm90BwdHeadDimPairs::contains(p.head_dim, p.head_dim_v) || p.dropout.enabled()))
    return false;
  if (p.dq == nullptr || !aligned16(p.dq)) return false;
#ifdef JAX_FLASH_DISABLE_FP16
  if (p.dtype != DType::kBFloat16) return false;
#else
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
#endif
  const int bucket = Sm90BwdHeadDims::bucket(p.head_dim);
  const BwdTileChoice tile = p.dropout.enabled()
                                 ? BwdTileChoice::kBucket
                                 : bwd_default_tile(bucket, make_mask_info(p).bounded(), p.deterministic);
  // A bucket this build serves, and its grid (KV blocks x kv heads x batch) fits.
  const int64_t block_n = bwd_block_n(p, bucket);
  if (block_n == 0) return false;
  if (int64_t(p.batch) * p.num_heads_k * ((int64_t(p.seqlen_k) + block_n - 1) / block_n) >=
      (int64_t(1) << 31))
    return false;
  // dq (written by dq_convert with 16-byte stores) has q's strides; dK / dV
  // K's / V's; dO O's. All are read / written by TMA except dq.
  if (!tensor_ok(p.q, p.seqlen_q, p.num_heads, p.batch, p.q_row_stride, p.q_head_stride,
                 p.q_batch_stride) ||
      !tensor_ok(p.dout, p.seqlen_q, p.num_heads, p.batch, p.o_row_stride, p.o_head_stride,
                 p.o_batch_stride) ||
      !tensor_ok(p.k, p.seqlen_k, p.num_heads_k, p.batch, p.k_row_stride, p.k_head_stride,
                 p.k_batch_stride) ||
      !tensor_ok(p.v, p.seqlen_k, p.num_heads_k, p.batch, p.v_row_stride, p.v_head_stride,
                 p.v_batch_stride) ||
      !tensor_ok(p.dk, p.seqlen_k, p.num_heads_k, p.batch, p.k_row_stride, p.k_head_stride,
                 p.k_batch_stride) ||
      !tensor_ok(p.dv, p.seqlen_k, p.num_heads_k, p.batch, p.v_row_stride, p.v_head_stride,
                 p.v_batch_stride))
    return false;
  const DeviceInfo dev = device_info();
  if (!dev.sm90) return false;
  return bucket_compiled_and_ok(p, dev, tile);
}
#endif

#ifdef JAX_FLASH_DISABLE_BACKWARD
bool bwd_varlen_supported(const VarlenBwdParams&) { return false; }
cudaError_t run_bwd_varlen(const VarlenBwdParams&, cudaStream_t) { return cudaErrorNotSupported; }
#else
bool bwd_varlen_supported(const VarlenBwdParams& p) {
  if (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr || p.num_seqs < 1) return false;
  if (p.q_segment != nullptr || p.dropout.enabled() || p.deterministic) return false;
  if (p.head_dim_v != p.head_dim || p.head_dim <= 0 || p.head_dim % 8 != 0) return false;
  const int bucket = Sm90BwdVarlenHeadDims::bucket(p.head_dim);
  if (bucket == 0) return false;
  if (!bwd_supported(p)) return false;  // shapes, layouts, dtypes, the device
  // The grid (VarlenBwdOrder::max_tiles) fits an int.
  const int64_t block_n = bwd_block_n(p, bucket);
  if (int64_t(p.num_heads_k) * p.batch * ((int64_t(p.seqlen_k) + block_n - 1) / block_n + p.num_seqs) >=
      (int64_t(1) << 31))
    return false;
  const BwdTileChoice tile = bwd_default_tile(bucket, make_mask_info(p).bounded(), false);
  return dispatch_head_dim(Sm90BwdVarlenHeadDims{}, bucket, false, [&](auto d) {
    using Cfg = typename BwdConfigFor<decltype(d)::value>::type;
    const int smem = tile == BwdTileChoice::kBlockM80 ? BwdVarlenConfig<BwdConfigHd128Bm80>::kSmemAlloc
                                                      : BwdVarlenConfig<Cfg>::kSmemAlloc;
    return smem <= device_info().smem_optin;
  });
}

cudaError_t run_bwd_varlen(const VarlenBwdParams& p, cudaStream_t stream) {
  if (!bwd_varlen_supported(p)) return cudaErrorNotSupported;
  if (p.batch == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto e) {
    using Element = typename decltype(e)::type;
    return dispatch_head_dim(Sm90BwdVarlenHeadDims{}, Sm90BwdVarlenHeadDims::bucket(p.head_dim),
                             cudaErrorNotSupported,
                             [&](auto d) { return run_bwd_varlen_hdim<Element, decltype(d)::value>(p, stream); });
  });
}
#endif

#ifdef JAX_FLASH_DISABLE_BACKWARD
cudaError_t run_bwd(const BwdParams&, cudaStream_t) { return cudaErrorNotSupported; }
#else
cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream) {
  if (!bwd_supported(p)) return cudaErrorNotSupported;
  if (p.batch == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto e) { return bwd_dtype<typename decltype(e)::type>(p, stream); });
}
#endif

}  // namespace jax_flash::sm90
