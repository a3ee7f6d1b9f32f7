// The column split of the sm90 backward's consumer warpgroups (hdim 256:
// !BwdConfig::kSdpSwapAB, 64 queries x 64 keys per step). dK and dV of the
// CTA's 64 keys x 256 columns are 128 fp32 registers per consumer thread
// whichever way they are split, so the other accumulators stay small:
// warpgroup wg owns the head-dim columns C = [128 wg, +128) of dK, dV and dQ
// and, per step, after the mainloop's S = Q K_wg^T and dP = dO V_wg^T (wgmma
// SS, 64 x 32: keys [32 wg, +32), K = 256):
//   P  = 2^(S scale_log2 - lse_log2[q]),  dS = P (dP - delta[q])
//        (softcap: S <- tanh, dS *= 1 - tanh^2; the mask between)
//   P, dS -> [query][key] 16-bit tiles (stmatrix), double buffered
//   --- both WGs' P and dS written (named barrier PdS)
//   dV[:, C] += P^T dO[:, C]    wgmma SS, 64 x 128, K = 64 queries; A = P^T
//                               read MN-major from the P tile (tnspA), B = dO
//                               MN-major
//   dQ[:, C0] = dS K[:, C0]     wgmma SS, 64 x 64 (C0 = the first 64 of C),
//                               K = 64 keys; A = dS K-major, B = K MN-major
//   dK[:, C] += dS^T Q[:, C]    as dV
//   dQ[:, C0] -> staging tile (BwdDqAccumulator::stage), then dQ[:, C1] likewise
// Registers: dK, dV 64 each; S, dP, P 16 each; dQ 32 per slice.
// Releases: dO (empty_do, 1 stage) once dV is done (first of the three
// GEMMs, so that the producer can refill it early), Q once dK is done.
// Dropout (Cfg::kDropout): with the keep mask Z and k = 1 / (1 - rate),
//   dS = P (k Z dP - delta),  dV += (Z P)^T dO  (k applied to dV once, at
// the end: BwdMainloop::consume). S rows are queries, so each thread applies
// its rows' bits in registers; one Philox call (a row's 64-key chunk) covers
// both WGs' 32 keys, so draw_dropout (under the step's S and dP GEMMs) draws
// one row per thread, r0 + 8 wg, and the WGs swap the halves through shared
// memory (BwdDropoutConfig).
//
// The head-dim pair 192 / 128 (Cfg::kPair; 2 dO stages): S has K = 192, dP
// K = 128; dK (3 column blocks of 64), dV (2) and dQ (3) are 8 GEMMs of
// 64 x 64 x 64 per step, 4 per WG, so the WGs own column blocks:
//   WG 0: dK blocks 1-2 (one 64 x 128 GEMM), dV block 0, dQ block 0
//   WG 1: dK block 0,                        dV block 1, dQ blocks 1, 2
// (dk: 64 registers, WG 1 uses the first 32; dv: 32). The dK GEMM's width
// and WG 1's second dQ slice are branches on the (warpgroup-uniform) WG.
#pragma once

#include "bwd_dq.cuh"
#include "bwd_tile.cuh"
#include "jax_flash/philox.h"
#include "sm90/ptx/wgmma.cuh"

namespace jax_flash::sm90 {

template <typename Element, typename Cfg, bool kSoftcap, bool kDqTensor, bool kPacked = false>
struct BwdColumnSplit {
  static_assert(!Cfg::kSdpSwapAB && Cfg::kConsumerWGs == 2, "hdim-256 / pair work split");
  using Dq = BwdDqAccumulator<Cfg, kDqTensor>;
  static constexpr bool kPair = Cfg::kPair;
  static constexpr int kD = Cfg::kHeadDim;
  static constexpr int kDv = Cfg::kHeadDimV;
  static constexpr int kBM = Cfg::kBlockM;
  static constexpr int kBN = Cfg::kBlockN;
  static_assert(kBM == 64 && kBN == 64, "P / dS tiles are one 128-byte swizzle column block");
  static constexpr int kWN = kBN / 2;           // S / dP keys per WG
  static constexpr int kWD = kD / 2;            // dK / dV / dQ columns per WG
  static constexpr int kSR = kWN / 2;           // S / dP registers (64 x 32)
  static constexpr int kKR = kPair ? 64 : kWD / 2;  // dK registers (64 x 128; the pair: WG 0's 2 blocks)
  static constexpr int kVR = kPair ? 32 : kKR;      // dV registers (the pair: one block)
  static constexpr int kQR = Cfg::kDqCols / 2;  // dQ registers per slice (64 x 64)
  static constexpr int kPK = kWN / 16;          // 16-key fragments of P / dS
  static_assert(kPair || Cfg::kDqSlices * Cfg::kDqCols == kWD, "dQ slices cover the WG's columns");
  // The WG's part of the dK / dV tiles (BwdEpilogue): every row, its columns
  // (the pair: the most, WG 0's dK; BwdEpilogue asks dk_block0 / dk_blocks).
  static constexpr int kKvRows = kBN;
  static constexpr int kKvCols = kPair ? 128 : kWD;
  // The pair's column blocks of WG wg (see the top): dK [dk_block0, +dk_blocks),
  // dV dv_block; dQ slice sl: block wg + sl (Cfg::dq_col0).
  static constexpr int dk_block0(int wg) { return 1 - wg; }
  static constexpr int dk_blocks(int wg) { return 2 - wg; }
  static constexpr int dv_block(int wg) { return wg; }

  const BwdKernelArgs& a;
  const BwdSmem<Cfg>& sm;
  int wg, warp, lane;

  // Descriptors of k-step 0 of each GEMM (static: also used by the host-side
  // layout check, cuda/tests/sm90_bwd_layout_check.cpp).
  // S (or dP) = A B^T: A = the Q (dO) tile, K-major [D/64][kBM][64]; B = rows
  // [32 wg, +32) of the K (V) tile, K-major [D/64][kBN][64] (row 32 wg starts
  // 4 KB in: the swizzle phase is unchanged).
  static JF_DEVICE uint64_t sdp_desc_a(uint32_t a_tile) { return ptx::make_desc(ptx::kDescKMajor, a_tile); }
  static JF_DEVICE uint64_t sdp_desc_b(int wg, uint32_t b_tile) {
    return ptx::make_desc(ptx::kDescKMajor, b_tile + kWN * wg * 128);
  }
  using SdpStepA = KMajorStep<kBM>;
  using SdpStepB = KMajorStep<kBN>;
  // dV += P^T dO (or dK += dS^T Q): A (m = key, k = query) = the [query][key]
  // P (dS) tile read MN-major (M = 64: one 128-byte row block, LBO unused);
  // B (k = query, n = column) = column blocks 2 wg, 2 wg + 1 of the dO (Q)
  // tile, MN-major (LBO = kBM * 128: the next column block). Both step 16
  // query rows per k-step.
  static JF_DEVICE uint64_t dkv_desc_a(uint32_t pds_tile) {
    return ptx::make_desc(ptx::desc_mn_major<kBM>(), pds_tile);
  }
  static JF_DEVICE uint64_t dkv_desc_b(int wg, uint32_t b_tile) {
    return dkv_desc_b_block((kWD / 64) * wg, b_tile);
  }
  // ... from column block cb of the B tile.
  static JF_DEVICE uint64_t dkv_desc_b_block(int cb, uint32_t b_tile) {
    return ptx::make_desc(ptx::desc_mn_major<kBM>(), b_tile + cb * kBM * 128);
  }
  using DkvStepA = MNMajorStep;
  using DkvStepB = MNMajorStep;
  // dQ slice sl of this WG = dS K[:, 64 c, +64), c = 2 wg + sl: A = the dS
  // tile K-major (m = query, k = key), B = column block c of K, MN-major
  // (k = key). N = 64, K = 64 keys.
  static JF_DEVICE uint64_t dq_desc_a(uint32_t ds_tile) { return ptx::make_desc(ptx::kDescKMajor, ds_tile); }
  static JF_DEVICE uint64_t dq_desc_b(int wg, int sl, uint32_t k_tile) {
    return ptx::make_desc(ptx::desc_mn_major<kBN>(),
                          k_tile + (kPair ? Cfg::dq_col0(wg, sl) / 64 : (kWD / 64) * wg + sl) * kBN * 128);
  }
  using DqStepA = KMajorStep<kBM>;
  using DqStepB = MNMajorStep;

  // Issue only (no commit / wait).
  // S: K = kD (Q, K); dP: K = kDv (dO, V).
  template <int kDepth = kD>
  JF_DEVICE void issue_sdp(float (&acc)[kSR], uint32_t a_tile, uint32_t b_tile) const {
    ptx::gemm_ss<Element, kWN, 0, kDepth / 16>(acc, sdp_desc_a(a_tile), sdp_desc_b(wg, b_tile), SdpStepA{},
                                               SdpStepB{}, true);
  }
  JF_DEVICE void issue_dkv(float (&acc)[kKR], uint32_t pds_tile, uint32_t b_tile) const {
    ptx::gemm_ss<Element, kWD, 1, kBM / 16, /*kTransA=*/1>(acc, dkv_desc_a(pds_tile), dkv_desc_b(wg, b_tile),
                                                            DkvStepA{}, DkvStepB{}, false);
  }
  // The pair: kN columns of dV or dK from column block cb of dO or Q.
  template <int kN>
  JF_DEVICE void issue_dkv_block(float (&acc)[kN / 2], uint32_t pds_tile, uint32_t b_tile, int cb) const {
    ptx::gemm_ss<Element, kN, 1, kBM / 16, /*kTransA=*/1>(acc, dkv_desc_a(pds_tile), dkv_desc_b_block(cb, b_tile),
                                                           DkvStepA{}, DkvStepB{}, false);
  }
  JF_DEVICE void issue_dq(float (&acc)[kQR], uint32_t ds_tile, int sl) const {
    ptx::gemm_ss<Element, Cfg::kDqCols, 1, kBN / 16>(acc, dq_desc_a(ds_tile), dq_desc_b(wg, sl, sm.k()),
                                                      DqStepA{}, DqStepB{}, true);
  }

  // P or dS (accumulator layout, packed pairwise as by acc_to_a) -> the
  // [query][key] tile (128-byte rows, 128B swizzle) with stmatrix: fragment
  // k's matrix i holds queries 16 warp + 8 (i % 2) + 0..7 and keys
  // 32 wg + 16 k + 8 (i / 2) + 0..7 (registers a[k][i] = d[8k + 2i], d[8k + 2i + 1]).
  // Byte offset in the tile of the row address that `lane` gives to the
  // stmatrix of fragment k (lane 8 i + c: row c of matrix i). The 8 rows of a
  // matrix land in 8 distinct 16-byte chunks: no bank conflicts.
  static JF_DEVICE uint32_t pds_offset(int wg, int warp, int lane, int k) {
    const int i = lane / 8, c = lane % 8;
    const int chunk = (kWN / 8) * wg + 2 * k + i / 2;  // 16-byte column chunk (8 keys)
    return uint32_t((16 * warp + 8 * (i % 2) + c) * 128) + (uint32_t(chunk ^ c) << 4);
  }
  JF_DEVICE void store_pds(const uint32_t (&f)[kPK][4], uint32_t tile) const {
#pragma unroll
    for (int k = 0; k < kPK; ++k)
      ptx::stmatrix_x4(tile + pds_offset(wg, warp, lane, k), f[k][0], f[k][1], f[k][2], f[k][3]);
  }

  // S = Q K_wg^T and dP = dO V_wg^T for BwdMainloop::consume (issue only).
  JF_DEVICE void issue_s(float (&acc)[kSR], uint32_t q_tile) const { issue_sdp(acc, q_tile, sm.k()); }
  JF_DEVICE void issue_dp(float (&acc)[kSR], uint32_t do_tile) const { issue_sdp<kDv>(acc, do_tile, sm.v()); }

  // ---- dropout (Cfg::kDropout)
  // The keep bits of one generator call (a row's 64-key chunk, philox.h
  // KeepBits) packed into one word: byte c of output word j (keys
  // 8 (2j + c / 2) + 2t + c % 2) at bit 8 + 16 (c / 2) + 2j + c % 2. Shifted
  // right by 4 wg, the word holds WG wg's keys at keep_bit(m, e).
  static JF_DEVICE uint32_t pack_keep(const KeepBits& k) {
    uint32_t f = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) f |= ((k.lo[j] & 0x01000100u) | ((k.hi[j] & 0x01000100u) << 1)) << (2 * j);
    return f;
  }
  // Accumulator element 4m + 2h + e (key 32 wg + 8m + 2t + e: byte
  // 8 wg + 2m + e of the call) in the word shifted by 4 wg.
  static constexpr int keep_bit(int m, int e) { return 8 + 16 * (m % 2) + 2 * (m / 2) + e; }
  // The query row whose call the thread draws: r0 + 8 wg of the block at m0.
  static JF_DEVICE int drop_row(int m0, int wg, int warp, int lane) { return m0 + 16 * warp + lane / 4 + 8 * wg; }
  // This thread's word of the step: its row's call for the block's 64 keys,
  // for itself and the thread of the same warp and lane in the other WG;
  // the mainloop calls this after issuing the step's S and dP GEMMs. One
  // buffer (BwdDropoutConfig), so the step's parity is unused.
  JF_DEVICE void draw_dropout(int /*it*/, const BwdTile& w, int n0, int m0, int head) const {
    if constexpr (Cfg::kDropout) {
      const Dropout d(a.dropout);
      const KeepBits k = d.keep_bits(w.batch, head, drop_row(m0, wg, warp, lane), uint32_t(n0) / 64u, lane % 4);
      ptx::st_shared_b32(drop_word(), pack_keep(k));
      ptx::named_bar_arrive(kBwdBarDrop + wg, 256);  // read by the other WG after its sync
    }
  }
  // The address of this thread's words: [0] drawn by WG 0 (row r0), [1] by
  // WG 1 (row r0 + 8); its own at + 4 wg.
  JF_DEVICE uint32_t drop_pair() const { return sm.drop_words() + 8 * (32 * warp + lane); }
  JF_DEVICE uint32_t drop_word() const { return drop_pair() + 4 * wg; }

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
  // is ready and dP issued: P, dS, the dV, dQ (two slices), dK GEMMs, dQ to
  // the writer warp, the releases (see the top).
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
    } else if constexpr (Cfg::kVarlen) {  // the sequence's own mask
      const MaskInfo& mask = bwd_varlen<Cfg>(w).mask;
      if (mask.block_needs_mask_by_position(m0, kBM, n0 + kWN * wg, kWN))
        apply_mask<false>(sc, mask, w.batch, m0 + r0, key0, false);
    } else {
      if (a.mask.block_needs_mask_by_position(m0, kBM, n0 + kWN * wg, kWN))
        apply_mask<false>(sc, a.mask, w.batch, m0 + r0, key0, false);
    }
    // P into its own registers (see BwdKeySplit: in place, ptxas would
    // wait for the dP GEMM before writing them); in place with softcap.
    float(&pr)[kSR] = *select_p<kSoftcap>(&sc, &pr_own);
#pragma unroll
    for (int i = 0; i < kSR; ++i) pr[i] = exp2_approx(fmaf(sc[i], scale_log2, -lse[(i / 2) % 2]));
    if constexpr (Cfg::kDropout) {
      static_assert(!kSoftcap, "dropout kernels: no softcap (the sm80 backward serves it)");
      fence_regs(pr);
      named_bar_sync(kBwdBarDrop + 1 - wg, 256);  // the other WG's words of the step are written
      const uint2 z2 = ld_shared_v2_u32(drop_pair());
      wgmma_wait<0>();  // dP ready
      fence_regs(dp);
      dl[0] = ld_shared_f32(sm.delta(sd) + 4 * r0);
      dl[1] = ld_shared_f32(sm.delta(sd) + 4 * (r0 + 8));
      const float keep_scale = dropout_keep_scale(a.dropout);
      const uint32_t z[2] = {z2.x >> (4 * wg), z2.y >> (4 * wg)};  // rows r0, r0 + 8
#pragma unroll
      for (int i = 0; i < kSR; ++i) {
        const int h = (i / 2) % 2;
        const bool keep = (z[h] >> keep_bit(i / 4, i % 2)) & 1u;
        dp[i] = pr[i] * (keep ? fmaf(dp[i], keep_scale, -dl[h]) : -dl[h]);
        pr[i] = keep ? pr[i] : 0.f;
      }
    } else if constexpr (!kSoftcap) {
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

    // ---- 16-bit P, dS -> shared memory (buffers it & 1: the PdS barrier
    // of step it - 1 is passed only once both WGs finished step it - 2,
    // the last reader of these buffers)
    acc_to_a<Element>(pr, pf);
    acc_to_a<Element>(dp, dsf);
    store_pds(pf, sm.p(it & 1));
    store_pds(dsf, sm.ds(it & 1));
    const uint32_t p_tile = sm.p(it & 1), ds_tile = sm.ds(it & 1);
    fence_proxy_async_smem();  // stmatrix (generic proxy) -> wgmma reads (async proxy)
    named_bar_sync(kBwdBarPdS, 256);

    if constexpr (kPair) {
      pair_gemms(s, sd, p_tile, ds_tile, dq0, dq1, dk, dv);
    } else {
      // ---- dV += P^T dO, dQ slice 0 = dS K, dK += dS^T Q
      fence_regs(dv);
      fence_regs(dk);
      wgmma_fence();
      issue_dkv(dv, p_tile, sm.dout(sd));
      wgmma_commit();
      issue_dq(dq0, ds_tile, 0);
      wgmma_commit();
      issue_dkv(dk, ds_tile, sm.q(s));
      wgmma_commit();
      wgmma_wait<2>();  // dV done: dO is free
      fence_regs(dv);
      mbar_arrive(sm.empty_do(sd));
      wgmma_wait<1>();  // dQ slice 0 done
      fence_regs(dq0);
      Dq::stage(sm, wg, warp, lane, dq0);

      // ---- dQ slice 1 (while dK runs)
      wgmma_fence();
      issue_dq(dq1, ds_tile, 1);
      wgmma_commit();
      wgmma_wait<1>();  // dK done: Q is free
      fence_regs(dk);
      mbar_arrive(sm.empty_q(s));
      wgmma_wait<0>();
      fence_regs(dq1);
      Dq::stage(sm, wg, warp, lane, dq1);
    }
  }

  // The pair's GEMMs of a step, once both WGs' P and dS are in shared memory
  // (see the top for the column blocks): dV, dQ slice 0, dK issued together;
  // dO released once dV is done, Q once dK is; WG 1's second dQ slice runs
  // behind its dK.
  JF_DEVICE void pair_gemms(int s, int sd, uint32_t p_tile, uint32_t ds_tile, float (&dq0)[kQR],
                            float (&dq1)[kQR], float (&dk)[kKR], float (&dv)[kVR]) const {
    using namespace ptx;
    float(&dk_lo)[kKR / 2] = *reinterpret_cast<float(*)[kKR / 2]>(&dk[0]);
    fence_regs(dv);
    fence_regs(dk);
    wgmma_fence();
    issue_dkv_block<64>(dv, p_tile, sm.dout(sd), dv_block(wg));
    wgmma_commit();
    issue_dq(dq0, ds_tile, 0);
    wgmma_commit();
    // (Fence and commit inside each branch: else ptxas injects them there.)
    if (wg == 0) {
      wgmma_fence();
      issue_dkv_block<128>(dk, ds_tile, sm.q(s), dk_block0(0));
      wgmma_commit();
    } else {
      wgmma_fence();
      issue_dkv_block<64>(dk_lo, ds_tile, sm.q(s), dk_block0(1));
      wgmma_commit();
    }
    wgmma_wait<2>();  // dV done: dO is free
    fence_regs(dv);
    mbar_arrive(sm.empty_do(sd));
    wgmma_wait<1>();  // dQ slice 0 done
    fence_regs(dq0);
    Dq::stage(sm, wg, warp, lane, dq0);
    if (wg == 1) {
      wgmma_fence();
      issue_dq(dq1, ds_tile, 1);
      wgmma_commit();
      wgmma_wait<1>();  // dK done: Q is free
      fence_regs(dk);
      mbar_arrive(sm.empty_q(s));
      wgmma_wait<0>();
      fence_regs(dq1);
      Dq::stage(sm, wg, warp, lane, dq1);
    } else {
      wgmma_wait<0>();  // dK done: Q is free
      fence_regs(dk);
      mbar_arrive(sm.empty_q(s));
    }
  }
};

}  // namespace jax_flash::sm90
