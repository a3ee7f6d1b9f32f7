// Forward epilogue of one consumer warpgroup: O normalised once (x 1/l),
// converted to 16 bits, written to shared memory in the 128B-swizzled tile
// layout, then stored by TMA (one box of 64 rows x 64 columns per 64 columns
// of the head dim; TMA clips rows >= seqlen_q and columns >= head_dim, so the
// tails need no special code). LSE (natural log) goes straight from registers;
// rows without a visible key get O = 0 and LSE = -inf.
//
// Shared buffer: its own O tile when it fits, else the Q tile (kOAliasQ: the
// WG's own 64 Q rows, dead once its last QK^T finished; the storing thread
// then releases Q to the producer once TMA has read the tile out), or the V
// ring (Cfg::kOInV, FA3's smem_o-aliases-smem_v: all consumer WGs meet before
// writing it; the storing threads arrive on o_free once TMA has read it).
#pragma once

#include "args.cuh"
#include "ptx/barrier.cuh"
#include "ptx/mbarrier.cuh"
#include "ptx/tma.cuh"
#include "ptx/wgmma.cuh"

namespace jax_flash::sm90 {

template <typename Element, typename Cfg>
JF_DEVICE void epilogue_store(const FwdKernelArgs& a, const SmemPlan<Cfg>& sm, int wg, int warp,
                              int lane, const float (&o)[Cfg::kHeadDim / 2],
                              const OnlineSoftmax& smx, int m0, int head, int batch) {
  using namespace ptx;
  const int tid_wg = warp * 32 + lane;
  float inv[2], lse[2];
  smx.finalize(a.sm.scale_eff, inv, lse);
  const int r_local = 64 * wg + 16 * warp + lane / 4;  // row of h = 0 within the CTA tile
  if (lane % 4 == 0) {
    float* lse_bh = a.lse + (int64_t(batch) * a.num_heads + head) * a.mask.seqlen_q;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m0 + r_local + 8 * h;
      if (row < a.mask.seqlen_q) lse_bh[row] = lse[h];
    }
  }
  // The previous tile's store must have read the buffer (own O buffer), and
  // every warp of the WG must be past its last wgmma on Q (aliased buffer).
  // kOInV: every consumer WG must be past its last PV (the tile overwrites
  // the V ring); the previous store was waited for before o_free.
  if constexpr (Cfg::kOInV) {
    named_bar_sync(kBarOWrite, 128 * Cfg::kConsumerWGs);
  } else {
    if (!Cfg::kOAliasQ && tid_wg == 0) bulk_wait_read<0>();
    named_bar_sync(kBarEpilogue + wg, 128);
  }
  {
    // Addresses from a fresh %tid.x (not hoisted out of the tile loop).
    const int t = opaque_tid() % 128, ln = t % 32;
    const int row = 64 * wg + 16 * (t / 32) + ln / 4;  // h = 0; row % 8 == ln / 4
    const uint32_t row_addr = sm.o() + row * 128 + 4 * (ln % 4);
    const uint32_t sw = uint32_t(ln / 4) << 4;  // the row's chunk XOR
#pragma unroll
    for (int j = 0; j < Cfg::kHeadDim / 8; ++j) {
      // Column block j / 8, 16-byte chunk j % 8; rows r and r + 8 share r % 8.
      const uint32_t addr = row_addr + (j / 8) * Cfg::kBlockM * 128 + ((uint32_t(j % 8) << 4) ^ sw);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t v = pack2<Element>(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
        st_shared_b32(addr + h * 8 * 128, v);
      }
    }
  }
  fence_proxy_async_smem();  // st.shared -> TMA (async proxy) reads
  named_bar_sync(kBarEpilogue + wg, 128);
  if (tid_wg == 0) {
#pragma unroll
    for (int cb = 0; cb < Cfg::kHeadDim / 64; ++cb)
      tma_store_4d(&a.tm_o, sm.o() + cb * Cfg::kBlockM * 128 + 64 * wg * 128, cb * 64, m0 + 64 * wg,
                   head, batch);
    bulk_commit();
    if constexpr (Cfg::kOAliasQ) {
      bulk_wait_read<0>();
      mbar_arrive(sm.empty_q());
    }
    if constexpr (Cfg::kOInV) {  // the producer may refill the V ring
      bulk_wait_read<0>();
      mbar_arrive(sm.o_free());
    }
  }
  __syncwarp();
}

}  // namespace jax_flash::sm90
