// sm90 forward: capability checks (fwd_supported) and dispatch to the
// (dtype, head-dim bucket) instantiation, or the (dtype, head-dim pair) one
// when v's head dim differs from q's and k's. Buckets and pairs switched off
// at build time (JAX_FLASH_DISABLE_*) report unsupported instead of failing
// to link; pairs without sm90 kernels are left to the sm80 family.
#include <cstdint>

#include "sm90/common/device_info.h"
#include "fwd_tuning.h"
#include "fwd_kernel.cuh"  // FwdKernelFor: the shared-memory sizes (no kernel is instantiated here)
#include "fwd_varlen_kernel.cuh"  // VarlenFwdKernelFor: likewise
#include "instantiations.h"
#include "jax_flash/dispatch.h"
#include "jax_flash/head_dim.h"
#include "sm90/launch.h"
#include "sm90/common/mask.cuh"

namespace jax_flash::sm90 {
namespace {

// The kernels' (head dim, value head dim) of a bucket, as HeadDimPair names
// those of a pair.
template <int kD>
struct BucketShape {
  static constexpr int kHeadDim = kD;
  static constexpr int kHeadDimV = kD;
};

// run(Shape{}) with the compiled shape (Shape::kHeadDim, Shape::kHeadDimV)
// that serves the call: the bucket of head_dim (zero-padded) when v's head
// dim is q's, else the head-dim pair (served exactly); `otherwise` when this
// build has none.
template <typename Result, typename Run>
Result dispatch_shape(const FwdParams& p, Result otherwise, Run&& run) {
  if (p.head_dim_v != p.head_dim)
    return dispatch_head_dim_pair(Sm90FwdHeadDimPairs{}, p.head_dim, p.head_dim_v, otherwise, run);
  return dispatch_head_dim(Sm90FwdHeadDims{}, Sm90FwdHeadDims::bucket(p.head_dim), otherwise,
                           [&](auto d) { return run(BucketShape<decltype(d)::value>{}); });
}

// The shared memory of the configuration that serves the call (both 16-bit
// types have the same plan).
template <int kD, int kDv>
bool shape_ok(const FwdParams& p, const DeviceInfo& dev) {
  using Bf16 = __nv_bfloat16;
  const MaskInfo mi = make_mask_info(p);
  const int alloc = fwd_causal_like(mi.wl, mi.wr)
                        ? FwdKernelFor<Bf16, kD, DefaultFwdTuning<kD, kDv, true>, Bf16, kDv>::type::kSmemAlloc
                        : FwdKernelFor<Bf16, kD, DefaultFwdTuning<kD, kDv, false>, Bf16, kDv>::type::kSmemAlloc;
  return alloc <= dev.smem_optin;
}

bool shape_compiled_and_ok(const FwdParams& p, const DeviceInfo& dev) {
  return dispatch_shape(p, false, [&](auto shape) {
    using S = decltype(shape);
    return shape_ok<S::kHeadDim, S::kHeadDimV>(p, dev);
  });
}

template <typename Element>
cudaError_t fwd_dtype(const FwdParams& p, cudaStream_t stream) {
  return dispatch_shape(p, cudaErrorNotSupported, [&](auto shape) {
    using S = decltype(shape);
    constexpr int kD = S::kHeadDim, kDv = S::kHeadDimV;
    return p.dropout.enabled() ? run_fwd_dropout_hdim<Element, kD, kDv>(p, stream)
                               : run_fwd_hdim<Element, kD, kDv>(p, stream);
  });
}

// The FP8 buckets are served exactly (fwd_fp8_supported).
template <typename OutElement>
cudaError_t fwd_fp8_out(const Fp8FwdParams& p, cudaStream_t stream) {
  return dispatch_head_dim(Sm90Fp8HeadDims{}, p.head_dim, cudaErrorNotSupported,
                           [&](auto d) { return run_fwd_fp8_hdim<OutElement, decltype(d)::value>(p, stream); });
}

template <int kHeadDim>
bool fp8_bucket_ok(const Fp8FwdParams& p, const DeviceInfo& dev) {
  const MaskInfo mi = make_mask_info(p);
  const int alloc = fwd_causal_like(mi.wl, mi.wr)
                        ? FwdKernelFor<__nv_fp8_e4m3, kHeadDim,
                                       DefaultFwdTuning<kHeadDim, kHeadDim, true, 1>,
                                       __nv_bfloat16>::type::kSmemAlloc
                        : FwdKernelFor<__nv_fp8_e4m3, kHeadDim,
                                       DefaultFwdTuning<kHeadDim, kHeadDim, false, 1>,
                                       __nv_bfloat16>::type::kSmemAlloc;
  return alloc <= dev.smem_optin;
}

// What every sm90 forward call needs, whatever its element type: shapes, the
// optional pieces in pairs, a positive scale, a tile count that fits an int,
// and the dynamic scheduler's counter (4-byte aligned device int) when the
// configuration uses it.
bool fwd_call_ok(const FwdParams& p, bool needs_tile_counter) {
  if (p.batch < 0 || p.seqlen_q < 0 || p.seqlen_k < 0 || p.num_heads <= 0 || p.num_heads_k <= 0)
    return false;
  if (p.num_heads % p.num_heads_k != 0) return false;
  if (p.lse == nullptr) return false;
  if ((p.q_segment == nullptr) != (p.kv_segment == nullptr)) return false;
  if (!(p.scale > 0.f) || !(p.softcap >= 0.f)) return false;
  // Tile count (blocks of >= 64 rows x heads x batch) fits an int.
  if (int64_t(p.batch) * p.num_heads * ((int64_t(p.seqlen_q) + 63) / 64) >= (int64_t(1) << 31))
    return false;
  if (needs_tile_counter &&
      (p.sm90_tile_counter == nullptr || (reinterpret_cast<uintptr_t>(p.sm90_tile_counter) & 3) != 0))
    return false;
  return true;
}

template <int kD, int kDv>
bool varlen_shape_ok(const FwdParams& p, const DeviceInfo& dev) {
  using Bf16 = __nv_bfloat16;
  const MaskInfo mi = make_mask_info(p);
  const int alloc = fwd_causal_like(mi.wl, mi.wr) ? VarlenFwdKernelFor<Bf16, kD, kDv, true>::type::kSmemAlloc
                                                  : VarlenFwdKernelFor<Bf16, kD, kDv, false>::type::kSmemAlloc;
  return alloc <= dev.smem_optin;
}

template <typename Element>
cudaError_t fwd_varlen_dtype(const VarlenFwdParams& p, cudaStream_t stream) {
  return dispatch_shape(p, cudaErrorNotSupported, [&](auto shape) {
    using S = decltype(shape);
    return run_fwd_varlen_hdim<Element, S::kHeadDim, S::kHeadDimV>(p, stream);
  });
}

}  // namespace

// The 16-bit forwards' head dims, dtype and operand layouts (the dense and
// the varlen kernels): one head dim for q, k and v (its bucket, zero-padded),
// or a head-dim pair with sm90 kernels (exact; the sm80 family serves the
// other pairs); bf16 or fp16.
static bool operands16_ok(const FwdParams& p) {
  if (p.head_dim_v == p.head_dim ? Sm90FwdHeadDims::bucket(p.head_dim) == 0
                                 : !Sm90FwdHeadDimPairs::contains(p.head_dim, p.head_dim_v))
    return false;
#ifdef JAX_FLASH_DISABLE_FP16
  if (p.dtype != DType::kBFloat16) return false;
#else
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16) return false;
#endif
  if (!tensor_ok(p.q, p.seqlen_q, p.num_heads, p.batch, p.q_row_stride, p.q_head_stride,
                 p.q_batch_stride) ||
      !tensor_ok(p.k, p.seqlen_k, p.num_heads_k, p.batch, p.k_row_stride, p.k_head_stride,
                 p.k_batch_stride) ||
      !tensor_ok(p.v, p.seqlen_k, p.num_heads_k, p.batch, p.v_row_stride, p.v_head_stride,
                 p.v_batch_stride) ||
      !tensor_ok(p.o, p.seqlen_q, p.num_heads, p.batch, p.o_row_stride, p.o_head_stride,
                 p.o_batch_stride))
    return false;
  return true;
}

bool fwd_varlen_supported(const VarlenFwdParams& p) {
  if (!fwd_call_ok(p, true)) return false;
  if (p.cu_seqlens_q == nullptr || p.cu_seqlens_k == nullptr || p.num_seqs < 1) return false;
  if (p.q_segment != nullptr || p.dropout.enabled()) return false;
  if (p.head_dim <= 0 || p.head_dim % 8 != 0 || p.head_dim_v % 8 != 0) return false;
  if (!operands16_ok(p)) return false;
  // The tile bound (VarlenOrder::max_tiles) fits an int.
  if (int64_t(p.num_heads) * p.batch * ((int64_t(p.seqlen_q) + 63) / 64 + p.num_seqs) >= (int64_t(1) << 31))
    return false;
  const DeviceInfo dev = device_info();
  if (!dev.sm90) return false;
  return dispatch_shape(p, false, [&](auto shape) {
    using S = decltype(shape);
    return varlen_shape_ok<S::kHeadDim, S::kHeadDimV>(p, dev);
  });
}

cudaError_t run_fwd_varlen(const VarlenFwdParams& p, cudaStream_t stream) {
  if (!fwd_varlen_supported(p)) return cudaErrorNotSupported;
  if (p.batch == 0 || p.seqlen_q == 0) return cudaSuccess;
  return dispatch_dtype(p.dtype, [&](auto e) { return fwd_varlen_dtype<typename decltype(e)::type>(p, stream); });
}

bool fwd_fp8_supported(const Fp8FwdParams& p) {
  if (!fwd_call_ok(p, fwd_fp8_needs_tile_counter(p))) return false;
  if (!Sm90Fp8HeadDims::contains(p.head_dim)) return false;
  if (p.dtype != DType::kFloat8E4M3) return false;
#ifdef JAX_FLASH_DISABLE_FP16
  if (p.out_dtype != DType::kBFloat16) return false;
#else
  if (p.out_dtype != DType::kBFloat16 && p.out_dtype != DType::kFloat16) return false;
#endif
  if (p.q_descale == nullptr || p.k_descale == nullptr || p.v_descale == nullptr) return false;
  if (!tensor_ok(p.q, p.seqlen_q, p.num_heads, p.batch, p.q_row_stride, p.q_head_stride,
                 p.q_batch_stride, 1) ||
      !tensor_ok(p.k, p.seqlen_k, p.num_heads_k, p.batch, p.k_row_stride, p.k_head_stride,
                 p.k_batch_stride, 1) ||
      !tensor_ok(p.v, p.seqlen_k, p.num_heads_k, p.batch, p.v_row_stride, p.v_head_stride,
                 p.v_batch_stride, 1) ||
      !tensor_ok(p.o, p.seqlen_q, p.num_heads, p.batch, p.o_row_stride, p.o_head_stride,
                 p.o_batch_stride))
    return false;
  const DeviceInfo dev = device_info();
  if (!dev.sm90) return false;
  return dispatch_head_dim(Sm90Fp8HeadDims{}, p.head_dim, false,
                           [&](auto d) { return fp8_bucket_ok<decltype(d)::value>(p, dev); });
}

bool fwd_fp8_needs_tile_counter(const Fp8FwdParams& p) {
  const MaskInfo mi = make_mask_info(p);
  return fwd_default_tuning(p.head_dim, p.head_dim, fwd_causal_like(mi.wl, mi.wr), 1).dynamic_scheduler;
}

cudaError_t run_fwd_fp8(const Fp8FwdParams& p, cudaStream_t stream) {
  if (!fwd_fp8_supported(p)) return cudaErrorNotSupported;
  if (p.batch == 0 || p.seqlen_q == 0) return cudaSuccess;
  return dispatch_dtype(p.out_dtype, [&](auto e) { return fwd_fp8_out<typename decltype(e)::type>(p, stream); });
}

bool fwd_supported(const FwdParams& p) {
  if (!fwd_call_ok(p, fwd_needs_tile_counter(p))) return false;
  if (p.head_dim <= 0 || p.head_dim % 8 != 0) return false;
  if (!operands16_ok(p)) return false;
  const DeviceInfo dev = device_info();
  if (!dev.sm90) return false;
  return shape_compiled_and_ok(p, dev);
}

bool fwd_needs_tile_counter(const FwdParams& p) {
  const MaskInfo mi = make_mask_info(p);
  const bool pair = p.head_dim_v != p.head_dim;  // served exactly (dispatch_shape)
  const int d = pair ? p.head_dim : Sm90FwdHeadDims::bucket(p.head_dim);
  return fwd_default_tuning(d, pair ? p.head_dim_v : d, fwd_causal_like(mi.wl, mi.wr)).dynamic_scheduler;
}

cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream) {
  if (!fwd_supported(p)) return cudaErrorNotSupported;
  if (p.batch == 0 || p.seqlen_q == 0) return cudaSuccess;  // nothing to write
  return dispatch_dtype(p.dtype, [&](auto e) { return fwd_dtype<typename decltype(e)::type>(p, stream); });
}

}  // namespace jax_flash::sm90
