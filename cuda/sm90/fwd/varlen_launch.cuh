// Host side of the variable-length sm90 forward: from VarlenFwdParams to
// the launches. Included by the generated files
// cuda/instantiations/fwd_varlen_*_sm90.cu (run_fwd_varlen_hdim).
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "fwd_varlen_kernel.cuh"
#include "instantiations.h"
#include "jax_flash/sinks.h"
#include "launch_templates.cuh"  // launch_kernel
#include "sm90/common/tma_desc.h"

namespace jax_flash::sm90 {

constexpr int kVarlenOutsideRows = 16;  // rows per CTA of varlen_zero_outside

// Rows of each batch row outside its sequences ([0, cu_q[b, 0]) and
// [cu_q[b, num_seqs], seqlen_q)): O = 0, LSE = the sink or -inf, as a row
// that sees no key. One CTA per kVarlenOutsideRows rows of a batch row; a
// CTA whose rows are all inside returns at once.
template <typename Element>
__global__ void __launch_bounds__(128)
    varlen_zero_outside(const VarlenFwdParams p) {
  const int b = blockIdx.y;
  const int r0 = blockIdx.x * kVarlenOutsideRows;
  const int32_t* cu = p.cu_seqlens_q + int64_t(b) * (p.num_seqs + 1);
  const int first = __ldg(cu), last = __ldg(cu + p.num_seqs);
  const int chunks = p.head_dim_v / 8;  // 16 bytes of 16-bit elements
  const int per_row = p.num_heads * chunks;
  for (int i = threadIdx.x; i < kVarlenOutsideRows * per_row; i += blockDim.x) {
    const int r = r0 + i / per_row;
    if (r >= p.seqlen_q || (r >= first && r < last)) continue;
    const int rest = i % per_row, h = rest / chunks, c = rest % chunks;
    char* o = reinterpret_cast<char*>(p.o) +
              (int64_t(b) * p.o_batch_stride + int64_t(r) * p.o_row_stride + int64_t(h) * p.o_head_stride + 8 * c) *
                  int64_t(sizeof(Element));
    *reinterpret_cast<uint4*>(o) = make_uint4(0u, 0u, 0u, 0u);
    if (c == 0)
      p.lse[(int64_t(b) * p.num_heads + h) * p.seqlen_q + r] = sink_of(p.sinks, b, h, p.num_heads);
  }
}

// Launches the varlen configuration of (Element, kHeadDim, kHeadDimV) for
// the call's mask kind on a call that fwd_varlen_supported accepted.
template <typename Element, int kHeadDim, int kHeadDimV, bool kCausalLike>
cudaError_t launch_fwd_varlen(const VarlenFwdParams& p, cudaStream_t stream) {
  using Kernel = typename VarlenFwdKernelFor<Element, kHeadDim, kHeadDimV, kCausalLike>::type;
  using Mainloop = typename Kernel::Mainloop;
  if (p.varlen_outside) {
    const dim3 grid((p.seqlen_q + kVarlenOutsideRows - 1) / kVarlenOutsideRows, p.batch);
    varlen_zero_outside<Element><<<grid, 128, 0, stream>>>(p);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  const MaskInfo mask = make_mask_info(p);
  const SoftmaxScale sm = make_softmax_scale(p.scale, p.softcap);
  const int heads_per_kv = p.num_heads / p.num_heads_k;
  const int sms = p.num_sms > 0 ? p.num_sms : device_attribute<cudaDevAttrMultiProcessorCount>(1);
  VarlenOrder order;
  order.cu_q = p.cu_seqlens_q;
  order.cu_k = p.cu_seqlens_k;
  order.batch = p.batch;
  order.num_seqs = p.num_seqs;
  order.total_q = p.seqlen_q;
  order.total_k = p.seqlen_k;
  order.num_heads = p.num_heads;
  // head bytes: the mean of K's and V's rows, so that a section holds a head's K and V.
  order.heads_per_section = VarlenOrder::l2_section_heads(
      p.batch, p.seqlen_k, (Mainloop::kHeadDim + Mainloop::kHeadDimV) / 2 * int(sizeof(Element)), p.num_heads,
      heads_per_kv);
  order.block_m = Mainloop::kBlockM;
  order.block_n = Mainloop::kBlockN;
  order.causal_like = kCausalLike;
  const typename Kernel::Arguments args{
      {fwd_q(p), fwd_k(p), fwd_v(p), mask, sm, heads_per_kv, {}, DropoutArgs{}},
      {fwd_o(p), p.lse, sm.scale_eff, nullptr, heads_per_kv, 1.f, p.sinks},
      {order, p.sm90_tile_counter, sms}};
  return launch_kernel<Kernel>(args, sms, p.sm90_tile_counter, stream);
}

template <typename Element, int kHeadDim, int kHeadDimV>
cudaError_t run_fwd_varlen_hdim(const VarlenFwdParams& p, cudaStream_t stream) {
  const MaskInfo mi = make_mask_info(p);
  if (fwd_causal_like(mi.wl, mi.wr)) return launch_fwd_varlen<Element, kHeadDim, kHeadDimV, true>(p, stream);
  return launch_fwd_varlen<Element, kHeadDim, kHeadDimV, false>(p, stream);
}

}  // namespace jax_flash::sm90
