// Host side of the sm90 backward: TMA descriptors, kernel arguments, the
// dq_accum zeroing, the main kernel and the dq_convert post-pass shared with
// the sm80 family (jax_flash/dq_convert.cuh: dq = scale * dq_accum -> input
// dtype).
// Included only by the generated files cuda/instantiations/bwd_*_sm90.cu.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "bwd_instantiations.h"
#include "bwd_kernel.cuh"
#include "bwd_policy.h"
#include "sm90/common/tma_desc.h"  // encode_bshd
#include "jax_flash/dq_convert.cuh"

namespace jax_flash::sm90 {

// dq = scale * dq_accum ([b, h, seqlen_q_rounded, kPitch] fp32) in q's layout.
template <typename Element, int kPitch>
cudaError_t launch_dq_convert(const BwdParams& p, cudaStream_t stream) {
  dq_convert_kernel<Element, kPitch><<<dq_convert_grid(p, kPitch), kDqConvertThreads, 0, stream>>>(
      DqConvertArgs{p});
  return cudaGetLastError();
}

// dq_accum [batch, heads, seqlen_q_rounded, pitch] fp32 as a 4-d map
// (head_dim, seqlen_q, heads, batch): the reductions skip the columns past
// head_dim and the rows past seqlen_q. 128B swizzle, box {32, box_rows, 1, 1}
// (box_rows = BwdConfig::kDqRows: 64; 80 with dQ_swapAB).
inline bool encode_dq_accum(CUtensorMap* map, float* ptr, int head_dim, int seqlen_q,
                            int seqlen_q_rounded, int pitch, int heads, int batch, int box_rows = 64) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t row = cuuint64_t(pitch) * 4, head = row * cuuint64_t(seqlen_q_rounded),
                   bat = head * cuuint64_t(heads);
  cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(std::max(seqlen_q, 1)), cuuint64_t(heads),
                        cuuint64_t(batch)};
  cuuint64_t strides[3] = {row, head, bat};
  cuuint32_t box[4] = {32, cuuint32_t(box_rows), 1, 1};
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, ptr, dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// The main kernel on its scheduler (grid, workspace set-up, launch).
template <typename Element, typename Cfg, bool kDqTensor, bool kDet>
cudaError_t launch_bwd_kernel(const BwdKernelArgs& args,
                              const typename BwdTileScheduler<kDet>::Arguments& sched, float softcap,
                              cudaStream_t stream) {
  using Scheduler = BwdTileScheduler<kDet>;
  const BwdKernelParams<Scheduler> params{args, Scheduler::to_params(sched)};
  const int grid = Scheduler::grid_size(params.scheduler, 0);
  if (grid == 0) return cudaSuccess;  // every KV block runs, also those no query sees (dK = dV = 0)
  cudaError_t err = Scheduler::prepare(params.scheduler, stream);
  if (err != cudaSuccess) return err;
  const bool packed = args.mask.q_span != nullptr;  // packed sequences: their own kernels
  auto kernel = softcap > 0.f ? (packed ? bwd_kernel<Element, Cfg, true, kDqTensor, kDet, true>
                                        : bwd_kernel<Element, Cfg, true, kDqTensor, kDet, false>)
                              : (packed ? bwd_kernel<Element, Cfg, false, kDqTensor, kDet, true>
                                        : bwd_kernel<Element, Cfg, false, kDqTensor, kDet, false>);
  err = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                             cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemAlloc);
  if (err != cudaSuccess) return err;
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemAlloc, stream>>>(params);
  return cudaGetLastError();
}

// One tile: the config Cfg, and how dQ reaches dq_accum: kDqTensor, by TMA
// tensor reductions of each staged tile (production); else by one bulk
// reduction per row (kept for measurements only, cuda/tests/sm90_bwd_tuning.h).
template <typename Element, typename Cfg, bool kDqTensor = true>
cudaError_t launch_bwd(const BwdParams& p, cudaStream_t stream) {
  static_assert(kDqTensor || !Cfg::kDqSwapAB, "dQ_swapAB: tensor reductions only");
  // Deterministic kernels: tensor reductions only, with the semaphore workspace.
  if (p.deterministic && (!kDqTensor || p.sm90_dq_semaphore == nullptr)) return cudaErrorNotSupported;
  BwdKernelArgs args;
  std::memset(&args, 0, sizeof(args));
  const int hd = p.head_dim;
  // dK / dV have the layouts (strides) of K / V; dO has O's.
  if (!encode_bshd(&args.tm_q, p.dtype, p.q, hd, p.seqlen_q, p.num_heads, p.batch, p.q_row_stride,
                   p.q_head_stride, p.q_batch_stride, Cfg::kBlockM) ||
      !encode_bshd(&args.tm_do, p.dtype, p.dout, hd, p.seqlen_q, p.num_heads, p.batch,
                   p.o_row_stride, p.o_head_stride, p.o_batch_stride, Cfg::kBlockM) ||
      !encode_bshd(&args.tm_k, p.dtype, p.k, hd, p.seqlen_k, p.num_heads_k, p.batch, p.k_row_stride,
                   p.k_head_stride, p.k_batch_stride, Cfg::kBlockN) ||
      !encode_bshd(&args.tm_v, p.dtype, p.v, hd, p.seqlen_k, p.num_heads_k, p.batch, p.v_row_stride,
                   p.v_head_stride, p.v_batch_stride, Cfg::kBlockN) ||
      !encode_bshd(&args.tm_dk, p.dtype, p.dk, hd, p.seqlen_k, p.num_heads_k, p.batch,
                   p.k_row_stride, p.k_head_stride, p.k_batch_stride, 64) ||
      !encode_bshd(&args.tm_dv, p.dtype, p.dv, hd, p.seqlen_k, p.num_heads_k, p.batch,
                   p.v_row_stride, p.v_head_stride, p.v_batch_stride, 64) ||
      !encode_dq_accum(&args.tm_dqacc, p.dq_accum, hd, p.seqlen_q, p.seqlen_q_rounded,
                       p.head_dim_rounded, p.num_heads, p.batch, Cfg::kDqRows))
    return cudaErrorNotSupported;
  args.mask = make_mask_info(p);
  // The deterministic dQ order (bwd_mask.cuh dq_pred_range) needs the
  // positional query-block ranges, monotone in the KV block: the kv spans
  // must not narrow them (the q spans still spare interior blocks the mask).
  if (p.deterministic) args.mask.kv_span = nullptr;
  // kBlockM 80 (FA3's non-causal tile) only without a causal / local bound.
  if (Cfg::kDqSwapAB && args.mask.bounded()) return cudaErrorNotSupported;
  args.sm = make_softmax_scale(p.scale, p.softcap);
  const int group = p.num_heads / p.num_heads_k;
  args.scale = p.scale;
  args.lse = p.lse;
  args.delta = p.delta;
  args.dq_accum = p.dq_accum;
  args.num_heads = p.num_heads;
  args.heads_per_kv = group;
  args.seqlen_q_rounded = p.seqlen_q_rounded;
  args.dq_pitch = p.head_dim_rounded;
  args.head_dim = hd;
  // The scheduler's order; deterministic kernels: its claim counter is the
  // workspace's first int, the semaphores per (batch, q head, query block)
  // follow (bwd_supported: the workspace is set).
  const bool det = p.deterministic;
  const BwdTileOrderArguments order{p.batch,       p.num_heads_k, group,
                                    p.seqlen_k,    p.seqlen_q,    Cfg::kHeadDim,
                                    int(sizeof(Element)), Cfg::kBlockN, args.mask.causal_like()};
  if (det) {
    args.sem_m_blocks = (p.seqlen_q + Cfg::kBlockM - 1) / Cfg::kBlockM;
    args.dq_sem = p.sm90_dq_semaphore + 1;  // 1 + its ints <= sm90_bwd_semaphore_ints
  }

  cudaError_t err;
  if (p.seqlen_q > 0) {  // dq_accum is uninitialised on entry
    const size_t bytes =
        size_t(p.batch) * p.num_heads * size_t(p.seqlen_q_rounded) * p.head_dim_rounded * sizeof(float);
    err = cudaMemsetAsync(p.dq_accum, 0, bytes, stream);
    if (err != cudaSuccess) return err;
  }
  if (det) {
    // Deterministic kernels only for the bucket tiles with tensor reductions
    // (bwd_default_tile); the dQ_swapAB tile has none.
    if constexpr (!Cfg::kDqSwapAB && kDqTensor) {
      if (p.seqlen_k > 0) {  // else no kernel, no semaphores to reset
        const size_t sem_ints = size_t(p.batch) * p.num_heads * args.sem_m_blocks;
        err = cudaMemsetAsync(args.dq_sem, 0, sem_ints * sizeof(int32_t), stream);
        if (err != cudaSuccess) return err;
      }
      err = launch_bwd_kernel<Element, Cfg, true, true>(args, {order, p.sm90_dq_semaphore}, p.softcap, stream);
    } else {
      return cudaErrorNotSupported;
    }
  } else {
    err = launch_bwd_kernel<Element, Cfg, kDqTensor, false>(args, {order, nullptr}, p.softcap, stream);
  }
  if (err != cudaSuccess) return err;
  if (p.seqlen_q == 0) return cudaSuccess;
  // The dq_accum row pitch is the workspace's head_dim_rounded (96 for head
  // dims 65..96, which this kernel runs in the 128 bucket; 256 for 129..256).
  if constexpr (Cfg::kHeadDim == 64) {
    if (p.head_dim_rounded == 64) return launch_dq_convert<Element, 64>(p, stream);
  } else if constexpr (Cfg::kHeadDim == 128) {
    if (p.head_dim_rounded == 96) return launch_dq_convert<Element, 96>(p, stream);
    if (p.head_dim_rounded == 128) return launch_dq_convert<Element, 128>(p, stream);
  } else {
    if (p.head_dim_rounded == 256) return launch_dq_convert<Element, 256>(p, stream);
  }
  return cudaErrorNotSupported;  // unreachable: bwd_supported checks the pitch
}

template <typename Element, int kHeadDim>
cudaError_t run_bwd_hdim(const BwdParams& p, cudaStream_t stream) {
  if constexpr (kHeadDim == 128) {
    if (bwd_default_tile(kHeadDim, make_mask_info(p).bounded(), p.deterministic) == BwdTileChoice::kBlockM80)
      return launch_bwd<Element, BwdConfigHd128Bm80>(p, stream);
  }
  return launch_bwd<Element, typename BwdConfigFor<kHeadDim>::type>(p, stream);
}

}  // namespace jax_flash::sm90
