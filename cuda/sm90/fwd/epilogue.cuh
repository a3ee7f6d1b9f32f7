// Forward epilogue of one consumer warpgroup: O normalised once (x 1/l),
// converted to the element type, written to shared memory in the
// 128B-swizzled tile layout, then stored by TMA (one box of 64 rows x one
// 128-byte row per column block of the value head dim; TMA clips rows >=
// seqlen_q and columns >= head_dim_v, so the tails need no special code). LSE (natural
// log) goes straight from registers; rows without a visible key get O = 0 and
// LSE = -inf (the head's sink logit with sinks).
//
// Where O is staged (kOStage):
// - kOwnTile: its own tile after the mainloop's, when it fits;
// - kInQ: the Q tile (the WG's own 64 Q rows, dead once its last QK^T
//   finished; the storing thread then releases Q to the producer once TMA has
//   read the tile out). Both tiles are [column block][kBlockM rows][128 B], so
//   O's kHeadDimV columns lie within Q's kHeadDim in the WG's own rows;
// - kInV (FwdTuning::o_in_v, FA3's smem_o-aliases-smem_v): the V ring; all
//   consumer WGs meet before writing it, the storing threads arrive on o_free
//   once TMA has read it, and the producer's next V load waits for that.
#pragma once

#include "fwd_named_barriers.h"
#include "mainloop.cuh"
#include "sm90/ptx/barrier.cuh"
#include "sm90/ptx/mbarrier.cuh"
#include "sm90/ptx/smem_ops.cuh"
#include "sm90/ptx/tma.cuh"
#include "sm90/ptx/wgmma.cuh"
#include "sm90/common/softmax.cuh"
#include "sm90/common/tma_desc.h"

namespace jax_flash::sm90 {

// Opt-in shared memory of sm_90 minus the 1 KB alignment slack and room for
// the barriers and the scheduler's data.
constexpr int kFwdSmemLimit = 227 * 1024 - 1024 - 256;

template <typename Mainloop>
struct FwdEpilogue {
  using Element = typename Mainloop::OutElement;  // of O (16-bit)
  using Traits = ElementTraits<Element>;
  using Softmax = typename Mainloop::Softmax;
  // 8-bit inputs: O's columns times V's per-channel descales.
  static constexpr bool kVDescale = Mainloop::kBlockScaled;
  static constexpr int kHeadDimV = Mainloop::kHeadDimV;  // O's columns
  static constexpr int kBlockM = Mainloop::kBlockM;
  static constexpr int kConsumerWGs = Mainloop::kConsumerWGs;
  static constexpr int kRowElems = Traits::kSwizzleRow;
  static constexpr int kOBytes = kBlockM * kHeadDimV * Traits::kBytes;
  // Variable-length sequences: rows past the sequence's end belong to the
  // next one, so a warpgroup whose 64 rows cross the end copies its rows
  // from the staged tile with per-row guarded stores instead of the TMA box.
  static constexpr bool kVarlen = Mainloop::kVarlen;

  enum OStage { kOwnTile, kInQ, kInV };
  static constexpr OStage kOStage = Mainloop::kOInV                                ? kInV
                                    : Mainloop::kTileBytes + kOBytes <= kFwdSmemLimit ? kOwnTile
                                                                                      : kInQ;
  static_assert(kOStage != kInV || Mainloop::kStages * Mainloop::kVBytes >= kOBytes,
                "O tile must fit in the V ring");
  // kInQ: O's column blocks of 128-byte rows must be a prefix of Q's, so that
  // each WG writes only its own (dead) Q rows.
  static_assert(kOStage != kInQ ||
                    (kHeadDimV / kRowElems <= Mainloop::kColBlocks && Mainloop::kRowBytes == 128),
                "O tile must fit in the Q tile, in the same 128-byte rows");
  // Whether the epilogue (not the mainloop) releases Q's buffer to the producer.
  static constexpr bool kReleasesQ = kOStage == kInQ;
  // empty_q arrivals: each consumer warp once its QK^T GEMMs are done (or,
  // q_in_regs, once it has read Q into registers), or each WG's storing thread
  // once the O store has read the aliased tile.
  static constexpr int kQEmptyArrivals = kReleasesQ ? kConsumerWGs : 4 * kConsumerWGs;

  // ---------------------------------------------------------------- storage
  static constexpr int kTileBytes = kOStage == kOwnTile ? kOBytes : 0;
  static constexpr int kNumBarriers = kOStage == kInV ? 1 : 0;  // o_free
  struct Smem {
    uint32_t o;        // the staging tile (1 KB aligned)
    uint32_t bars;     // kNumBarriers mbarriers
    uint32_t empty_q;  // kInQ: the mainloop's Q "empty" barrier
    JF_DEVICE uint32_t o_free() const { return bars; }
  };
  JF_DEVICE static void init_barriers(const Smem& sm) {
    if constexpr (kOStage == kInV) ptx::mbar_init(sm.o_free(), kConsumerWGs);  // each WG's storing thread
  }

  // ---------------------------------------------------------------- host -> device
  struct Arguments {
    GmemTensor o;
    float* lse;  // [batch, heads, seqlen_q]
    float scale_eff;                   // SoftmaxScale::scale_eff (the LSE of a raw max)
    const float* v_descale = nullptr;  // kVDescale: [batch, heads_k, kHeadDimV]
    int heads_per_kv = 1;
    float o_scale = 1.f;  // Mainloop::kDropout: the keep scale 1 / (1 - rate), times 1 / l
    const float* sinks = nullptr;  // [batch, heads] sink logits (jax_flash/sinks.h) or nullptr
  };
  struct Params {
    CUtensorMap tm_o;  // box {kRowElems, 64, 1, 1} (one consumer warpgroup's rows)
    float* lse;
    const float* v_descale;
    int num_heads;
    int heads_per_kv;
    int seqlen_q;
    float scale_eff;
    float o_scale;
    const float* sinks;
  };
  static bool to_params(const Arguments& a, Params& p) {
    if (!encode_bshd(&p.tm_o, tma_element<Element>(), a.o, 64)) return false;
    p.lse = a.lse;
    p.v_descale = a.v_descale;
    p.scale_eff = a.scale_eff;
    p.o_scale = a.o_scale;
    p.sinks = a.sinks;
    p.num_heads = a.o.heads;
    p.heads_per_kv = a.heads_per_kv;
    p.seqlen_q = a.o.seqlen;
    return true;
  }
  JF_DEVICE static void prefetch_descriptors(const Params& p) { ptx::prefetch_tmap(&p.tm_o); }

  // ---------------------------------------------------------------- device
  // kVarlen: the staged rows [0, rows) of warpgroup wg to O's rows from
  // row0 (absolute), columns below o.head_dim (all 128 threads of the WG;
  // the staged tile is [column block][kBlockM][128 B], 128B-swizzled).
  JF_DEVICE static void store_rows(const Smem& sm, const GmemTensor& o, int wg, int tid_wg, int rows, int row0,
                                   int head, int batch) {
    constexpr int kChunks = kHeadDimV / 8;  // 16-byte chunks of a row
    char* base = reinterpret_cast<char*>(const_cast<void*>(o.ptr)) +
                 (int64_t(batch) * o.batch_stride + int64_t(head) * o.head_stride) * Traits::kBytes;
    for (int i = tid_wg; i < rows * kChunks; i += 128) {
      const int r = i / kChunks, j = i - r * kChunks;
      if (8 * j >= o.head_dim) continue;
      const uint32_t addr =
          sm.o + (j / 8) * kBlockM * 128 + (64 * wg + r) * 128 + ((uint32_t(j % 8) ^ uint32_t(r % 8)) << 4);
      const uint4 v = ptx::ld_shared_v4_u32(addr);
      *reinterpret_cast<uint4*>(base + (int64_t(row0 + r) * o.row_stride + 8 * j) * Traits::kBytes) = v;
    }
  }

  // Stores warpgroup wg's 64 rows of O and their LSE (all 128 threads of the WG).
  // kVarlen: m0 counts from the start of `seq`, whose rows end at its
  // length; o_rows is O for the guarded stores (store_rows).
  JF_DEVICE static void store(const Params& a, const Smem& sm, int wg, int warp, int lane,
                              const float (&o)[kHeadDimV / 2], const Softmax& smx, int m0,
                              int head, int batch, const VarlenSeq* seq = nullptr,
                              const GmemTensor* o_rows = nullptr) {
    // 16-bit O: a thread's pair of accumulator columns is one 4-byte store.
    static_assert(Traits::kBytes == 2, "O staging of 16-bit elements");
    using namespace ptx;
    const int tid_wg = warp * 32 + lane;
    float inv[2], lse[2];
    smx.finalize(a.scale_eff, inv, lse, sink_of(a.sinks, batch, head, a.num_heads));
    if constexpr (Mainloop::kDropout) {  // the LSE stays the undropped one
      inv[0] *= a.o_scale;
      inv[1] *= a.o_scale;
    }
    const int r_local = 64 * wg + 16 * warp + lane / 4;  // row of h = 0 within the CTA tile
    if (lane % 4 == 0) {
      float* lse_bh = a.lse + (int64_t(batch) * a.num_heads + head) * a.seqlen_q;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = m0 + r_local + 8 * h;
        if constexpr (kVarlen) {
          if (row < seq->len_q) lse_bh[seq->offset_q + row] = lse[h];
        } else {
          if (row < a.seqlen_q) lse_bh[row] = lse[h];
        }
      }
    }
    // The previous tile's store must have read the buffer (own O buffer), and
    // every warp of the WG must be past its last wgmma on Q (aliased buffer).
    // kInV: every consumer WG must be past its last PV (the tile overwrites
    // the V ring); the previous store was waited for before o_free.
    if constexpr (kOStage == kInV) {
      named_bar_sync(kBarOWrite, 128 * kConsumerWGs);
    } else {
      if (kOStage == kOwnTile && tid_wg == 0) bulk_wait_read<0>();
      named_bar_sync(kBarEpilogue + wg, 128);
    }
    {
      // Addresses from a fresh %tid.x (not hoisted out of the tile loop).
      const int t = opaque_tid() % 128, ln = t % 32;
      const int row = 64 * wg + 16 * (t / 32) + ln / 4;  // h = 0; row % 8 == ln / 4
      const uint32_t row_addr = sm.o + row * 128 + 4 * (ln % 4);
      const uint32_t sw = uint32_t(ln / 4) << 4;  // the row's chunk XOR
      // kVDescale: the thread's columns 8j + 2t, 8j + 2t + 1 of this kv head.
      const float* vd = nullptr;
      if constexpr (kVDescale)
        vd = a.v_descale + (int64_t(batch) * (a.num_heads / a.heads_per_kv) + head / a.heads_per_kv) *
                               kHeadDimV + 2 * (ln % 4);
#pragma unroll
      for (int j = 0; j < kHeadDimV / 8; ++j) {
        // Column block j / 8, 16-byte chunk j % 8; rows r and r + 8 share r % 8.
        const uint32_t addr = row_addr + (j / 8) * kBlockM * 128 + ((uint32_t(j % 8) << 4) ^ sw);
        float c0 = 1.f, c1 = 1.f;
        if constexpr (kVDescale) {
          const float2 d = __ldg(reinterpret_cast<const float2*>(vd + 8 * j));
          c0 = d.x;
          c1 = d.y;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t v = kVDescale ? pack2<Element>(o[4 * j + 2 * h] * (inv[h] * c0),
                                                        o[4 * j + 2 * h + 1] * (inv[h] * c1))
                                       : pack2<Element>(o[4 * j + 2 * h] * inv[h],
                                                        o[4 * j + 2 * h + 1] * inv[h]);
          st_shared_b32(addr + h * 8 * 128, v);
        }
      }
    }
    fence_proxy_async_smem();  // st.shared -> TMA (async proxy) reads
    named_bar_sync(kBarEpilogue + wg, 128);
    if constexpr (kVarlen) {
      const int rows = seq->len_q - (m0 + 64 * wg);  // the WG's rows inside the sequence
      if (rows < 64) {  // uniform over the WG
        store_rows(sm, *o_rows, wg, tid_wg, rows, seq->offset_q + m0 + 64 * wg, head, batch);
        named_bar_sync(kBarEpilogue + wg, 128);  // every read of the staged tile is done
        if (tid_wg == 0) {
          if constexpr (kOStage == kInQ) mbar_arrive(sm.empty_q);
          if constexpr (kOStage == kInV) mbar_arrive(sm.o_free());
        }
        __syncwarp();
        return;
      }
    }
    const int o_row0 = kVarlen ? seq->offset_q : 0;
    if (tid_wg == 0) {
#pragma unroll
      for (int cb = 0; cb < kHeadDimV / kRowElems; ++cb)
        tma_store_4d(&a.tm_o, sm.o + cb * kBlockM * 128 + 64 * wg * 128, cb * kRowElems,
                     o_row0 + m0 + 64 * wg, head, batch);
      bulk_commit();
      if constexpr (kOStage == kInQ) {
        bulk_wait_read<0>();
        mbar_arrive(sm.empty_q);
      }
      if constexpr (kOStage == kInV) {  // the producer may refill the V ring
        bulk_wait_read<0>();
        mbar_arrive(sm.o_free());
      }
    }
    __syncwarp();
  }
};

}  // namespace jax_flash::sm90
