// Host side of the sm90 forward: TMA descriptors, kernel arguments, launch.
// Included only by the generated files in cuda/instantiations/*_sm90.cu.
//
// cuTensorMapEncodeTiled is a driver API function; it is fetched through the
// runtime (cudaGetDriverEntryPointByVersion) so that the extension, which
// links cudart statically, never links libcuda.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "fwd_kernel.cuh"
#include "instantiations.h"
#include "jax_flash/device_attribute.h"

namespace jax_flash::sm90 {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// Stride in bytes of a dimension of `size` elements: any valid value when the
// dimension has a single index (the stride is then never used).
inline cuuint64_t stride_bytes(int64_t stride_elems, int64_t size) {
  const int64_t b = stride_elems * 2;
  if (size <= 1 && (b <= 0 || b % 16 != 0 || b >= (int64_t(1) << 40))) return 16;
  return cuuint64_t(b);
}

// [batch, seq, heads, head_dim] tensor as a 4-d map (head_dim, seq, heads,
// batch), 128B swizzle, box {64, box_rows, 1, 1}; out-of-bounds reads are 0.
inline bool encode_bshd(CUtensorMap* map, DType dtype, const void* ptr, int head_dim, int seqlen,
                        int heads, int batch, int64_t row_stride, int64_t head_stride,
                        int64_t batch_stride, int box_rows) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const int seq = std::max(seqlen, 1);  // never loaded when 0, but dims must be > 0
  cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(seq), cuuint64_t(heads), cuuint64_t(batch)};
  cuuint64_t strides[3] = {stride_bytes(row_stride, seq), stride_bytes(head_stride, heads),
                           stride_bytes(batch_stride, batch)};
  cuuint32_t box[4] = {64, cuuint32_t(box_rows), 1, 1};
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType dt =
      dtype == DType::kFloat16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const CUresult r = encode(map, dt, 4, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// balanced_grid: scheduler.cuh persistent_grid (tuning variant kVarBalancedGrid).
template <typename Element, typename Cfg, int kFlags>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream, bool balanced_grid = false) {
  FwdKernelArgs args;
  std::memset(&args, 0, sizeof(args));
  const int hd = p.head_dim;
  if (!encode_bshd(&args.tm_q, p.dtype, p.q, hd, p.seqlen_q, p.num_heads, p.batch, p.q_row_stride,
                   p.q_head_stride, p.q_batch_stride, Cfg::kBlockM) ||
      !encode_bshd(&args.tm_k, p.dtype, p.k, hd, p.seqlen_k, p.num_heads_k, p.batch, p.k_row_stride,
                   p.k_head_stride, p.k_batch_stride, Cfg::kBlockN) ||
      !encode_bshd(&args.tm_v, p.dtype, p.v, hd, p.seqlen_k, p.num_heads_k, p.batch, p.v_row_stride,
                   p.v_head_stride, p.v_batch_stride, Cfg::kBlockN) ||
      !encode_bshd(&args.tm_o, p.dtype, p.o, hd, p.seqlen_q, p.num_heads, p.batch, p.o_row_stride,
                   p.o_head_stride, p.o_batch_stride, 64))
    return cudaErrorNotSupported;
  args.mask = make_mask_info(p);
  args.sm = make_softmax_scale(p.scale, p.softcap);
  const bool causal_like = args.mask.wr >= 0 && args.mask.wl < 0;
  args.sched = make_scheduler(p.batch, p.num_heads, p.num_heads / p.num_heads_k, p.seqlen_q,
                              p.seqlen_k, Cfg::kHeadDim, Cfg::kBlockM, causal_like);
  if constexpr ((kFlags & kFlagDynamic) != 0) {
    // The call's own counter (FwdParams::sm90_tile_counter), zeroed below.
    args.sched.counter = p.sm90_tile_counter;
    if (args.sched.counter == nullptr) return cudaErrorNotSupported;
  }
  args.lse = p.lse;
  args.num_heads = p.num_heads;
  args.heads_per_kv = p.num_heads / p.num_heads_k;

  auto kernel = fwd_kernel<Element, Cfg, kFlags>;
  cudaError_t err = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemAlloc);
  if (err != cudaSuccess) return err;
  const int sms = p.num_sms > 0 ? p.num_sms : device_attribute<cudaDevAttrMultiProcessorCount>(1);
  const int grid = persistent_grid(args.sched.total, sms, balanced_grid);
  if (grid <= 0) return cudaSuccess;
  if constexpr ((kFlags & kFlagDynamic) != 0) {
    // Stream-ordered (a memset node under graph capture): every launch, graph
    // replay included, starts from 0 on a counter no other launch touches.
    err = cudaMemsetAsync(args.sched.counter, 0, sizeof(int), stream);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemAlloc, stream>>>(args);
  return cudaGetLastError();
}

// Variants >= 5 (instantiations.h): the dynamic-scheduler ones that
// default_variant() picks for causal-like masks, in every build and dtype; the
// other tuning variants in ablation builds, bf16 only.
template <typename Element, int kHeadDim>
cudaError_t run_fwd_tuning(const FwdParams& p, int variant, cudaStream_t stream,
                           bool balanced_grid = false) {
  using Cfg = typename FwdConfigFor<kHeadDim>::type;
  constexpr int kDef = Cfg::kDefaultFlags;
#ifdef JAX_FLASH_SM90_ABLATION
  constexpr bool kAblation = true;
#else
  constexpr bool kAblation = false;
#endif
  if constexpr (kHeadDim != 256 || kAblation) {
    if (variant == kVarDynamic)
      return launch_fwd<Element, Cfg, kDef | kFlagDynamic>(p, stream, balanced_grid);
  }
  if constexpr (kHeadDim == 256) {
    if (variant == kVarDynamicOInV)
      return launch_fwd<Element, FwdConfig256V, kDef | kFlagDynamic>(p, stream, balanced_grid);
  }
  if constexpr (kAblation && std::is_same_v<Element, __nv_bfloat16>) {
    if constexpr (kHeadDim == 256) {
      if (variant == kVarOInV) return launch_fwd<Element, FwdConfig256V, kDef>(p, stream);
    }
    if constexpr (kHeadDim == 128) {
      // Wider tiles: their own defaults (Q from shared memory, no room for it in registers).
      using C176 = FwdConfig128N176V;
      using C192V = FwdConfig128N192V;
      using C192Q = FwdConfig128N192Q;
      if (variant == kVarN176) return launch_fwd<Element, C176, C176::kDefaultFlags>(p, stream);
      if (variant == kVarN192) return launch_fwd<Element, C192V, C192V::kDefaultFlags>(p, stream);
      if (variant == kVarN192Q) return launch_fwd<Element, C192Q, C192Q::kDefaultFlags>(p, stream);
      if (variant == kVarQSmem) return launch_fwd<Element, Cfg, kDef & ~kFlagQInRegs>(p, stream);
    }
    if constexpr (kHeadDim == 64 || kHeadDim == 128) {
      if (variant == kVarEager) return launch_fwd<Element, Cfg, kDef | kFlagEagerRescale>(p, stream);
    }
  }
  return cudaErrorNotSupported;
}

template <typename Element, int kHeadDim>
cudaError_t run_fwd_hdim(const FwdParams& p, cudaStream_t stream) {
  using Cfg = typename FwdConfigFor<kHeadDim>::type;
  constexpr int kDef = Cfg::kDefaultFlags;
  constexpr bool kBf16 = std::is_same_v<Element, __nv_bfloat16>;
  if (!variant_available(p.sm90_variant, kHeadDim, kBf16, kDef)) return cudaErrorNotSupported;
  const MaskInfo mi = make_mask_info(p);
  const int variant = resolved_variant(p.sm90_variant, kHeadDim, mi.wr >= 0 && mi.wl < 0);
  const bool balanced = p.sm90_variant == kVarBalancedGrid;  // the default kernel, another grid
  if (variant >= 5) return run_fwd_tuning<Element, kHeadDim>(p, variant, stream, balanced);
  const int flags = variant_flags(variant, kDef);
  if (flags == kDef) return launch_fwd<Element, Cfg, kDef>(p, stream, balanced);
#ifdef JAX_FLASH_SM90_ABLATION
  // The other schedule combinations, for the ablation (one of them equals
  // kDef); the bucket's other default flags stay, except Q in registers
  // without the overlap schedule (mainloop.cuh: ptxas miscompiles it).
  constexpr int kKeep = kDef & ~kScheduleFlags;
  constexpr int kKeepSerial = kKeep & ~kFlagQInRegs;
  switch (flags & kScheduleFlags) {
    case 3: return launch_fwd<Element, Cfg, kKeep | 3>(p, stream);
    case 2: return launch_fwd<Element, Cfg, kKeep | 2>(p, stream);
    case 1: return launch_fwd<Element, Cfg, kKeepSerial | 1>(p, stream);
    case 0: return launch_fwd<Element, Cfg, kKeepSerial | 0>(p, stream);
    default: break;
  }
#endif
  return cudaErrorNotSupported;
}

}  // namespace jax_flash::sm90
