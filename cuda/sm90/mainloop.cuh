// The two sides of the warp-specialised forward mainloop.
//
// Producer (one thread of the producer warpgroup): per tile, K of the first
// (highest) KV block, then Q (once the consumers released the previous Q),
// then K[n-1] and V[n] for each block n going down (the order in which the
// overlapped consumer uses them). Every load is a set of TMA boxes (one per
// 64 columns of the head dim) completing on the slot's "full" mbarrier; the
// slot is refilled only after its "empty" mbarrier saw every consumer warp.
//
// Consumers (each warpgroup: 64 query rows, all KV blocks of the tile):
//   S = Q K^T   wgmma SS, K-major A and B, D/16 k-steps, N = kBlockN
//               (kFlagQInRegs, the hdim-128 default: wgmma RS, Q's A fragments loaded from
//               shared memory into registers once per tile, see load_q)
//   O += P V    wgmma RS, P converted in registers from S, V MN-major (tnspB),
//               kBlockN/16 k-steps, N = head dim
// Two schedules (kFlagOverlap):
//  serial:   wait K[n]; S = QK^T; wait; softmax; wait V[n]; O += PV; wait
//  overlap (FA3 "intra-warpgroup overlap"): the QK^T of block n is issued
//            together with the PV of block n+1; the softmax of block n runs
//            while the PV is still in flight:
//              issue S = Q K[n]^T; issue O += P[n+1] V[n+1]
//              wait(1) -> S ready; softmax(S) -> new max, P (fp32)
//              wait(0) -> PV done; rescale O; P[n] = pack(S)
// kFlagPingpong: the GEMM issue of each step is bracketed by named barriers so
// that the consumer warpgroups take turns on the tensor cores (one WG's GEMMs
// run while the other does its softmax): sync(kBarSched + wg) before,
// arrive(kBarSched + next wg) after. Turn sequence per WG and tile (both WGs
// see the same number of KV blocks nb, so the turns alternate strictly):
//   serial:  [QK0] [PV0 QK1] ... [PV(nb-1)]  -> nb + 1 turns
//   overlap: QK0 outside, [QK1 PV0] ... [QK(nb-1) PV(nb-2)], PV(nb-1) outside
//            -> nb - 1 turns
// The first consumer WG gives itself the initial turn.
// Softmax: OnlineSoftmax::update_lazy; O is rescaled only when some row of the
// warp raised its max (a warp-uniform branch around rescale_rows), see
// softmax.cuh. kFlagEagerRescale (ablation) rescales after every block
// (OnlineSoftmax::update).
#pragma once

#include <type_traits>

#include "args.cuh"
#include "ptx/barrier.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace jax_flash::sm90 {

// ------------------------------------------------------------------ producer
// Run by one thread (lane 0 of warp 0).
template <typename Cfg, int kFlags>
JF_DEVICE void producer_loop(const FwdKernelArgs& a, const SmemPlan<Cfg>& sm) {
  using namespace ptx;
  constexpr bool kDynamic = (kFlags & kFlagDynamic) != 0;
  constexpr int kCB = Cfg::kHeadDim / 64;  // TMA boxes per tile
  PipeState<Cfg::kStages> kst, vst;
  uint32_t it = 0;
  for (int tile = blockIdx.x; tile < a.sched.total; ++it) {
    int next = tile + int(gridDim.x);
    if constexpr (kDynamic) {
      next = a.sched.claim_next();  // used only after the loads below
    }
    int m_block, head, batch;
    a.sched.decode(tile, m_block, head, batch);
    const int m0 = m_block * Cfg::kBlockM;
    int n_first, n_last;
    a.mask.kv_block_range(m0, Cfg::kBlockM, Cfg::kBlockN, n_first, n_last);
    const int head_k = head / a.heads_per_kv;

    auto load_k = [&](int n) {
      mbar_wait(sm.empty_k(kst.index), kst.phase ^ 1u);
      const uint32_t full = sm.full_k(kst.index), dst = sm.k(kst.index);
      mbar_arrive_expect_tx(full, Cfg::kKVBytes);
#pragma unroll
      for (int cb = 0; cb < kCB; ++cb)
        tma_load_4d(&a.tm_k, full, dst + cb * Cfg::kBlockN * 128, cb * 64, n * Cfg::kBlockN,
                    head_k, batch);
      kst.advance();
    };
    auto load_v = [&](int n) {
      mbar_wait(sm.empty_v(vst.index), vst.phase ^ 1u);
      const uint32_t full = sm.full_v(vst.index), dst = sm.v(vst.index);
      mbar_arrive_expect_tx(full, Cfg::kKVBytes);
#pragma unroll
      for (int cb = 0; cb < kCB; ++cb)
        tma_load_4d(&a.tm_v, full, dst + cb * Cfg::kBlockN * 128, cb * 64, n * Cfg::kBlockN,
                    head_k, batch);
      vst.advance();
    };

    const bool has_keys = n_last > n_first;
    // kOInV: the previous tile's O store must have read the V ring before
    // this tile's first V load. o_free completes once per tile (epilogue
    // it - 1 -> phase it - 1); the producer waits for every phase, in
    // order, at a point where epilogue `it` cannot have completed yet
    // (before this tile's first V load, or before its Q load when it has
    // no keys), so the parity test is exact.
    auto wait_o_free = [&] {
      if constexpr (Cfg::kOInV) {
        if (it > 0) mbar_wait(sm.o_free(), (it - 1) & 1u);
      }
    };
    if (has_keys) load_k(n_last - 1);
    if (!has_keys) wait_o_free();
    // Q: always loaded (also for a tile without visible keys) so that the
    // consumers' full_q / empty_q phases advance once per tile.
    mbar_wait(sm.empty_q(), (it & 1u) ^ 1u);
    mbar_arrive_expect_tx(sm.full_q(), Cfg::kQBytes);
#pragma unroll
    for (int cb = 0; cb < kCB; ++cb)
      tma_load_4d(&a.tm_q, sm.full_q(), sm.q() + cb * Cfg::kBlockM * 128, cb * 64, m0, head, batch);
    if (has_keys) wait_o_free();
    for (int n = n_last - 1; n >= n_first; --n) {
      if (n > n_first) load_k(n - 1);
      load_v(n);
    }
    if constexpr (kDynamic) {
      // Hand-off `it` of the next tile index: the slot is rewritten once every
      // consumer thread has read index it - 1 (tile_empty phase it - 1; the
      // producer cannot run further ahead, so the parity is exact).
      mbar_wait(sm.tile_empty(), (it & 1u) ^ 1u);
      st_shared_b32(sm.tile_slot(), uint32_t(next));
      mbar_arrive(sm.tile_full());  // release: the store above is visible to the waiters
    }
    tile = next;
  }
}

// ------------------------------------------------------------------ consumer GEMMs
template <typename Cfg>
struct QStep {  // k-step kk of the Q tile (A, K-major, [D/64][kBlockM][64])
  JF_DEVICE uint32_t operator()(int kk) const { return (kk / 4) * Cfg::kBlockM * 128 + (kk % 4) * 32; }
};
template <typename Cfg>
struct KStep {  // k-step kk of a K stage (B, K-major, [D/64][kBlockN][64])
  JF_DEVICE uint32_t operator()(int kk) const { return (kk / 4) * Cfg::kBlockN * 128 + (kk % 4) * 32; }
};
struct VStep {  // k-step kk of a V stage (B, MN-major): 16 rows of 128 B
  JF_DEVICE uint32_t operator()(int kk) const { return kk * 16 * 128; }
};

// Issues S = Q_wg K^T (no commit/wait). q_addr: the WG's first Q row.
template <typename Element, typename Cfg>
JF_DEVICE void issue_qk(float (&s)[Cfg::kBlockN / 2], uint32_t q_addr, uint32_t k_addr) {
  ptx::gemm_ss<Element, Cfg::kBlockN, 0, Cfg::kHeadDim / 16>(
      s, ptx::make_desc(ptx::kDescKMajor, q_addr), ptx::make_desc(ptx::kDescKMajor, k_addr),
      QStep<Cfg>{}, KStep<Cfg>{}, true);
}

// kFlagQInRegs: issues S = Q_wg K^T with Q from registers (wgmma RS; the A
// fragments of the D/16 k-steps, loaded once per tile by load_a_sw128), K as
// in issue_qk. Same instructions otherwise: N = kBlockN, K-major B.
template <typename Element, typename Cfg>
JF_DEVICE void issue_qk_rs(float (&s)[Cfg::kBlockN / 2], const uint32_t (&q)[Cfg::kHeadDim / 16][4],
                           uint32_t k_addr) {
  ptx::gemm_rs<Element, Cfg::kBlockN, 0, Cfg::kHeadDim / 16>(
      s, q, ptx::make_desc(ptx::kDescKMajor, k_addr), KStep<Cfg>{}, true);
}

// Issues O += P V (no commit/wait).
template <typename Element, typename Cfg>
JF_DEVICE void issue_pv(float (&o)[Cfg::kHeadDim / 2], const uint32_t (&p)[Cfg::kBlockN / 16][4],
                        uint32_t v_addr) {
  ptx::gemm_rs<Element, Cfg::kHeadDim, 1, Cfg::kBlockN / 16>(
      o, p, ptx::make_desc(ptx::desc_mn_major<Cfg::kBlockN>(), v_addr), VStep{}, false);
}

// Everything a consumer warpgroup needs to run one tile's mainloop.
template <typename Element, typename Cfg, int kFlags>
struct ConsumerMainloop {
  static constexpr bool kPingpong = (kFlags & kFlagPingpong) != 0;
  static constexpr bool kOverlap = (kFlags & kFlagOverlap) != 0;
  static constexpr bool kLazy = (kFlags & kFlagEagerRescale) == 0;
  static constexpr bool kQInRegs = (kFlags & kFlagQInRegs) != 0;
  static constexpr int kSR = Cfg::kBlockN / 2;   // S registers
  static constexpr int kOR = Cfg::kHeadDim / 2;  // O registers
  static constexpr int kPK = Cfg::kBlockN / 16;  // P k-steps
  static constexpr int kQK = Cfg::kHeadDim / 16;  // Q k-steps
  // Q in registers frees Q's buffer right after the load (consumer_loop); an
  // O tile staged in Q's buffer would need it back in the epilogue.
  static_assert(!kQInRegs || !Cfg::kOAliasQ, "kFlagQInRegs: O must not be staged in Q's buffer");
  // ptxas 13.0 miscompiles Q in registers in the serial schedule below: it
  // hands the loop-invariant Q fragments' registers to P inside the loop (the
  // PTX is right; the results were wrong on the H200). The overlap schedule
  // compiles correctly; tools/check_wgmma_a_regs.py checks the SASS of every
  // build for this.
  static_assert(!kQInRegs || kOverlap, "kFlagQInRegs needs kFlagOverlap (ptxas, see above)");

  // The A operand of S = Q K^T for this warpgroup's 64 rows: their address in
  // the Q tile (wgmma SS, the default) or, kFlagQInRegs, their A fragments
  // (wgmma RS), read from shared memory once per tile.
  struct QSmem {
    uint32_t addr;
  };
  struct QRegs {
    uint32_t frag[kQK][4];
  };
  using QOperand = std::conditional_t<kQInRegs, QRegs, QSmem>;

  const FwdKernelArgs& a;
  const SmemPlan<Cfg>& sm;
  int wg, warp, lane;
  ptx::PipeState<Cfg::kStages>& kst;
  ptx::PipeState<Cfg::kStages>& vst;

  JF_DEVICE void sched_sync() const {
    if constexpr (kPingpong) ptx::named_bar_sync(kBarSched + wg, 256);
  }
  JF_DEVICE void sched_arrive() const {
    if constexpr (kPingpong)
      ptx::named_bar_arrive(kBarSched + (wg + 1 == Cfg::kConsumerWGs ? 0 : wg + 1), 256);
  }
  // One arrival per warp on an "empty" barrier (after the warp's wgmma wait).
  JF_DEVICE void release(uint32_t bar) const {
    __syncwarp();
    if (lane == 0) ptx::mbar_arrive(bar);
    __syncwarp();
  }
  JF_DEVICE void wait_full(uint32_t bar, uint32_t phase) const {
    ptx::mbar_wait(bar, phase);
    __syncwarp();
  }

  // After the Q "full" wait of the tile.
  JF_DEVICE QOperand load_q() const {
    QOperand q;
    if constexpr (kQInRegs) {
      ptx::load_a_sw128<Cfg::kBlockM>(q.frag, sm.q(), 64 * wg);
    } else {
      q.addr = sm.q() + 64 * wg * 128;  // the WG's rows, column block 0
    }
    return q;
  }
  // Issues S = Q K^T for the K stage at k_addr (no fence/commit/wait).
  JF_DEVICE void issue_s(float (&s)[kSR], const QOperand& q, uint32_t k_addr) const {
    if constexpr (kQInRegs) {
      issue_qk_rs<Element, Cfg>(s, q.frag, k_addr);
    } else {
      issue_qk<Element, Cfg>(s, q.addr, k_addr);
    }
  }

  // Softcap and (only on blocks that need it) the element mask.
  JF_DEVICE void score_mod(float (&s)[kSR], int m0_wg, int n, int batch) const {
    if (a.sm.softcap_pre != 0.f) apply_softcap(s, a.sm.softcap_pre);
    const int n0 = n * Cfg::kBlockN;
    if (a.mask.block_needs_mask(m0_wg, 64, n0, Cfg::kBlockN))
      apply_mask(s, a.mask, batch, m0_wg + 16 * warp + lane / 4, n0 + 2 * (lane % 4));
  }

  // The softmax of one block: update_lazy() (returns true only when some row
  // of the warp raised its max; the same value on every lane) or, in the
  // eager ablation, update() (true: O must always be rescaled).
  template <bool kFirst>
  JF_DEVICE bool softmax(OnlineSoftmax& smx, float (&s)[kSR], float scale_log2,
                         float (&alpha)[2]) const {
    if constexpr (kLazy) {
      return smx.template update_lazy<kFirst>(s, scale_log2, alpha);
    } else {
      smx.template update<kFirst>(s, scale_log2, alpha);
      return true;
    }
  }

  // O (pre-zeroed) and the softmax state for KV blocks [n_first, n_last); q
  // from load_q(). kQInRegs: q's registers are only read here (by the async
  // wgmma), never written, so one wgmma_fence() after load_q orders them.
  JF_DEVICE void run(float (&o)[kOR], OnlineSoftmax& smx, const QOperand& q, int m0_wg, int batch,
                     int n_first, int n_last) const {
    using namespace ptx;
    const float scale_log2 = a.sm.scale_log2;
    float s[kSR];
    uint32_t p[kPK][4];
    float alpha[2];

    if constexpr (kOverlap) {
      int n = n_last - 1;
      // Block n_last - 1: S alone.
      wait_full(sm.full_k(kst.index), kst.phase);
      wgmma_fence();
      issue_s(s, q, sm.k(kst.index));
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(s);
      release(sm.empty_k(kst.index));
      kst.advance();
      score_mod(s, m0_wg, n, batch);
      softmax<true>(smx, s, scale_log2, alpha);
      acc_to_a<Element>(s, p);
      float alpha_pending[2] = {1.f, 1.f};  // kRescaleBeforePV: applied before the next PV
      bool rescale_pending = false;         // kRescaleBeforePV: whether to apply it

      for (--n; n >= n_first; --n) {
        wait_full(sm.full_k(kst.index), kst.phase);
        sched_sync();
        fence_regs(p);
        wgmma_fence();
        issue_s(s, q, sm.k(kst.index));
        wgmma_commit();
        if constexpr (Cfg::kRescaleBeforePV) {  // O is idle here (last PV waited for)
          if (rescale_pending) rescale_rows(o, alpha_pending);
        }
        fence_regs(o);
        wait_full(sm.full_v(vst.index), vst.phase);
        wgmma_fence();
        issue_pv<Element, Cfg>(o, p, sm.v(vst.index));
        wgmma_commit();
        sched_arrive();
        wgmma_wait<1>();  // S ready (the PV may still run)
        fence_regs(s);
        release(sm.empty_k(kst.index));
        kst.advance();
        score_mod(s, m0_wg, n, batch);
        const bool rescale = softmax<false>(smx, s, scale_log2, alpha);
        wgmma_wait<0>();  // PV done: O and P are ours again
        fence_regs(o);
        fence_regs(p);
        release(sm.empty_v(vst.index));
        vst.advance();
        acc_to_a<Element>(s, p);
        if constexpr (Cfg::kRescaleBeforePV) {
          alpha_pending[0] = alpha[0];
          alpha_pending[1] = alpha[1];
          rescale_pending = rescale;
        } else if (rescale) {  // warp-uniform: skipped, not predicated (always true when eager)
          rescale_rows(o, alpha);
        }
      }
      // PV of block n_first.
      if constexpr (Cfg::kRescaleBeforePV) {
        if (rescale_pending) rescale_rows(o, alpha_pending);
      }
      fence_regs(o);
      fence_regs(p);
      wait_full(sm.full_v(vst.index), vst.phase);
      wgmma_fence();
      issue_pv<Element, Cfg>(o, p, sm.v(vst.index));
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(p);
      release(sm.empty_v(vst.index));
      vst.advance();
    } else {
      sched_sync();
      for (int n = n_last - 1; n >= n_first; --n) {
        wait_full(sm.full_k(kst.index), kst.phase);
        wgmma_fence();
        issue_s(s, q, sm.k(kst.index));
        wgmma_commit();
        sched_arrive();
        wgmma_wait<0>();
        fence_regs(s);
        release(sm.empty_k(kst.index));
        kst.advance();
        score_mod(s, m0_wg, n, batch);
        if (n == n_last - 1) {
          softmax<true>(smx, s, scale_log2, alpha);
        } else if (softmax<false>(smx, s, scale_log2, alpha)) {
          rescale_rows(o, alpha);
        }
        acc_to_a<Element>(s, p);
        fence_regs(o);
        fence_regs(p);
        wait_full(sm.full_v(vst.index), vst.phase);
        sched_sync();
        wgmma_fence();
        issue_pv<Element, Cfg>(o, p, sm.v(vst.index));
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(o);
        fence_regs(p);
        release(sm.empty_v(vst.index));
        vst.advance();
      }
      sched_arrive();
    }
  }
};

}  // namespace jax_flash::sm90
