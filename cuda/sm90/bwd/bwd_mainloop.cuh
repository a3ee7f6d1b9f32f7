// The mainloop of the sm90 backward (see bwd_kernel.cuh for the overview):
// the producer warp's loads, the dQ writer warp (BwdDqAccumulator) and the
// consumer warpgroups' sweep over the tile's steps, for one element type,
// config (BwdConfig: tile shape, stages, work split) and variant.
//
// Producer warp (warp 0 of the producer warpgroup, all 32 lanes): K and V of
// the CTA's KV block once (full_kv); then per step (q head, query block) the
// Q and dO tiles by TMA into a kStages / kStagesDo ring, and the step's LSE
// (converted to log2 units; +inf for fully masked rows and rows past
// seqlen_q, so P = 0 there) and delta rows by plain loads into the matching
// stat stages. A full barrier completes when the 32 lanes have arrived (each
// after its stat stores: release) and the TMA bytes have landed.
//
// Mask warps (Cfg::kDropProducer: warps 2-3 of the producer warpgroup): per
// step, once the consumers released the step parity's mask buffers
// (empty_drop), both WGs' keep masks into them (the split's draw_masks), then
// full_drop.
//
// Consumer warpgroups, per step: S = Q K^T and dP = dO V^T issued here (each
// WG its share, as the work split lays them out), then the split's step
// (Split::step: P, dS, the dV / dK / dQ GEMMs, dQ to the writer warp, the
// Q / dO releases). The work split is the config's (BwdConfig::kSdpSwapAB):
//   BwdKeySplit    (bwd_key_split.cuh, hdim 64 / 128): each WG owns 64 keys;
//                  S^T, P^T, dS^T in registers, dV / dK from registers;
//   BwdColumnSplit (bwd_column_split.cuh, hdim 256): each WG owns 128 of the
//                  256 columns; P and dS through shared memory;
//   BwdPairSplit   (bwd_pair_split.cuh, the pair 192 / 128 on 64 x 96): each
//                  WG owns 48 keys, dK^T / dV^T (dKV_swapAB); P^T and dS^T
//                  through shared memory.
// dK and dV stay in registers for the whole sweep; the epilogue
// (bwd_epilogue.cuh) stores them.
#pragma once

#include <type_traits>

#include "bwd_column_split.cuh"
#include "bwd_dq.cuh"
#include "bwd_key_split.cuh"
#include "bwd_pair_split.cuh"
#include "bwd_tile.cuh"
#include "sm90/ptx/mbarrier.cuh"
#include "sm90/ptx/tma.cuh"
#include "sm90/ptx/wgmma.cuh"
#include "sm90/common/tma_desc.h"

namespace jax_flash::sm90 {

// kSoftcap, kPacked (packed sequences: the tile spans' query-block ranges
// and masks), kDet (the deterministic dQ order): kernels of their own.
// kDqTensor: how dQ reaches dq_accum (BwdDqAccumulator).
template <typename Element_, typename Cfg_, bool kSoftcap, bool kDqTensor, bool kDet, bool kPacked>
struct BwdMainloop {
  using Element = Element_;
  using Cfg = Cfg_;
  using Split = std::conditional_t<
      Cfg::kSdpSwapAB, BwdKeySplit<Element, Cfg, kSoftcap, kDqTensor, kPacked>,
      std::conditional_t<Cfg::kDkvSwapAB, BwdPairSplit<Element, Cfg, kSoftcap, kDqTensor, kPacked>,
                         BwdColumnSplit<Element, Cfg, kSoftcap, kDqTensor, kPacked>>>;
  using Dq = BwdDqAccumulator<Cfg, kDqTensor>;
  using Smem = BwdSmem<Cfg>;
  static constexpr int kBlockM = Cfg::kBlockM;
  static constexpr int kBlockN = Cfg::kBlockN;
  static constexpr int kKR = Split::kKR;  // dK registers per consumer thread
  static constexpr int kVR = Split::kVR;  // dV registers per consumer thread
  static constexpr int kSR = Split::kSR;  // S / dP registers per consumer thread
  // The dO ring has its own state only when it has fewer stages (hdim 256).
  static constexpr bool kSameStages = Cfg::kStagesDo == Cfg::kStages;

  // ---------------------------------------------------------------- host -> device
  struct Arguments {
    GmemTensor q, k, v, dout;  // dO: the layout (strides) of O
    MaskInfo mask;
    SoftmaxScale sm;
    const float* lse;    // [batch, heads, seqlen_q], natural log
    const float* delta;  // [batch, heads, seqlen_q]
    int heads_per_kv;
    typename Dq::Arguments dq;
    DropoutArgs dropout = {};  // Cfg::kDropout
  };
  static bool to_params(const Arguments& a, BwdKernelArgs& p) {
    constexpr TmaElement elem = tma_element<Element>();
    if (!encode_bshd(&p.tm_q, elem, a.q, kBlockM) || !encode_bshd(&p.tm_do, elem, a.dout, kBlockM) ||
        !encode_bshd(&p.tm_k, elem, a.k, kBlockN) || !encode_bshd(&p.tm_v, elem, a.v, kBlockN) ||
        !Dq::to_params(a.dq, p))
      return false;
    p.mask = a.mask;
    p.sm = a.sm;
    p.lse = a.lse;
    p.delta = a.delta;
    p.num_heads = a.q.heads;
    p.heads_per_kv = a.heads_per_kv;
    p.dropout = a.dropout;
    return true;
  }

  JF_DEVICE static void init_barriers(const Smem& sm) {
    ptx::mbar_init(sm.full_kv(), 1);
#pragma unroll
    for (int s = 0; s < Cfg::kStages; ++s) {
      ptx::mbar_init(sm.full_q(s), Cfg::kFullArrivals);
      ptx::mbar_init(sm.empty_q(s), Cfg::kEmptyArrivals);
      if (s < Cfg::kStagesDo) {
        ptx::mbar_init(sm.full_do(s), Cfg::kFullArrivals);
        ptx::mbar_init(sm.empty_do(s), Cfg::kEmptyArrivals);
      }
    }
    if constexpr (Cfg::kDropProducer) {
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        ptx::mbar_init(sm.full_drop(b), Cfg::kDropThreads);
        ptx::mbar_init(sm.empty_drop(b), Cfg::kEmptyArrivals);
      }
    }
  }
  JF_DEVICE static void prefetch_descriptors(const BwdKernelArgs& p) {
    ptx::prefetch_tmap(&p.tm_q);
    ptx::prefetch_tmap(&p.tm_k);
    ptx::prefetch_tmap(&p.tm_v);
    ptx::prefetch_tmap(&p.tm_do);
    Dq::prefetch_descriptors(p);
  }

  // The CTA's tile at scheduler coordinate c.
  JF_DEVICE static BwdTile tile(const BwdKernelArgs& a, const TileCoord& c, int num_n_blocks) {
    return make_bwd_tile<Cfg, kPacked>(a, c, num_n_blocks);
  }

  // ---------------------------------------------------------------- rows
  // Cfg::kVarlen: the tile's positions count from its sequence's first query
  // / key; these give the rows of the packed tensors (else the positions).
  JF_DEVICE static int k_row(const BwdTile& w, int n0) {
    if constexpr (Cfg::kVarlen) {
      return bwd_varlen<Cfg>(w).seq.offset_k + n0;
    } else {
      return n0;
    }
  }
  JF_DEVICE static int q_row(const BwdTile& w, int m0) {
    if constexpr (Cfg::kVarlen) {
      return bwd_varlen<Cfg>(w).seq.offset_q + m0;
    } else {
      return m0;
    }
  }
  // Queries of the tile's sequence (rows at and past it: LSE +inf, delta 0).
  JF_DEVICE static int q_len(const BwdKernelArgs& a, const BwdTile& w) {
    if constexpr (Cfg::kVarlen) {
      return bwd_varlen<Cfg>(w).seq.len_q;
    } else {
      return a.mask.seqlen_q;
    }
  }
  // The first LSE / delta element of q head hq's rows of the tile
  // (varlen: [batch, heads, packed rows], the sequence's first row).
  JF_DEVICE static int64_t stat_row(const BwdKernelArgs& a, const BwdTile& w, int hq, int seqlen_q) {
    if constexpr (Cfg::kVarlen) {
      return (int64_t(w.batch) * a.num_heads + hq) * a.mask.seqlen_q + bwd_varlen<Cfg>(w).seq.offset_q;
    } else {
      return (int64_t(w.batch) * a.num_heads + hq) * seqlen_q;
    }
  }

  // ---------------------------------------------------------------- producer warp
  JF_DEVICE static void load(const BwdKernelArgs& a, const Smem& sm, const BwdTile& w) {
    using namespace ptx;
    if constexpr (Cfg::kVarlen) {
      load_varlen(a, sm, w);
      return;
    }
    constexpr int kCB = Cfg::kHeadDim / 64;       // TMA boxes per Q / K tile
    constexpr int kCBV = Cfg::kHeadDimV / 64;     // ... per V / dO tile
    // Stat rows per lane (kBlockM 80: lanes 0-15 take a third row).
    constexpr int kRowsPerLane = (Cfg::kBlockM + 31) / 32;
    constexpr bool kFullRows = Cfg::kBlockM % 32 == 0;
    if (w.iters == 0) return;
    const int lane = lane_id();
    const int n0 = w.n_block * Cfg::kBlockN;
    if (lane == 0) {
      mbar_arrive_expect_tx(sm.full_kv(), Cfg::kKVBytes + Cfg::kVBytes);
#pragma unroll
      for (int cb = 0; cb < kCB; ++cb)
        tma_load_4d(&a.tm_k, sm.full_kv(), sm.k() + cb * Cfg::kBlockN * 128, cb * 64, n0, w.head_k,
                    w.batch);
#pragma unroll
      for (int cb = 0; cb < kCBV; ++cb)
        tma_load_4d(&a.tm_v, sm.full_kv(), sm.v() + cb * Cfg::kBlockN * 128, cb * 64, n0, w.head_k,
                    w.batch);
    }
    const int seqlen_q = a.mask.seqlen_q;
    PipeState<Cfg::kStages> st;
    PipeState<Cfg::kStagesDo> st_do;
    BwdStepWalker walk(w, a.heads_per_kv);
    for (int it = 0; it < w.iters; ++it) {
      const int m0 = walk.mb * Cfg::kBlockM;
      const int64_t stat = (int64_t(w.batch) * a.num_heads + walk.hq) * seqlen_q;
      // The step's statistics, loaded before waiting for the slot.
      float lse[kRowsPerLane], dl[kRowsPerLane];
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) {
        const int row = m0 + lane + 32 * i;
        lse[i] = INFINITY;
        dl[i] = 0.f;
        if ((kFullRows || lane + 32 * i < Cfg::kBlockM) && row < seqlen_q) {
          const float l = __ldg(a.lse + stat + row);
          lse[i] = l == -INFINITY ? INFINITY : l * kLog2e;
          dl[i] = __ldg(a.delta + stat + row);
        }
      }
      const int s = st.index;
      // Q + LSE
      mbar_wait(sm.empty_q(s), st.phase ^ 1u);
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i)
        if (kFullRows || lane + 32 * i < Cfg::kBlockM) st_shared_f32(sm.lse(s) + 4 * (lane + 32 * i), lse[i]);
      if (lane == 0) {
        mbar_arrive_expect_tx(sm.full_q(s), Cfg::kQBytes);
#pragma unroll
        for (int cb = 0; cb < kCB; ++cb)
          tma_load_4d(&a.tm_q, sm.full_q(s), sm.q(s) + cb * Cfg::kBlockM * 128, cb * 64, m0, walk.hq,
                      w.batch);
      } else {
        mbar_arrive(sm.full_q(s));
      }
      // dO + delta
      const int sd = kSameStages ? s : st_do.index;
      const uint32_t ph_do = kSameStages ? st.phase : st_do.phase;
      mbar_wait(sm.empty_do(sd), ph_do ^ 1u);
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i)
        if (kFullRows || lane + 32 * i < Cfg::kBlockM) st_shared_f32(sm.delta(sd) + 4 * (lane + 32 * i), dl[i]);
      if (lane == 0) {
        mbar_arrive_expect_tx(sm.full_do(sd), Cfg::kDoBytes);
#pragma unroll
        for (int cb = 0; cb < kCBV; ++cb)
          tma_load_4d(&a.tm_do, sm.full_do(sd), sm.dout(sd) + cb * Cfg::kBlockM * 128, cb * 64, m0,
                      walk.hq, w.batch);
      } else {
        mbar_arrive(sm.full_do(sd));
      }
      __syncwarp();
      st.advance();
      if constexpr (!kSameStages) st_do.advance();
      walk.advance();
    }
  }

  // Cfg::kVarlen: load() at the sequence's rows (k_row, q_row) with its
  // LSE / delta rows (stat_row, q_len). A function of its own: the same
  // body with these in the dense kernels' load() changed their register
  // numbering (their SASS must not change).
  JF_DEVICE static void load_varlen(const BwdKernelArgs& a, const Smem& sm, const BwdTile& w) {
    using namespace ptx;
    constexpr int kCB = Cfg::kHeadDim / 64;       // TMA boxes per Q / K tile
    constexpr int kCBV = Cfg::kHeadDimV / 64;     // ... per V / dO tile
    // Stat rows per lane (kBlockM 80: lanes 0-15 take a third row).
    constexpr int kRowsPerLane = (Cfg::kBlockM + 31) / 32;
    constexpr bool kFullRows = Cfg::kBlockM % 32 == 0;
    if (w.iters == 0) return;
    const int lane = lane_id();
    const int n0 = w.n_block * Cfg::kBlockN;
    if (lane == 0) {
      mbar_arrive_expect_tx(sm.full_kv(), Cfg::kKVBytes + Cfg::kVBytes);
#pragma unroll
      for (int cb = 0; cb < kCB; ++cb)
        tma_load_4d(&a.tm_k, sm.full_kv(), sm.k() + cb * Cfg::kBlockN * 128, cb * 64, k_row(w, n0), w.head_k,
                    w.batch);
#pragma unroll
      for (int cb = 0; cb < kCBV; ++cb)
        tma_load_4d(&a.tm_v, sm.full_kv(), sm.v() + cb * Cfg::kBlockN * 128, cb * 64, k_row(w, n0), w.head_k,
                    w.batch);
    }
    const int seqlen_q = q_len(a, w);
    PipeState<Cfg::kStages> st;
    PipeState<Cfg::kStagesDo> st_do;
    BwdStepWalker walk(w, a.heads_per_kv);
    for (int it = 0; it < w.iters; ++it) {
      const int m0 = walk.mb * Cfg::kBlockM;
      const int64_t stat = stat_row(a, w, walk.hq, seqlen_q);
      // The step's statistics, loaded before waiting for the slot.
      float lse[kRowsPerLane], dl[kRowsPerLane];
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i) {
        const int row = m0 + lane + 32 * i;
        lse[i] = INFINITY;
        dl[i] = 0.f;
        if ((kFullRows || lane + 32 * i < Cfg::kBlockM) && row < seqlen_q) {
          const float l = __ldg(a.lse + stat + row);
          lse[i] = l == -INFINITY ? INFINITY : l * kLog2e;
          dl[i] = __ldg(a.delta + stat + row);
        }
      }
      const int s = st.index;
      // Q + LSE
      mbar_wait(sm.empty_q(s), st.phase ^ 1u);
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i)
        if (kFullRows || lane + 32 * i < Cfg::kBlockM) st_shared_f32(sm.lse(s) + 4 * (lane + 32 * i), lse[i]);
      if (lane == 0) {
        mbar_arrive_expect_tx(sm.full_q(s), Cfg::kQBytes);
#pragma unroll
        for (int cb = 0; cb < kCB; ++cb)
          tma_load_4d(&a.tm_q, sm.full_q(s), sm.q(s) + cb * Cfg::kBlockM * 128, cb * 64, q_row(w, m0), walk.hq,
                      w.batch);
      } else {
        mbar_arrive(sm.full_q(s));
      }
      // dO + delta
      const int sd = kSameStages ? s : st_do.index;
      const uint32_t ph_do = kSameStages ? st.phase : st_do.phase;
      mbar_wait(sm.empty_do(sd), ph_do ^ 1u);
#pragma unroll
      for (int i = 0; i < kRowsPerLane; ++i)
        if (kFullRows || lane + 32 * i < Cfg::kBlockM) st_shared_f32(sm.delta(sd) + 4 * (lane + 32 * i), dl[i]);
      if (lane == 0) {
        mbar_arrive_expect_tx(sm.full_do(sd), Cfg::kDoBytes);
#pragma unroll
        for (int cb = 0; cb < kCBV; ++cb)
          tma_load_4d(&a.tm_do, sm.full_do(sd), sm.dout(sd) + cb * Cfg::kBlockM * 128, cb * 64, q_row(w, m0),
                      walk.hq, w.batch);
      } else {
        mbar_arrive(sm.full_do(sd));
      }
      __syncwarp();
      st.advance();
      if constexpr (!kSameStages) st_do.advance();
      walk.advance();
    }
  }

  // ---------------------------------------------------------------- mask warps
  // Cfg::kDropProducer: mask thread j (0..kDropThreads-1), the tile's steps
  // in the consumers' order; step `it` uses the buffers of parity it & 1
  // (use it / 2 of that pair of barriers).
  JF_DEVICE static void draw_masks(const BwdKernelArgs& a, const Smem& sm, const BwdTile& w, int j) {
    if constexpr (Cfg::kDropProducer) {
      const Dropout d(a.dropout);
      const DropMaskThreshold t(d.threshold);
      const int n0 = w.n_block * kBlockN;
      BwdStepWalker walk(w, a.heads_per_kv);
      for (int it = 0; it < w.iters; ++it) {
        ptx::mbar_wait(sm.empty_drop(it & 1), (uint32_t(it >> 1) & 1u) ^ 1u);
        Split::draw_masks(sm, d, t, it, w.batch, n0, walk.mb * kBlockM, walk.hq, j);
        ptx::mbar_arrive(sm.full_drop(it & 1));  // release: this thread's stores
        walk.advance();
      }
    }
  }

  // ---------------------------------------------------------------- dQ writer warp
  JF_DEVICE static void store_dq(const BwdKernelArgs& a, const Smem& sm, const BwdTile& w) {
    Dq::template store<kDet>(a, sm, w);
  }

  // ---------------------------------------------------------------- varlen tails
  // Cfg::kVarlen: the TMA boxes read past the sequence's end into the next
  // tokens of the packed tensors, which may hold anything (NaN, Inf). Their
  // scores are masked (keys) or their P is 0 (queries: LSE +inf), but 0 x NaN
  // in the dV, dK, dQ GEMMs and in dS = P (dP - delta) would still be NaN, so
  // both consumer WGs zero those rows in shared memory before any GEMM reads
  // the stage (then fence.proxy.async: the wgmma reads and the next TMA
  // writes of the stage are async-proxy accesses) and meet on a named barrier.
  // K and V: once per CTA, when its KV block is the sequence's partial last.
  JF_DEVICE static void zero_kv_tail(const Split& c, const BwdTile& w, int n0) {
    const int len_k = bwd_varlen<Cfg>(w).seq.len_k;
    if (n0 + kBlockN <= len_k) return;  // CTA-uniform
    const int tid = 128 * c.wg + 32 * c.warp + c.lane;
    zero_tile_rows<kBlockN, Cfg::kHeadDim / 64>(c.sm.k(), len_k - n0, tid, 256);
    zero_tile_rows<kBlockN, Cfg::kHeadDimV / 64>(c.sm.v(), len_k - n0, tid, 256);
    ptx::fence_proxy_async_smem();
    ptx::named_bar_sync(kBwdBarVarlenZero, 256);
  }
  // Q and dO of a step whose query block is the sequence's partial last (dO
  // waited for here, before the S GEMM; its wait in the step then passes).
  JF_DEVICE static void zero_q_do_tail(const Split& c, const BwdTile& w, int m0, int s, int sd, uint32_t ph_do) {
    const int len_q = bwd_varlen<Cfg>(w).seq.len_q;
    if (m0 + kBlockM <= len_q) return;  // CTA-uniform
    const int tid = 128 * c.wg + 32 * c.warp + c.lane;
    zero_tile_rows<kBlockM, Cfg::kHeadDim / 64>(c.sm.q(s), len_q - m0, tid, 256);
    bwd_wait_full(c.sm.full_do(sd), ph_do);
    zero_tile_rows<kBlockM, Cfg::kHeadDimV / 64>(c.sm.dout(sd), len_q - m0, tid, 256);
    ptx::fence_proxy_async_smem();
    ptx::named_bar_sync(kBwdBarVarlenZero, 256);
  }

  // ---------------------------------------------------------------- consumer warpgroups
  // Consumer warpgroup `split` (the config's work split, holding the Params,
  // the smem plan, its WG, warp and lane): dK and dV zeroed, the sweep over
  // the tile's steps accumulating them, then Epilogue::store. Every register
  // array of a step is declared here (S, dP and the split's StepRegs) and the
  // split's step works on them: so ptxas gets the code of one function (a
  // step with arrays of its own compiles to another register allocation).
  template <typename Epilogue>
  JF_DEVICE static void consume(const Split& split, const BwdTile& w) {
    using namespace ptx;
    const BwdKernelArgs& a = split.a;
    const Smem& sm = split.sm;
    float dk[kKR], dv[kVR];
    if constexpr (kVR == kKR) {
#pragma unroll
      for (int i = 0; i < kKR; ++i) dk[i] = dv[i] = 0.f;
    } else {
#pragma unroll
      for (int i = 0; i < kKR; ++i) dk[i] = 0.f;
#pragma unroll
      for (int i = 0; i < kVR; ++i) dv[i] = 0.f;
    }
    const int n0 = w.n_block * kBlockN;

    if (w.iters > 0) {
      bwd_wait_full(sm.full_kv(), 0);
      if constexpr (Cfg::kVarlen) zero_kv_tail(split, w, n0);
      const float scale_log2 = a.sm.scale_log2;
      float softcap_pre = kSoftcap ? a.sm.softcap_pre : 0.f;
      if constexpr (Cfg::kSoftcapTanhExp) softcap_pre *= 2.f * kLog2e;  // tanh_exp2's argument
      PipeState<Cfg::kStages> st;       // Q ring (and LSE)
      PipeState<Cfg::kStagesDo> st_do;  // dO ring (and delta)
      BwdStepWalker walk(w, a.heads_per_kv);
      for (int it = 0; it < w.iters; ++it) {
        const int m0 = walk.mb * kBlockM;
        const int s = st.index;
        const int sd = kSameStages ? s : st_do.index;
        const uint32_t ph_do = kSameStages ? st.phase : st_do.phase;
        // Accumulators overwritten by their first wgmma (scale-d = 0). Declared
        // per step: their values are dead between steps (declared outside the
        // loop, the wgmma's "+f" operands would keep them live across it).
        float sc[kSR], dp[kSR];

        // ---- S = Q K^T, dP = dO V^T (the key split: S^T, dP^T)
        bwd_wait_full(sm.full_q(s), st.phase);
        if constexpr (Cfg::kVarlen) zero_q_do_tail(split, w, m0, s, sd, ph_do);
        wgmma_fence();
        split.issue_s(sc, sm.q(s));
        wgmma_commit();
        bwd_wait_full(sm.full_do(sd), ph_do);
        wgmma_fence();  // (after the wait loop's branch: ptxas wants it adjacent)
        split.issue_dp(dp, sm.dout(sd));
        wgmma_commit();
        if constexpr (Cfg::kDropout) split.draw_dropout(it, w, n0, m0, walk.hq);  // under the GEMMs
        wgmma_wait<1>();  // S ready (dP may still run)
        fence_regs(sc);

        // ---- the split's part: P, dS, the dV / dQ / dK GEMMs, dQ out, the releases
        typename Split::StepRegs r;
        split.step(it, w, n0, m0, s, sd, sc, dp, r, dk, dv, scale_log2, softcap_pre);

        st.advance();
        if constexpr (!kSameStages) st_do.advance();
        walk.advance();
      }
    }
    if constexpr (Cfg::kDropout) {  // dV summed (Z P)^T dO: the keep scale, once
      const float keep_scale = dropout_keep_scale(a.dropout);
#pragma unroll
      for (int i = 0; i < kVR; ++i) dv[i] *= keep_scale;
    }
    Epilogue::store(split, w, dk, dv);
  }
};

}  // namespace jax_flash::sm90
