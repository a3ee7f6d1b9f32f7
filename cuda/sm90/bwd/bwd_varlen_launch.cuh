// Host side of the variable-length sm90 backward: from VarlenBwdParams to
// the launches (dq_accum zeroed, dK / dV zeroed on the keys outside every
// sequence, the main kernel, dq_convert). Included by the generated files
// cuda/instantiations/bwd_varlen_*_sm90.cu (run_bwd_varlen_hdim).
#pragma once

#include <cuda_runtime.h>

#include <cstring>

#include "bwd_launch_templates.cuh"  // launch_dq_convert, bwd_default_tile
#include "bwd_varlen_kernel.cuh"

namespace jax_flash::sm90 {

constexpr int kVarlenBwdOutsideRows = 16;  // key rows per CTA of varlen_bwd_zero_outside

// Keys of each batch row outside its sequences ([0, cu_k[b, 0]) and
// [cu_k[b, num_seqs], seqlen_k)): dK = dV = 0 (no query sees them; the main
// kernel writes every key inside a sequence). A CTA whose rows are all
// inside returns at once.
template <typename Element>
__global__ void __launch_bounds__(128) varlen_bwd_zero_outside(const VarlenBwdParams p) {
  const int b = blockIdx.y;
  const int r0 = blockIdx.x * kVarlenBwdOutsideRows;
  const int32_t* cu = p.cu_seqlens_k + int64_t(b) * (p.num_seqs + 1);
  const int first = __ldg(cu), last = __ldg(cu + p.num_seqs);
  const int ck = p.head_dim / 8, cv = p.head_dim_v / 8;  // 16-byte chunks of a K / V row
  const int per_row = p.num_heads_k * (ck + cv);
  for (int i = threadIdx.x; i < kVarlenBwdOutsideRows * per_row; i += blockDim.x) {
    const int r = r0 + i / per_row;
    if (r >= p.seqlen_k || (r >= first && r < last)) continue;
    const int rest = i % per_row, h = rest / (ck + cv), c = rest % (ck + cv);
    const bool is_k = c < ck;
    const int64_t off = is_k ? int64_t(b) * p.k_batch_stride + int64_t(r) * p.k_row_stride +
                                   int64_t(h) * p.k_head_stride + 8 * c
                             : int64_t(b) * p.v_batch_stride + int64_t(r) * p.v_row_stride +
                                   int64_t(h) * p.v_head_stride + 8 * (c - ck);
    char* base = static_cast<char*>(is_k ? p.dk : p.dv);
    *reinterpret_cast<uint4*>(base + off * int64_t(sizeof(Element))) = make_uint4(0u, 0u, 0u, 0u);
  }
}

// One config (BaseCfg: the dense backward's tile for the call's mask).
template <typename Element, typename BaseCfg>
cudaError_t launch_bwd_varlen(const VarlenBwdParams& p, cudaStream_t stream) {
  using Plain = typename VarlenBwdKernelFor<Element, BaseCfg, false>::type;
  using Cfg = typename Plain::Cfg;
  const MaskInfo mask = make_mask_info(p);
  const int group = p.num_heads / p.num_heads_k;
  const GmemTensor dout{p.dout, p.head_dim_v, p.seqlen_q, p.num_heads, p.batch,
                        p.o_row_stride, p.o_head_stride, p.o_batch_stride};
  const GmemTensor dk{p.dk, p.head_dim, p.seqlen_k, p.num_heads_k, p.batch,
                      p.k_row_stride, p.k_head_stride, p.k_batch_stride};
  const GmemTensor dv{p.dv, p.head_dim_v, p.seqlen_k, p.num_heads_k, p.batch,
                      p.v_row_stride, p.v_head_stride, p.v_batch_stride};
  const VarlenBwdOrder order = VarlenBwdOrder::make(
      p.cu_seqlens_q, p.cu_seqlens_k, p.batch, p.num_seqs, p.seqlen_q, p.seqlen_k, p.num_heads_k, group,
      Cfg::kBlockN, (Cfg::kHeadDim + Cfg::kHeadDimV) * int(sizeof(Element)), mask.causal_like());
  const typename Plain::Arguments args{
      {fwd_q(p), fwd_k(p), fwd_v(p), dout, mask, make_softmax_scale(p.scale, p.softcap), p.lse, p.delta, group,
       {p.dq_accum, p.head_dim, p.seqlen_q, p.seqlen_q_rounded, p.head_dim_rounded, p.num_heads, p.batch,
        nullptr, 0},
       DropoutArgs{}},
      {dk, dv, p.scale},
      order,
      VarlenBwdOrder::max_tiles(p.batch, p.num_seqs, p.seqlen_k, p.num_heads_k, Cfg::kBlockN)};
  typename Plain::Params params;
  std::memset(&params, 0, sizeof(params));
  if (!Plain::to_params(args, params)) return cudaErrorNotSupported;

  cudaError_t err;
  if (p.seqlen_q > 0) {  // dq_accum is uninitialised on entry
    const size_t bytes =
        size_t(p.batch) * p.num_heads * size_t(p.seqlen_q_rounded) * p.head_dim_rounded * sizeof(float);
    err = cudaMemsetAsync(p.dq_accum, 0, bytes, stream);
    if (err != cudaSuccess) return err;
  }
  if (p.seqlen_k > 0) {
    const dim3 grid((p.seqlen_k + kVarlenBwdOutsideRows - 1) / kVarlenBwdOutsideRows, p.batch);
    varlen_bwd_zero_outside<Element><<<grid, 128, 0, stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (params.grid > 0) {
    auto kernel = p.softcap > 0.f ? bwd_varlen_kernel<Element, BaseCfg, true>
                                  : bwd_varlen_kernel<Element, BaseCfg, false>;
    err = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                               cudaFuncAttributeMaxDynamicSharedMemorySize, Plain::kSmemAlloc);
    if (err != cudaSuccess) return err;
    kernel<<<params.grid, Plain::kThreads, Plain::kSmemAlloc, stream>>>(params);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (p.seqlen_q == 0) return cudaSuccess;
  if constexpr (Cfg::kHeadDim == 64) {
    if (p.head_dim_rounded == 64) return launch_dq_convert<Element, 64>(p, stream);
  } else if constexpr (Cfg::kHeadDim == 128) {
    if (p.head_dim_rounded == 96) return launch_dq_convert<Element, 96>(p, stream);
    if (p.head_dim_rounded == 128) return launch_dq_convert<Element, 128>(p, stream);
  } else {
    if (p.head_dim_rounded == 256) return launch_dq_convert<Element, 256>(p, stream);
  }
  return cudaErrorNotSupported;
}

// The call's tile as the dense backward picks it (bwd_default_tile), not
// deterministic (bwd_varlen_supported), no dropout, no head-dim pair.
template <typename Element, int kHeadDim>
cudaError_t run_bwd_varlen_hdim(const VarlenBwdParams& p, cudaStream_t stream) {
  if (p.deterministic || p.dropout.enabled() || p.head_dim_v != p.head_dim) return cudaErrorNotSupported;
  if constexpr (kHeadDim == 128) {
    if (bwd_default_tile(kHeadDim, make_mask_info(p).bounded(), false) == BwdTileChoice::kBlockM80)
      return launch_bwd_varlen<Element, BwdConfigHd128Bm80>(p, stream);
  }
  return launch_bwd_varlen<Element, typename BwdConfigFor<kHeadDim>::type>(p, stream);
}

}  // namespace jax_flash::sm90
