// The dKV-swapped split of the sm90 backward's consumer warpgroups for the
// head-dim pair 192 / 128 (BwdConfig::kDkvSwapAB: 64 queries x 96 keys per
// step, FA3's tile for hdim 192 with dv 128). 96 keys x (192 + 128) columns
// of dK and dV are 120 registers per consumer thread; a 64-row wgmma M fits
// neither 96 keys nor half of them, so dK and dV are made transposed (M =
// head-dim columns, N = keys) and the warpgroups split the keys: warpgroup
// wg owns keys [48 wg, +48) and, per step, after the mainloop's S = Q K_wg^T
// and dP = dO V_wg^T (wgmma SS, 64 x 48, K = 192 / 128):
//   P  = 2^(S scale_log2 - lse_log2[q]),  dS = P (dP - delta[q])
//        (softcap: S <- tanh, dS *= 1 - tanh^2; the mask between)
//   P^T, dS^T -> [key][query] 16-bit tiles (stmatrix.trans), double buffered
//   --- both WGs' P^T and dS^T written (named barrier PdS)
//   dV^T[:, keys_wg] += dO^T P     wgmma SS, 2 column blocks of 64 x 48,
//                                  K = 64 queries; A = dO read MN-major
//                                  (tnspA), B = the WG's rows of P^T, K-major
//   dQ[:, C] = dS K[:, C]          wgmma SS, 64 x 64, K = 96 keys; A = the
//                                  dS^T tile read MN-major (tnspA), B = K
//                                  MN-major; C: WG 0 column block 0, WG 1
//                                  blocks 1 and 2 (Cfg::dq_col0)
//   dK^T[:, keys_wg] += Q^T dS     as dV^T, 3 column blocks
//   dQ -> staging tile (BwdDqAccumulator::stage, the pair's writer order)
// Registers: dK^T 72, dV^T 48 (24 per column block); S, dP, P 24 each; dQ
// 32 per slice. Releases: dO (empty_do) once dV^T is done, Q once dK^T is.
// The epilogue (BwdEpilogue::store_swapped) writes dK^T / dV^T back
// transposed into the K / V tiles with the same stmatrix.trans as P^T.
// No dropout (the sm80 backward serves the pair's), no varlen kernels.
#pragma once

#include "bwd_dq.cuh"
#include "bwd_tile.cuh"
#include "sm90/ptx/wgmma.cuh"

namespace jax_flash::sm90 {

template <typename Element, typename Cfg, bool kSoftcap, bool kDqTensor, bool kPacked = false>
struct BwdPairSplit {
  static_assert(Cfg::kDkvSwapAB && Cfg::kPair && Cfg::kConsumerWGs == 2 && !Cfg::kDropout && !Cfg::kVarlen,
                "the pair's 64 x 96 tile, 2 consumer WGs, no dropout / varlen");
  using Dq = BwdDqAccumulator<Cfg, kDqTensor>;
  static constexpr int kD = Cfg::kHeadDim;
  static constexpr int kDv = Cfg::kHeadDimV;
  static constexpr int kBM = Cfg::kBlockM;
  static constexpr int kBN = Cfg::kBlockN;
  static_assert(kBM == 64 && kBN == 96 && kD % 64 == 0 && kDv % 64 == 0,
                "P^T / dS^T rows are one 128-byte swizzle column block of 64 queries");
  static constexpr int kWN = kBN / 2;      // keys per WG
  static_assert(kWN % 16 == 0 && (kWN * 128) % 1024 == 0, "a WG's rows keep the swizzle phase");
  static constexpr int kSR = kWN / 2;      // S / dP registers (64 x 48)
  static constexpr int kBR = kWN / 2;      // one 64-column block of dK^T / dV^T (64 x 48)
  static constexpr int kKB = kD / 64;      // column blocks of dK
  static constexpr int kVB = kDv / 64;     // ... of dV
  static constexpr int kKR = kKB * kBR;    // dK^T registers
  static constexpr int kVR = kVB * kBR;    // dV^T registers
  static constexpr int kQR = Cfg::kDqCols / 2;  // dQ registers per slice (64 x 64)
  static constexpr int kPK = kWN / 16;     // 16-key fragments of P / dS (and of a dK^T / dV^T block)
  // The WG's part of the dK / dV tiles (BwdEpilogue::store_swapped): its keys, every column.
  static constexpr int kKvRows = kWN;
  static constexpr int kKvCols = kD;

  const BwdKernelArgs& a;
  const BwdSmem<Cfg>& sm;
  int wg, warp, lane;

  // Descriptors of k-step 0 of each GEMM (static: also used by the host-side
  // layout check, cuda/tests/sm90_bwd_layout_check.cpp).
  // S (or dP) = A B^T: A = the Q (dO) tile, K-major [D/64][kBM][64]; B = rows
  // [48 wg, +48) of the K (V) tile, K-major [D/64][kBN][64] (row 48 starts
  // 6 KB in: the swizzle phase is unchanged).
  static JF_DEVICE uint64_t sdp_desc_a(uint32_t a_tile) { return ptx::make_desc(ptx::kDescKMajor, a_tile); }
  static JF_DEVICE uint64_t sdp_desc_b(int wg, uint32_t b_tile) {
    return ptx::make_desc(ptx::kDescKMajor, b_tile + kWN * wg * 128);
  }
  using SdpStepA = KMajorStep<kBM>;
  using SdpStepB = KMajorStep<kBN>;
  // Column block cb of dV^T += dO^T P (or dK^T += Q^T dS): A (m = column,
  // k = query) = column block cb of the dO (Q) tile read MN-major (M = 64:
  // one 128-byte row block, LBO unused); B (n = key, k = query) = rows
  // [48 wg, +48) of the [key][query] P^T (dS^T) tile, K-major. Both step 16
  // queries per k-step.
  static JF_DEVICE uint64_t dkv_desc_a(int cb, uint32_t a_tile) {
    return ptx::make_desc(ptx::desc_mn_major<kBM>(), a_tile + cb * kBM * 128);
  }
  static JF_DEVICE uint64_t dkv_desc_b(int wg, uint32_t t_tile) {
    return ptx::make_desc(ptx::kDescKMajor, t_tile + kWN * wg * 128);
  }
  using DkvStepA = MNMajorStep;
  using DkvStepB = KMajorStep<kBN>;
  // dQ slice sl of this WG = dS K[:, 64 c, +64), c = Cfg::dq_col0(wg, sl) / 64:
  // A (m = query, k = key) = the dS^T tile read MN-major (M = 64 queries: one
  // row block); B (k = key, n = column) = column block c of K, MN-major.
  // N = 64, K = 96 keys (16 rows per k-step each).
  static JF_DEVICE uint64_t dq_desc_a(uint32_t dst_tile) {
    return ptx::make_desc(ptx::desc_mn_major<kBN>(), dst_tile);
  }
  static JF_DEVICE uint64_t dq_desc_b(int wg, int sl, uint32_t k_tile) {
    return ptx::make_desc(ptx::desc_mn_major<kBN>(), k_tile + (Cfg::dq_col0(wg, sl) / 64) * kBN * 128);
  }
  using DqStepA = MNMajorStep;
  using DqStepB = MNMajorStep;

  // Column block cb (kBR registers) of a dK^T / dV^T accumulator.
  template <typename T, int kN>
  static JF_DEVICE T (&block(T (&acc)[kN], int cb))[kBR] {
    return *reinterpret_cast<T(*)[kBR]>(&acc[cb * kBR]);
  }

  // Issue only (no commit / wait).
  // S: K = kD (Q, K); dP: K = kDv (dO, V).
  template <int kDepth = kD>
  JF_DEVICE void issue_sdp(float (&acc)[kSR], uint32_t a_tile, uint32_t b_tile) const {
    ptx::gemm_ss<Element, kWN, 0, kDepth / 16>(acc, sdp_desc_a(a_tile), sdp_desc_b(wg, b_tile), SdpStepA{},
                                               SdpStepB{}, true);
  }
  // kBlocks column blocks of dK^T (a_tile = Q, t_tile = dS^T) or dV^T (dO, P^T).
  template <int kBlocks>
  JF_DEVICE void issue_dkv(float (&acc)[kBlocks * kBR], uint32_t a_tile, uint32_t t_tile) const {
#pragma unroll
    for (int cb = 0; cb < kBlocks; ++cb)
      ptx::gemm_ss<Element, kWN, 0, kBM / 16, /*kTransA=*/1>(block(acc, cb), dkv_desc_a(cb, a_tile),
                                                              dkv_desc_b(wg, t_tile), DkvStepA{}, DkvStepB{},
                                                              false);
  }
  JF_DEVICE void issue_dq(float (&acc)[kQR], uint32_t dst_tile, int sl) const {
    ptx::gemm_ss<Element, Cfg::kDqCols, 1, kBN / 16, /*kTransA=*/1>(acc, dq_desc_a(dst_tile),
                                                                     dq_desc_b(wg, sl, sm.k()), DqStepA{},
                                                                     DqStepB{}, true);
  }

  // A 64 x 48 accumulator of this WG (rows: queries of P / dS, or columns of
  // a dK^T / dV^T block; columns: the WG's keys), packed pairwise as by
  // acc_to_a, -> a [key][64] tile (128-byte rows, 128B swizzle), transposed
  // with stmatrix.trans: fragment k's matrix i holds rows 16 warp + 8 (i % 2)
  // + 0..7 and keys 48 wg + 16 k + 8 (i / 2) + 0..7; stored transposed, row c
  // of it is key 48 wg + 16 k + 8 (i / 2) + c, its 8 rows one 16-byte chunk
  // (2 warp + i % 2). Byte offset in the tile of the row address that `lane`
  // (lane 8 i + c) gives to the stmatrix of fragment k. The key's row % 8 is
  // c, so the 8 rows of a matrix land in 8 distinct chunks: no bank conflicts.
  static JF_DEVICE uint32_t t_offset(int wg, int warp, int lane, int k) {
    const int i = lane / 8, c = lane % 8;
    return uint32_t((kWN * wg + 16 * k + 8 * (i / 2) + c) * 128) + (uint32_t((2 * warp + (i % 2)) ^ c) << 4);
  }
  JF_DEVICE void store_t(const uint32_t (&f)[kPK][4], uint32_t tile) const {
#pragma unroll
    for (int k = 0; k < kPK; ++k)
      ptx::stmatrix_x4_trans(tile + t_offset(wg, warp, lane, k), f[k][0], f[k][1], f[k][2], f[k][3]);
  }

  // S = Q K_wg^T and dP = dO V_wg^T for BwdMainloop::consume (issue only).
  JF_DEVICE void issue_s(float (&acc)[kSR], uint32_t q_tile) const { issue_sdp(acc, q_tile, sm.k()); }
  JF_DEVICE void issue_dp(float (&acc)[kSR], uint32_t do_tile) const { issue_sdp<kDv>(acc, do_tile, sm.v()); }

  // The registers of a step besides S and dP (BwdMainloop::consume declares
  // them, step fills them): the two dQ slices, the row statistics, P (unless
  // in place: softcap), the 16-bit P and dS fragments.
  struct StepRegs {
    float dq0[kQR], dq1[kQR];
    float lse[2];
    float pr_own[kSoftcap ? 1 : kSR];
    float dl[2];
    uint32_t pf[kPK][4], dsf[kPK][4];
  };
  // The rest of step `it` (query block at m0; stage s of Q, sd of dO) once S
  // is ready and dP issued: P, dS, the dV^T, dQ, dK^T GEMMs, dQ to the writer
  // warp, the releases (see the top).
  JF_DEVICE void step(int it, const BwdTile& w, int n0, int m0, int s, int sd, float (&sc)[kSR],
                      float (&dp)[kSR], StepRegs& x, float (&dk)[kKR], float (&dv)[kVR],
                      float scale_log2, float softcap_pre) const {
    using namespace ptx;
    // The thread's S / dP rows (queries within the block): r0 and r0 + 8
    // (element i is row r0 + 8 ((i / 2) % 2)); its first key column.
    const int r0 = 16 * warp + lane / 4;
    const int key0 = n0 + kWN * wg + 2 * (lane % 4);
    float(&dq0)[kQR] = x.dq0;
    float(&dq1)[kQR] = x.dq1;
    float(&lse)[2] = x.lse;
    float(&dl)[2] = x.dl;
    float(&pr_own)[kSoftcap ? 1 : kSR] = x.pr_own;
    uint32_t(&pf)[kPK][4] = x.pf;
    uint32_t(&dsf)[kPK][4] = x.dsf;

    // ---- P, dS. Row statistics of the thread's two queries.
    lse[0] = ld_shared_f32(sm.lse(s) + 4 * r0);
    lse[1] = ld_shared_f32(sm.lse(s) + 4 * (r0 + 8));
    if constexpr (kSoftcap) {  // tanh' needs the finite scores: before the mask
      wgmma_wait<0>();
      fence_regs(dp);
      dl[0] = ld_shared_f32(sm.delta(sd) + 4 * r0);
      dl[1] = ld_shared_f32(sm.delta(sd) + 4 * (r0 + 8));
#pragma unroll
      for (int i = 0; i < kSR; ++i) {
        const float t = softcap_tanh<Cfg::kSoftcapTanhExp>(sc[i] * softcap_pre);
        sc[i] = t;
        dp[i] = (dp[i] - dl[(i / 2) % 2]) * (1.f - t * t);
      }
    }
    if constexpr (kPacked) {
      if (a.mask.block_needs_mask(w.batch, m0, kBM, n0 + kWN * wg, kWN))
        apply_mask<true>(sc, a.mask, w.batch, m0 + r0, key0, a.mask.rows_exact(w.batch, m0, kBM));
    } else {
      if (a.mask.block_needs_mask_by_position(m0, kBM, n0 + kWN * wg, kWN))
        apply_mask<false>(sc, a.mask, w.batch, m0 + r0, key0, false);
    }
    // P into its own registers (see BwdKeySplit: in place, ptxas would
    // wait for the dP GEMM before writing them); in place with softcap.
    float(&pr)[kSR] = *select_p<kSoftcap>(&sc, &pr_own);
#pragma unroll
    for (int i = 0; i < kSR; ++i) pr[i] = exp2_approx(fmaf(sc[i], scale_log2, -lse[(i / 2) % 2]));
    if constexpr (!kSoftcap) {
      fence_regs(pr);   // P computed while the dP GEMM runs (not sunk below the wait)
      wgmma_wait<0>();  // dP ready
      fence_regs(dp);
      dl[0] = ld_shared_f32(sm.delta(sd) + 4 * r0);
      dl[1] = ld_shared_f32(sm.delta(sd) + 4 * (r0 + 8));
#pragma unroll
      for (int i = 0; i < kSR; ++i) dp[i] = pr[i] * (dp[i] - dl[(i / 2) % 2]);
    } else {
#pragma unroll
      for (int i = 0; i < kSR; ++i) dp[i] *= pr[i];
    }

    // ---- 16-bit P^T, dS^T -> shared memory (buffers it & 1: the PdS
    // barrier of step it - 1 is passed only once both WGs finished step
    // it - 2, the last reader of these buffers)
    acc_to_a<Element>(pr, pf);
    acc_to_a<Element>(dp, dsf);
    const uint32_t pt_tile = sm.p(it & 1), dst_tile = sm.ds(it & 1);
    store_t(pf, pt_tile);
    store_t(dsf, dst_tile);
    fence_proxy_async_smem();  // stmatrix (generic proxy) -> wgmma reads (async proxy)
    named_bar_sync(kBwdBarPdS, 256);

    // ---- dV^T += dO^T P, dQ slice 0 = dS K, dK^T += Q^T dS issued together
    fence_regs(dv);
    fence_regs(dk);
    wgmma_fence();
    issue_dkv<kVB>(dv, sm.dout(sd), pt_tile);
    wgmma_commit();
    issue_dq(dq0, dst_tile, 0);
    wgmma_commit();
    issue_dkv<kKB>(dk, sm.q(s), dst_tile);
    wgmma_commit();
    wgmma_wait<2>();  // dV^T done: dO is free
    fence_regs(dv);
    mbar_arrive(sm.empty_do(sd));
    wgmma_wait<1>();  // dQ slice 0 done
    fence_regs(dq0);
    Dq::stage(sm, wg, warp, lane, dq0);
    // (Fence and commit inside the branch: else ptxas injects them there.)
    if (wg == 1) {  // its second dQ slice runs behind its dK^T
      wgmma_fence();
      issue_dq(dq1, dst_tile, 1);
      wgmma_commit();
      wgmma_wait<1>();  // dK^T done: Q is free
      fence_regs(dk);
      mbar_arrive(sm.empty_q(s));
      wgmma_wait<0>();
      fence_regs(dq1);
      Dq::stage(sm, wg, warp, lane, dq1);
    } else {
      wgmma_wait<0>();  // dK^T done: Q is free
      fence_regs(dk);
      mbar_arrive(sm.empty_q(s));
    }
  }
};

}  // namespace jax_flash::sm90
