// The key split of the sm90 backward's consumer warpgroups (hdim 64, 128:
// BwdConfig::kSdpSwapAB): warpgroup wg owns keys [64 wg, 64 wg + 64) of the
// block, its dK and dV rows (64 x D each) in registers. Per step, after the
// mainloop's S^T = K_wg Q^T and dP^T = V_wg dO^T (wgmma SS, A = K / V rows,
// B = Q / dO, both K-major, N = kBlockM):
//   P^T  = 2^(S^T scale_log2 - lse_log2[q]),  dS^T = P^T (dP^T - delta[q])
//          (softcap: S^T <- tanh, dS^T *= 1 - tanh^2; the mask between)
//   dV  += P^T dO          wgmma RS  (P^T packed from the accumulator; dO MN-major)
//   dS^T -> dS (queries x keys, K-major) in shared memory, stmatrix.trans
//   --- both WGs' dS written (named barrier PdS)
//   dQ   = dS K            wgmma SS  (64 x 64 per WG; K MN-major; kBlockM 80:
//                          dQ^T = K^T dS^T, 64 columns x 80 queries per WG)
//   dK  += dS^T Q          wgmma RS  (Q MN-major)
//   dQ -> staging tile (BwdDqAccumulator::stage)
// Releases: dO (empty_do) once dV is done, Q (empty_q) once dK is done.
// Dropout (Cfg::kDropout): with the keep mask Z and k = 1 / (1 - rate),
//   dS^T = P^T (k Z dP^T - delta),  dV += (Z P^T) dO  (k applied to dV once,
// at the end: BwdMainloop::consume). The generator draws a query row's keys
// (philox.h), S^T holds keys in rows: draw_dropout writes the WG's mask by
// query rows to shared memory while the step's GEMMs run, the dS loop reads
// it back transposed. Cfg::kDropProducer: warps 2-3 of the producer
// warpgroup draw both WGs' masks of a step into the same buffers
// (draw_masks, bwd_drop_mask.h's bit layout), the consumers wait for them on
// full_drop and release them on empty_drop after reading.
#pragma once

#include "bwd_dq.cuh"
#include "bwd_drop_mask.h"
#include "bwd_tile.cuh"
#include "jax_flash/philox.h"
#include "sm90/ptx/wgmma.cuh"

namespace jax_flash::sm90 {

// kPacked: packed sequences (tile spans; fwd_tuning.h `packed`): the
// spans' query-block ranges and masks, in kernels of their own.
template <typename Element, typename Cfg, bool kSoftcap, bool kDqTensor, bool kPacked = false>
struct BwdKeySplit {
  static_assert(Cfg::kSdpSwapAB, "the key split computes S^T");
  static_assert(Cfg::kStagesDo == Cfg::kStages, "one stage index for Q and dO");
  using Dq = BwdDqAccumulator<Cfg, kDqTensor>;
  static constexpr int kD = Cfg::kHeadDim;
  static constexpr int kBM = Cfg::kBlockM;
  static constexpr int kBN = Cfg::kBlockN;
  static constexpr int kSR = kBM / 2;   // S^T / dP^T registers (64 x kBlockM)
  static constexpr int kKR = kD / 2;    // dK / dV registers (64 x D)
  static constexpr int kVR = kKR;
  // dQ registers: 64 x 64 (dQ_swapAB: dQ^T, 64 columns x kBlockM queries)
  static constexpr int kQR = Cfg::kDqSwapAB ? kBM / 2 : Cfg::kDqCols / 2;
  static_assert(!Cfg::kDqSwapAB || kDqTensor, "dQ_swapAB: tensor reductions only");
  static constexpr int kPK = kBM / 16;  // k-steps of dV / dK (P^T, dS^T fragments)
  // The WG's part of the dK / dV tiles (BwdEpilogue): its 64 rows, every column.
  static constexpr int kKvRows = 64;
  static constexpr int kKvCols = kD;
  // Segment-id mask: 0 = fully unrolled (the -inf writes interleaved with the
  // loads); kBlockM 80 with softcap: mismatch bits in 2 batches of 5 query
  // pairs (fully unrolled, the 20 query ids in flight spill 36 bytes there).
  static constexpr int kMaskSegUnroll = (kSoftcap && Cfg::kDqSwapAB) ? 5 : 0;

  const BwdKernelArgs& a;
  const BwdSmem<Cfg>& sm;
  int wg, warp, lane;

  // Descriptors of k-step 0 of each GEMM (static: also used by the host-side
  // layout check). The k-step offsets are KMajorStep / MNMajorStep.
  // S^T (or dP^T) = A_wg B^T: A = rows [64 wg, 64 wg + 64) of a K-major
  // [D/64][kBlockN][64] tile (K or V), B = a K-major [D/64][kBlockM][64] tile
  // (Q or dO).
  static JF_DEVICE uint64_t sdp_desc_a(int wg, uint32_t a_tile) {
    return ptx::make_desc(ptx::kDescKMajor, a_tile + 64 * wg * 128);
  }
  static JF_DEVICE uint64_t sdp_desc_b(uint32_t b_tile) { return ptx::make_desc(ptx::kDescKMajor, b_tile); }
  using SdpStepA = KMajorStep<kBN>;
  using SdpStepB = KMajorStep<kBM>;
  // dV += P^T dO (or dK += dS^T Q): A from registers (K = kBlockM queries),
  // B = an MN-major [D/64][kBlockM][64] tile (dO or Q), N = D.
  static JF_DEVICE uint64_t dkv_desc_b(uint32_t b_tile) {
    return ptx::make_desc(ptx::desc_mn_major<kBM>(), b_tile);
  }
  using DkvStepB = MNMajorStep;
  // dQ tile of this WG = dS[rows] K[:, cols]: A = dS rows [64 wgM, +64) of
  // the K-major [kBlockN/64][kBlockM][64] dS buffer, B = column block wgN of
  // K ([D/64][kBlockN][64], MN-major), N = 64, K = kBlockN keys.
  static constexpr int dq_wg_m(int wg) { return Cfg::kDqSplitM == 2 ? wg : 0; }
  static constexpr int dq_wg_n(int wg) { return Cfg::kDqSplitN == 2 ? wg : 0; }
  static JF_DEVICE uint64_t dq_desc_a(int wg, uint32_t ds_tile) {
    return ptx::make_desc(ptx::kDescKMajor, ds_tile + 64 * dq_wg_m(wg) * 128);
  }
  static JF_DEVICE uint64_t dq_desc_b(int wg, uint32_t k_tile) {
    return ptx::make_desc(ptx::desc_mn_major<kBN>(), k_tile + dq_wg_n(wg) * kBN * 128);
  }
  using DqStepA = KMajorStep<kBM>;
  using DqStepB = MNMajorStep;
  // dQ_swapAB: dQ^T[cols of WG wg] = K[:, cols]^T dS^T, the same two tiles
  // with the roles swapped: A (m = column, k = key) = dq_desc_b (K, read
  // MN-major: tnspA; M = 64 = one column block), B (n = query, k = key) =
  // dq_desc_a (all kBlockM rows of dS, K-major; kDqSplitM = 1 so its row
  // offset is 0), N = kBlockM.

  // Issue only (no commit / wait).
  JF_DEVICE void issue_sdp(float (&acc)[kSR], uint32_t a_tile, uint32_t b_tile) const {
    ptx::gemm_ss<Element, kBM, 0, kD / 16>(acc, sdp_desc_a(wg, a_tile), sdp_desc_b(b_tile), SdpStepA{},
                                           SdpStepB{}, true);
  }
  JF_DEVICE void issue_dkv(float (&acc)[kKR], const uint32_t (&frag)[kPK][4], uint32_t b_tile) const {
    ptx::gemm_rs<Element, kD, 1, kPK>(acc, frag, dkv_desc_b(b_tile), DkvStepB{}, false);
  }
  JF_DEVICE void issue_dq(float (&acc)[kQR], uint32_t ds_tile) const {
    if constexpr (Cfg::kDqSwapAB) {
      ptx::gemm_ss<Element, kBM, 0, kBN / 16, 1>(acc, dq_desc_b(wg, sm.k()), dq_desc_a(wg, ds_tile), DqStepB{},
                                                DqStepA{}, true);
    } else {
      ptx::gemm_ss<Element, Cfg::kDqCols, 1, kBN / 16>(acc, dq_desc_a(wg, ds_tile), dq_desc_b(wg, sm.k()),
                                                        DqStepA{}, DqStepB{}, true);
    }
  }

  // dS^T (accumulator layout, packed as A fragments) -> the dS buffer
  // (queries x keys, 128B-swizzled K-major), transposing with stmatrix:
  // fragment k covers queries 16k..16k+15 (matrices i = 0..3: queries
  // 16k + 8 (i / 2) + 0..7, keys 64 wg + 16 warp + 8 (i % 2) + 0..7).
  // Byte offset in the dS buffer of the row address that `lane` (warp `warp`
  // of consumer WG `wg`) gives to the stmatrix of fragment k (also used by
  // the host-side layout check, cuda/tests/sm90_bwd_layout_check.cpp).
  static JF_DEVICE uint32_t ds_offset(int wg, int warp, int lane, int k) {
    const int i = lane / 8, c = lane % 8;
    return uint32_t(wg * kBM * 128) + uint32_t((8 * (i / 2) + c) * 128) +
           (uint32_t((2 * warp + (i % 2)) ^ c) << 4) + uint32_t(k * 16 * 128);
  }
  JF_DEVICE void store_ds(const uint32_t (&dsf)[kPK][4], uint32_t ds_tile) const {
#pragma unroll
    for (int k = 0; k < kPK; ++k)
      ptx::stmatrix_x4_trans(ds_tile + ds_offset(wg, warp, lane, k), dsf[k][0], dsf[k][1], dsf[k][2],
                             dsf[k][3]);
  }

  // S^T = K_wg Q^T and dP^T = V_wg dO^T for BwdMainloop::consume (issue only).
  JF_DEVICE void issue_s(float (&acc)[kSR], uint32_t q_tile) const { issue_sdp(acc, sm.k(), q_tile); }
  JF_DEVICE void issue_dp(float (&acc)[kSR], uint32_t do_tile) const { issue_sdp(acc, sm.v(), do_tile); }

  // The registers of a step besides S^T and dP^T (BwdMainloop::consume
  // declares them, step fills them): dQ, P^T (unless in place: softcap), the
  // 16-bit P^T and dS^T fragments.
  // ---- dropout (Cfg::kDropout)
  // The WG's keep mask of step `it` (keys n0 + 64 wg + [0, 64), one 64-key
  // chunk; queries m0 + [0, kBM)) into its shared buffer: word w of query q
  // holds the generator's calls t = 2w (bits 0..15) and 2w + 1 (16..31),
  // bit 16 (t % 2) + c for byte c (key 8 (c / 2) + 2 t + c % 2). Each
  // thread draws whole words (2 calls); the mainloop calls this after
  // issuing the step's S^T and dP^T GEMMs.
  // Cfg::kDropProducer: releases the previous step's buffers (every thread:
  // its reads of them are done, its arrive's release orders them before the
  // mask warps' next writes) and waits for the mask warps' masks of this
  // step, here: between the step's wgmma issues and waits, as the
  // mainloop's own waits (inside step() the wait loop made ptxas spill the
  // dS loop). The last step's buffers are never released: no step reuses them.
  JF_DEVICE void draw_dropout(int it, const BwdTile& w, int n0, int m0, int head) const {
    if constexpr (Cfg::kDropProducer) {
      if (it > 0) ptx::mbar_arrive(sm.empty_drop((it - 1) & 1));
      bwd_wait_full(sm.full_drop(it & 1), uint32_t(it >> 1) & 1u);
    } else if constexpr (Cfg::kDropout) {
      const Dropout d(a.dropout);
      const uint32_t buf = sm.drop(it & 1, wg);
      const uint32_t chunk = uint32_t(n0 + 64 * wg) / 64u;
      const int tid = 32 * warp + lane;
#pragma unroll
      for (int u0 = 0; u0 < 2 * kBM; u0 += 128) {
        const int u = u0 + tid;
        if (2 * kBM % 128 == 0 || u < 2 * kBM) {
          const int word = u / kBM, q = u % kBM;
          uint32_t bits = 0;
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const KeepBits k = d.keep_bits(w.batch, head, m0 + q, chunk, 2 * word + half);
#pragma unroll
            for (int c = 0; c < 16; ++c) bits |= uint32_t(k.keep(c)) << (16 * half + c);
          }
          ptx::st_shared_b32(buf + 4 * (word * Cfg::kDropRowWords + q), bits);
        }
      }
    }
  }
  // Cfg::kDropProducer: mask thread j (0..kDropThreads-1) of the producer
  // warpgroup, step `it` (query block at m0, q head `head`): both WGs' words
  // (bwd_drop_mask.h) into the step parity's buffers, words j, j +
  // kDropThreads, ... (WG, word, query; consecutive threads, consecutive
  // queries). The caller waits for the buffers' release before and arrives
  // on full_drop after.
  static JF_DEVICE void draw_masks(const BwdSmem<Cfg>& sm, const Dropout& d, const DropMaskThreshold& t,
                                   int it, uint32_t batch, int n0, int m0, int head, int j) {
    if constexpr (Cfg::kDropProducer) {
      constexpr int kWords = Cfg::kConsumerWGs * 2 * kBM;
#pragma unroll 1
      for (int u = j; u < kWords; u += Cfg::kDropThreads) {
        const int wg = u / (2 * kBM), word = (u / kBM) % 2, q = u % kBM;
        const uint32_t z = bwd_drop_mask_word(d, t, batch, head, m0 + q, uint32_t(n0 + 64 * wg) / 64u, word);
        ptx::st_shared_b32(sm.drop(it & 1, wg) + 4 * (word * Cfg::kDropRowWords + q), z);
      }
    }
  }
  // This thread's view of the step's mask (after the WG's barrier): the
  // address of its word row (query 0 of word (g / 2) / 2, g = lane / 4 its
  // key row in the warp) and the bit of key row g (h = 0; key row g + 8:
  // + kDropRowShift).
  JF_DEVICE uint32_t drop_row(int it) const {
    return sm.drop(it & 1, wg) + 4 * (((lane / 4) / 4) * Cfg::kDropRowWords + 2 * (lane % 4));
  }
  JF_DEVICE int drop_shift() const {
    if constexpr (Cfg::kDropProducer) {
      return bwd_drop_shift(warp, lane);
    } else {
      const int g = lane / 4;
      return 16 * ((g / 2) % 2) + 4 * warp + g % 2;
    }
  }
  static constexpr int kDropRowShift = Cfg::kDropProducer ? 16 : 2;

  struct StepRegs {
    float dq[kQR];
    float pr_own[kSoftcap ? 1 : kSR];
    uint32_t pf[kPK][4], dsf[kPK][4];
  };
  // The rest of step `it` (query block at m0; stages s of Q and sd == s of
  // dO) once S^T is ready and dP^T issued: P^T, dS^T, the dV, dQ, dK GEMMs,
  // dQ to the writer warp, the releases (see the top).
  JF_DEVICE void step(int it, const BwdTile& w, int n0, int m0, int s, int sd, float (&sc)[kSR],
                      float (&dp)[kSR], StepRegs& x, float (&dk)[kKR], float (&dv)[kVR],
                      float scale_log2, float softcap_pre) const {
    using namespace ptx;
    float(&dq)[kQR] = x.dq;
    float(&pr_own)[kSoftcap ? 1 : kSR] = x.pr_own;
    uint32_t(&pf)[kPK][4] = x.pf;
    uint32_t(&dsf)[kPK][4] = x.dsf;
    // ---- P^T, dS^T. Column (query) statistics from the stat stage:
    // this thread's queries are 8j + 2t + {0, 1}.
    const uint32_t lse_addr = sm.lse(s) + 8 * (lane % 4);
    const uint32_t dl_addr = sm.delta(sd) + 8 * (lane % 4);
    // (kSoftcap is a template parameter: with the wgmma waits under one
    // run-time condition ptxas cannot prove dP^T complete where it is read
    // and serialises the wgmma pipeline, warning C7514.)
    if constexpr (kSoftcap) {  // tanh' needs the finite scores: before the mask
      wgmma_wait<0>();
      fence_regs(dp);
#pragma unroll
      for (int j = 0; j < kSR / 4; ++j) {
        const float2 d2 = ld_shared_v2_f32(dl_addr + 32 * j);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i0 = 4 * j + 2 * h;
          const float t0 = softcap_tanh<Cfg::kSoftcapTanhExp>(sc[i0] * softcap_pre);
          const float t1 = softcap_tanh<Cfg::kSoftcapTanhExp>(sc[i0 + 1] * softcap_pre);
          sc[i0] = t0;
          sc[i0 + 1] = t1;
          dp[i0] = (dp[i0] - d2.x) * (1.f - t0 * t0);
          dp[i0 + 1] = (dp[i0 + 1] - d2.y) * (1.f - t1 * t1);
        }
      }
    }
    if constexpr (kPacked) {
      if (a.mask.block_needs_mask(w.batch, m0, kBM, n0 + 64 * wg, 64))
        apply_mask_t<true, kMaskSegUnroll>(sc, a.mask, w.batch, n0 + 64 * wg + 16 * warp + lane / 4,
                                           m0 + 2 * (lane % 4), a.mask.keys_exact(w.batch, n0 + 64 * wg, 64));
    } else if constexpr (Cfg::kVarlen) {  // the sequence's own mask
      const MaskInfo& mask = bwd_varlen<Cfg>(w).mask;
      if (mask.block_needs_mask_by_position(m0, kBM, n0 + 64 * wg, 64))
        apply_mask_t<false, kMaskSegUnroll>(sc, mask, w.batch, n0 + 64 * wg + 16 * warp + lane / 4,
                                            m0 + 2 * (lane % 4), false);
    } else {
      if (a.mask.block_needs_mask_by_position(m0, kBM, n0 + 64 * wg, 64))
        apply_mask_t<false, kMaskSegUnroll>(sc, a.mask, w.batch, n0 + 64 * wg + 16 * warp + lane / 4,
                                            m0 + 2 * (lane % 4), false);
    }
    // P^T into its own registers: ptxas holds back writes to the S^T
    // accumulator registers (in place) until every wgmma in flight is done,
    // which would serialise this with the dP^T GEMM.
    // (With softcap the dP^T GEMM is already waited for: P^T in place,
    // which keeps the hdim-64 softcap kernel within its registers.)
    float(&pr)[kSR] = *select_p<kSoftcap>(&sc, &pr_own);
#pragma unroll
    for (int j = 0; j < kSR / 4; ++j) {
      const float2 l2 = ld_shared_v2_f32(lse_addr + 32 * j);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i0 = 4 * j + 2 * h;
        pr[i0] = exp2_approx(fmaf(sc[i0], scale_log2, -l2.x));
        pr[i0 + 1] = exp2_approx(fmaf(sc[i0 + 1], scale_log2, -l2.y));
      }
    }
    if constexpr (Cfg::kDropout) {
      static_assert(!kSoftcap, "dropout kernels: no softcap (the sm80 backward serves it)");
      fence_regs(pr);
      // The WG's mask of the step is drawn (kDropProducer: waited for in draw_dropout).
      if constexpr (!Cfg::kDropProducer) named_bar_sync(kBwdBarDrop + wg, 128);
      wgmma_wait<0>();  // dP^T ready
      fence_regs(dp);
      const float keep_scale = dropout_keep_scale(a.dropout);
      const uint32_t z_addr = drop_row(it);
      const int sh = drop_shift();
#pragma unroll
      for (int j = 0; j < kSR / 4; ++j) {
        const float2 d2 = ld_shared_v2_f32(dl_addr + 32 * j);
        const uint2 z = ld_shared_v2_u32(z_addr + 32 * j);  // queries 8j + 2t, 8j + 2t + 1
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i0 = 4 * j + 2 * h;
          const bool k0 = (z.x >> (sh + kDropRowShift * h)) & 1u, k1 = (z.y >> (sh + kDropRowShift * h)) & 1u;
          dp[i0] = pr[i0] * (k0 ? fmaf(dp[i0], keep_scale, -d2.x) : -d2.x);
          dp[i0 + 1] = pr[i0 + 1] * (k1 ? fmaf(dp[i0 + 1], keep_scale, -d2.y) : -d2.y);
          pr[i0] = k0 ? pr[i0] : 0.f;
          pr[i0 + 1] = k1 ? pr[i0 + 1] : 0.f;
        }
      }
    } else if constexpr (!kSoftcap) {
      fence_regs(pr);   // P^T computed while the dP^T GEMM runs (not sunk below the wait)
      wgmma_wait<0>();  // dP^T ready
      fence_regs(dp);
#pragma unroll
      for (int j = 0; j < kSR / 4; ++j) {
        const float2 d2 = ld_shared_v2_f32(dl_addr + 32 * j);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int i0 = 4 * j + 2 * h;
          dp[i0] = pr[i0] * (dp[i0] - d2.x);
          dp[i0 + 1] = pr[i0 + 1] * (dp[i0 + 1] - d2.y);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kSR; ++i) dp[i] *= pr[i];
    }

    // ---- 16-bit P^T, dS^T fragments; dS -> shared memory
    acc_to_a<Element>(pr, pf);
    acc_to_a<Element>(dp, dsf);
    const uint32_t ds_tile = sm.ds(it & 1);
    store_ds(dsf, ds_tile);

    // ---- dV += P^T dO
    fence_regs(pf);
    fence_regs(dv);
    wgmma_fence();
    issue_dkv(dv, pf, sm.dout(sd));
    wgmma_commit();

    // ---- dQ = dS K once both WGs' dS are in shared memory
    fence_proxy_async_smem();  // stmatrix (generic proxy) -> wgmma reads (async proxy)
    named_bar_sync(kBwdBarPdS, 256);
    wgmma_fence();
    issue_dq(dq, ds_tile);
    wgmma_commit();
    wgmma_wait<1>();  // dV done: dO is free
    fence_regs(dv);
    fence_regs(pf);
    mbar_arrive(sm.empty_do(sd));

    // ---- dK += dS^T Q
    fence_regs(dsf);
    fence_regs(dk);
    wgmma_fence();
    issue_dkv(dk, dsf, sm.q(s));
    wgmma_commit();
    wgmma_wait<1>();  // dQ done
    fence_regs(dq);

    // ---- dQ -> staging tile -> (writer warp) dq_accum
    Dq::stage(sm, wg, warp, lane, dq);

    wgmma_wait<0>();  // dK done: Q is free
    fence_regs(dk);
    fence_regs(dsf);
    mbar_arrive(sm.empty_q(s));
  }
};

}  // namespace jax_flash::sm90
