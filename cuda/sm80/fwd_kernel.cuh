// FlashAttention-2 forward mainloop (sm80 instructions; runs on sm80..sm90).
//
// CTA = (query block, head, batch). The CTA loads its Q tile once, then sweeps
// the visible KV blocks from the last to the first (the ragged / diagonal
// blocks that need the element mask come first). Per KV block:
//
//   wait K[n] ----------------------------- barrier
//   issue cp.async V[n]                     (overlaps S = Q K^T)
//   S = Q K^T, softcap, mask if needed      (registers)
//   wait V[n] ----------------------------- barrier (all warps done with K[n])
//   issue cp.async K[n-1]                   (overlaps softmax and P V)
//   online softmax: P in registers, O rescaled
//   O += P V                                (P reused as the A operand)
//
// so one K tile and one V tile of shared memory give a two-stage pipeline.
//
// Dropout (kDropout): the keep bits of a block are drawn one block ahead,
// next to the previous block's O += P V (integer work that overlaps the
// tensor cores, where S is dead and registers are free); the softmax
// statistics stay those of the undropped P (so LSE is the undropped one),
// dropped P is zeroed before P V, and the final normalisation multiplies by
// keep_scale: O = (sum of dropped-P V) * keep_scale / rowsum.
#pragma once

#include "dropout.cuh"
#include "fwd_epilogue.cuh"
#include "kernel_traits.cuh"
#include "mask.cuh"
#include "softmax.cuh"
#include "warp_gemm.cuh"

namespace jax_flash::sm80 {

struct FwdKernelArgs {
  FwdParams p;
  MaskInfo mask;
  SoftmaxScale sm;
};

// kSoftcap: the one masking/score feature that is a template parameter. The
// tanh pass is then absent from the common kernel, which also lets ptxas keep
// the hdim-128 kernel free of spills on sm_90 (measured with -Xptxas -v).
// Everything else (causal, window, segment ids, ragged lengths) is a runtime
// branch on block-uniform values.
// kPacked: packed sequences (segment ids with tile spans, mask_info.h): KV
// ranges and masks from the spans, in kernels of their own so that the code
// does not weigh on the others' registers.
// kDropout: attention dropout (p.dropout), also kernels of their own.
template <typename Element, typename Cfg, bool kSoftcap, bool kPacked = false,
          bool kDropout = false>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fwd_kernel(const __grid_constant__ FwdKernelArgs args) {
  JF_SMEM(smem);
  check_smem_alignment(smem);
  const FwdParams& p = args.p;
  const int tid = threadIdx.x;

  // Heavy (late, for causal) query blocks are scheduled first: shorter tail.
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int head_k = head / (p.num_heads / p.num_heads_k);
  const int m0 = m_block * Cfg::kBlockM;

  // Read from parameter space where used (keeps registers free).
  const MaskInfo& mi = args.mask;

  // Global pointers of this (batch, head), rebuilt where they are used from
  // laundered indices (a couple of IMADs) so that they are not held in
  // registers across the KV loop.
  auto q_ptr = [&](int b, int h) {
    return static_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride +
           m0 * p.q_row_stride;
  };
  auto k_ptr = [&](int b, int hk) {
    return static_cast<const Element*>(p.k) + b * p.k_batch_stride + hk * p.k_head_stride;
  };
  auto v_ptr = [&](int b, int hk) {
    return static_cast<const Element*>(p.v) + b * p.v_batch_stride + hk * p.v_head_stride;
  };
  auto o_ptr = [&](int b, int h) {
    return static_cast<Element*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride +
           m0 * p.o_row_stride;
  };
  auto lse_ptr = [&](int b, int h) {
    return p.lse + (int64_t(b) * p.num_heads + h) * p.seqlen_q + m0;
  };
  const int rows_valid = p.seqlen_q - m0;

  int n_first, n_last;
  if constexpr (kPacked) {
    mi.kv_block_range(batch, m0, Cfg::kBlockM, Cfg::kBlockN, n_first, n_last);
  } else {
    mi.BlockMath<MaskInfo>::kv_block_range(m0, Cfg::kBlockM, Cfg::kBlockN, n_first, n_last);
  }
  if (n_last <= n_first) {  // every row fully masked: O = 0, LSE = -inf (or the sink)
    write_empty_rows<Element, Cfg>(o_ptr(batch, head), p.o_row_stride, lse_ptr(batch, head),
                                   rows_valid, value_head_dim<Cfg>(p), tid,
                                   sink_of(p.sinks, batch, head, p.num_heads));
    return;
  }

  const uint32_t sQ = smem_addr(smem + Cfg::kSmemQ);
  const uint32_t sK = smem_addr(smem + Cfg::kSmemK);
  const uint32_t sV = smem_addr(smem + Cfg::kSmemV);
  using QTile = typename Cfg::QTile;
  using KTile = typename Cfg::KTile;
  using VTile = typename Cfg::VTile;
  constexpr int kT = Cfg::kThreads;

  // Prologue: Q and the first (last-indexed) K tile.
  load_tile_async<QTile, kT>(sQ, q_ptr(batch, head), p.q_row_stride, rows_valid, p.head_dim, tid);
  {
    const int n0 = (n_last - 1) * Cfg::kBlockN;
    load_tile_async<KTile, kT>(sK, k_ptr(batch, head_k) + n0 * p.k_row_stride, p.k_row_stride,
                               p.seqlen_k - n0, p.head_dim, tid);
  }
  cp_async_commit();

  float acc_o[Cfg::kMT][Cfg::kNT_O][4];
  zero(acc_o);
  OnlineSoftmax<Cfg::kMT> softmax;
  softmax.init();
  const float softcap_pre = args.sm.softcap_pre;
  const float scale_log2 = args.sm.scale_log2;
  // Dropout: the keep bits of the block to come, drawn one block ahead
  // (during the previous P V) and kept in shared memory until the softmax is
  // done (registers are short in between: S and O); the key words from
  // device memory for the first draw, then from their shared-memory slot
  // (dropout.cuh). Smem past the tiles: the key words, then the bits.
  using Keep = FragKeep<Cfg::kMT, Cfg::kNT_S>;
  auto draw_keep = [&](const Dropout& d, int n) {
    const int t = opaque_tid();
    Keep keep;
    keep.draw(d, launder(batch), launder(head), m0 + (t / 32) * Cfg::kMT * 16, n * Cfg::kBlockN,
              t % 32);
    keep.template store<Cfg::kThreads>(smem + Cfg::kSmemBytes + kDropoutSmemBytes, t);
  };
  if constexpr (kDropout) {
    const Dropout d(p.dropout);
    stash_dropout_words(smem + Cfg::kSmemBytes, d, tid);
    draw_keep(d, n_last - 1);
  }

  for (int n = n_last - 1; n >= n_first; --n) {
    const int n0 = n * Cfg::kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // K[n] visible to all; every warp is done with V[n+1]
    load_tile_async<VTile, kT>(sV, v_ptr(launder(batch), launder(head_k)) + n0 * p.v_row_stride,
                               p.v_row_stride, p.seqlen_k - n0, value_head_dim<Cfg>(p), opaque_tid());
    cp_async_commit();

    // Lane/warp coordinates are re-derived from a fresh %tid.x in each phase
    // (see opaque_tid): cheaper than keeping them live next to S and O.
    float acc_s[Cfg::kMT][Cfg::kNT_S][4];
    zero(acc_s);
    {
      const int t = opaque_tid();
      gemm_ss<Element, Cfg::kMT, Cfg::kNT_S, Cfg::kHeadDim, false, false, QTile, KTile>(
          acc_s, sQ, (t / 32) * Cfg::kMT * 16, sK, 0, LdsmLane{t % 32});
    }
    if constexpr (kSoftcap) apply_softcap(acc_s, softcap_pre);
    if constexpr (kPacked) {
      if (mi.block_needs_mask(batch, m0, Cfg::kBlockM, n0, Cfg::kBlockN)) {
        const int t = opaque_tid();
        apply_mask<true>(acc_s, mi, batch, m0 + (t / 32) * Cfg::kMT * 16, n0, t % 32,
                         mi.rows_exact(batch, m0, Cfg::kBlockM));
      }
    } else {
      if (mi.block_needs_mask_by_position(m0, Cfg::kBlockM, n0, Cfg::kBlockN)) {
        const int t = opaque_tid();
        apply_mask<false>(acc_s, mi, batch, m0 + (t / 32) * Cfg::kMT * 16, n0, t % 32, false);
      }
    }

    cp_async_wait<0>();
    __syncthreads();  // V[n] visible to all; every warp is done with K[n]
    if (n > n_first) {
      const int n0_next = n0 - Cfg::kBlockN;
      load_tile_async<KTile, kT>(sK, k_ptr(launder(batch), launder(head_k)) + n0_next * p.k_row_stride,
                                 p.k_row_stride, p.seqlen_k - n0_next, p.head_dim, opaque_tid());
      cp_async_commit();
    }

    if (n == n_last - 1)
      softmax.template update<true>(acc_s, acc_o, scale_log2);
    else
      softmax.template update<false>(acc_s, acc_o, scale_log2);
    if constexpr (kDropout) {  // dropped P = 0 (the row sums keep it)
      Keep keep;
      keep.template load<Cfg::kThreads>(smem + Cfg::kSmemBytes + kDropoutSmemBytes, opaque_tid());
      keep.apply(acc_s);
    }

    uint32_t p_frag[Cfg::kMT][Cfg::kNT_S / 2][4];
    pack_c_to_a<Element>(p_frag, acc_s);
    // The next block's bits (unconditionally, past the first block too, so
    // the integer work stays in one block with the P V products).
    if constexpr (kDropout) draw_keep(stashed_dropout(smem + Cfg::kSmemBytes, p.dropout), n - 1);
    gemm_rs<Element, Cfg::kMT, Cfg::kNT_O, Cfg::kBlockN, true, VTile, true>(
        acc_o, p_frag, sV, 0, LdsmLane{opaque_tid() % 32});
  }

  float lse_rows[Cfg::kMT][2];
  softmax.finalize(acc_o, args.sm.scale_eff, lse_rows, sink_of(p.sinks, batch, head, p.num_heads));
  if constexpr (kDropout) {  // O = (sum of dropped-P V) * keep_scale / rowsum
    const float keep_scale = dropout_keep_scale(p.dropout);
#pragma unroll
    for (int i = 0; i < Cfg::kMT; ++i)
#pragma unroll
      for (int n = 0; n < Cfg::kNT_O; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc_o[i][n][j] *= keep_scale;
  }
  // The last iteration's second barrier ordered every warp's reads of Q before
  // this point, so the Q tile can hold the output.
  const int b = launder(batch), h = launder(head);
  write_output<Element, Cfg>(smem + Cfg::kSmemQ, acc_o, lse_rows, o_ptr(b, h), p.o_row_stride,
                             lse_ptr(b, h), rows_valid, value_head_dim<Cfg>(p),
                             (tid / 32) * Cfg::kMT * 16, tid);
}

}  // namespace jax_flash::sm80
