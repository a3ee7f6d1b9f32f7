// dQ of the sm90 backward, shared by both work splits: each consumer
// warpgroup stages its dQ tile of a step in shared memory (stage), the dQ
// writer warp adds it into the fp32 dq_accum workspace (store); the launcher's
// dq_convert pass then writes dq = scale * dq_accum in the input dtype.
//
// Writer warp (warp 1 of the producer warpgroup): per step (and dQ slice,
// hdim 256 and the head-dim pair) and consumer warpgroup, waits for the WG's staged 64 x 64 fp32 dQ
// tile (named barrier dQFull), adds it into dq_accum (rows < seqlen_q,
// columns < head_dim) and once the copy engine has read the tile hands it
// back (dQEmpty). FA3's dQ path (store_dq), with bulk reductions into a
// row-major dq_accum [b, h, seqlen_q_rounded, head_dim_rounded] so that the
// dq_convert pass is the one the sm80 family uses.
// Deterministic mode (kDet): the KV blocks add into each dQ tile in a fixed
// order (descending block, bwd_mask.cuh dq_pred_range), through a semaphore
// per (batch, q head, query block) in global memory (BwdKernelArgs::dq_sem).
// Before the step's first reduction the writer waits (polls, then ld.acquire.gpu) until
// block n + 1, if it adds into the tile, has stored n + 2; once its own
// reductions are complete (cp.async.bulk.wait_group, not .read: the adds
// performed) it stores n + 1 (st.release.gpu). fence.proxy.async.global on
// both sides orders the async-proxy reductions with the generic flag accesses.
// Forward progress: block n + 1 of the same (batch, kv head) has the smaller
// tile index (BwdTileOrder<true>) and tiles are claimed in index
// order from a counter by running CTAs (bwd_kernel.cuh), so the CTA waited
// for is resident or done and itself waits only on smaller indices.
#pragma once

#include "bwd_tile.cuh"
#include "sm90/ptx/barrier.cuh"
#include "sm90/ptx/gmem_sync.cuh"
#include "sm90/ptx/smem_ops.cuh"
#include "sm90/ptx/tma.cuh"
#include "sm90/common/tma_desc.h"

namespace jax_flash::sm90 {

// dq_accum [batch, heads, seqlen_q_rounded, pitch] fp32 as a 4-d map
// (head_dim, seqlen_q, heads, batch): the reductions skip the columns past
// head_dim and the rows past seqlen_q. 128B swizzle, box {32, box_rows, 1, 1}
// (box_rows = BwdConfig::kDqRows: 64; 80 with dQ_swapAB).
inline bool encode_dq_accum(CUtensorMap* map, float* ptr, int head_dim, int seqlen_q,
                            int seqlen_q_rounded, int pitch, int heads, int batch, int box_rows = 64) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t row = cuuint64_t(pitch) * 4, head = row * cuuint64_t(seqlen_q_rounded),
                   bat = head * cuuint64_t(heads);
  cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(std::max(seqlen_q, 1)), cuuint64_t(heads),
                        cuuint64_t(batch)};
  cuuint64_t strides[3] = {row, head, bat};
  cuuint32_t box[4] = {32, cuuint32_t(box_rows), 1, 1};
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, ptr, dims, strides, box,
                            elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// kDqTensor: the writer adds each staged tile with two TMA tensor reductions
// (production); else with one bulk reduction per row (kept for measurements
// only, cuda/tests/sm90_bwd_tuning.h).
template <typename Cfg, bool kDqTensor>
struct BwdDqAccumulator {
  static_assert(kDqTensor || !Cfg::kDqSwapAB, "dQ_swapAB: tensor reductions only");

  // ---------------------------------------------------------------- host -> device
  struct Arguments {
    float* dq_accum;       // [batch, heads, seqlen_q_rounded, pitch], zeroed by the launcher
    int head_dim, seqlen_q, seqlen_q_rounded, pitch, heads, batch;
    int* sem;              // deterministic kernels: the semaphores (zeroed by the launcher), else nullptr
    int sem_m_blocks;      // deterministic kernels: ceil(seqlen_q / kBlockM), else 0
  };
  static bool to_params(const Arguments& a, BwdKernelArgs& p) {
    if (!encode_dq_accum(&p.tm_dqacc, a.dq_accum, a.head_dim, a.seqlen_q, a.seqlen_q_rounded, a.pitch,
                         a.heads, a.batch, Cfg::kDqRows))
      return false;
    p.dq_accum = a.dq_accum;
    p.seqlen_q_rounded = a.seqlen_q_rounded;
    p.dq_pitch = a.pitch;
    p.head_dim = a.head_dim;
    p.dq_sem = a.sem;
    p.sem_m_blocks = a.sem_m_blocks;
    return true;
  }
  JF_DEVICE static void prefetch_descriptors(const BwdKernelArgs& p) {
    if constexpr (kDqTensor) ptx::prefetch_tmap(&p.tm_dqacc);
  }

  // ---------------------------------------------------------------- consumer side
  // dQ fragment (64 x 64 fp32, both consumers) -> a WG's staging tile.
  // kDqTensor: two 128B-swizzled [64][32] boxes (row r's 16-byte chunk c at
  // c ^ (r % 8)); the thread's float2 at (r, 8j + 2t) is box j / 4, chunk
  // 2 (j % 4) + t / 2, byte 8 (t % 2), and rows r, r + 8 share r % 8. Both
  // layouts store without bank conflicts (the row layout only with the padded
  // pitch). Else the row-major tile of pitch kDqPitch.
  // Byte offset in the WG's staging tile of the float2 dq[4j + 2h], dq[4j + 2h + 1]
  // of `lane` (warp `warp`).
  static JF_DEVICE uint32_t offset(int warp, int lane, int j, int h) {
    if constexpr (kDqTensor) {
      const int t = lane % 4;
      const uint32_t row_addr = uint32_t((16 * warp + lane / 4) * 128 + 8 * (t % 2));
      const uint32_t sw = uint32_t(lane / 4) << 4;  // (r % 8) << 4
      return row_addr + uint32_t((j / 4) * 64 * 128) + ((uint32_t(2 * (j % 4) + t / 2) << 4) ^ sw) +
             uint32_t(h * 8 * 128);
    } else {
      const int row = 16 * warp + lane / 4;
      return uint32_t((row * Cfg::kDqPitch + 2 * (lane % 4)) * 4) +
             uint32_t((8 * h * Cfg::kDqPitch + 8 * j) * 4);
    }
  }
  // dQ_swapAB: dQ^T fragment (64 columns x kBlockM queries) -> the WG's
  // staging tile, two 128B-swizzled [kDqRows][32] fp32 boxes (row = query):
  // dq[4j + 2h + e] = dQ[query 8j + 2t + e][column 16 warp + g + 8h] at box
  // c / 32, row q, chunk (c % 32) / 4 ^ (q % 8), word c % 4. One 4-byte store
  // per element; a warp's 32 stores of one register hit 32 distinct banks
  // (g % 4: the word; g / 4 and the query's q % 8 = 2t + e: 8 distinct
  // chunks, since the chunk base (16 warp + 8h) / 4 is even).
  static JF_DEVICE uint32_t t_offset(int warp, int lane, int j, int h, int e) {
    const int c = 16 * warp + lane / 4 + 8 * h, q = 8 * j + 2 * (lane % 4) + e;
    return uint32_t((c / 32) * Cfg::kDqRows * 128 + q * 128) +
           ((uint32_t((c % 32) / 4) ^ uint32_t(q % 8)) << 4) + uint32_t((c % 4) * 4);
  }
  // The WG's dQ fragment (kN registers) -> its staging tile.
  template <int kN>
  JF_DEVICE static void store_tile(const BwdSmem<Cfg>& sm, int wg, int warp, int lane, const float (&dq)[kN]) {
    using namespace ptx;
    if constexpr (Cfg::kDqSwapAB) {
#pragma unroll
      for (int j = 0; j < kN / 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e)
            st_shared_f32(sm.dq(wg) + t_offset(warp, lane, j, h, e), dq[4 * j + 2 * h + e]);
    } else {
#pragma unroll
      for (int j = 0; j < kN / 4; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          st_shared_v2_f32(sm.dq(wg) + offset(warp, lane, j, h), dq[4 * j + 2 * h], dq[4 * j + 2 * h + 1]);
    }
  }
  // ... handed to the writer warp (dQEmpty / dQFull).
  template <int kN>
  JF_DEVICE static void stage(const BwdSmem<Cfg>& sm, int wg, int warp, int lane, const float (&dq)[kN]) {
    using namespace ptx;
    named_bar_sync(kBwdBarDqEmpty + wg, kBwdDqBarThreads);
    store_tile(sm, wg, warp, lane, dq);
    fence_proxy_async_smem();  // st.shared -> bulk copy reads
    named_bar_arrive(kBwdBarDqFull + wg, kBwdDqBarThreads);
  }

  // ---------------------------------------------------------------- writer warp
  // kDqTensor: lane 0 adds each staged tile with two tensor reductions (boxes
  // of kDqRows (64; dQ_swapAB: kBlockM = 80) rows x 32 columns; TMA skips rows
  // >= seqlen_q and columns >= head_dim). Else every lane adds rows of it (64
  // rows per tile).
  template <bool kDet>
  JF_DEVICE static void store(const BwdKernelArgs& a, const BwdSmem<Cfg>& sm, const BwdTile& w) {
    if constexpr (Cfg::kPair) {
      store_pair<kDet>(a, sm, w);
    } else {
      store_uniform<kDet>(a, sm, w);
    }
  }
  // Queries of the tile's sequence (varlen), else of the call.
  JF_DEVICE static int varlen_len_q(const BwdKernelArgs& a, const BwdTile& w) {
    if constexpr (Cfg::kVarlen) {
      return bwd_varlen<Cfg>(w).seq.len_q;
    } else {
      return a.mask.seqlen_q;
    }
  }
  // Varlen, a staged tile that runs past the sequence's end: its first
  // `rows` rows (< kDqRows), columns below `cols`, added by 16-byte bulk
  // reductions (the 128B swizzle permutes a row's 16-byte chunks: the staged
  // boxes are the [2][kDqRows][32] fp32 layout of sw128_offset), so no row of
  // the next sequence is touched. dst: the tile's first row and column in dq_accum. Every lane
  // takes chunks r * 16 + b * 8 + c, lane, lane + 32, ...
  JF_DEVICE static void reduce_rows(float* dst, int pitch, uint32_t tile, int rows, int cols, int lane) {
    // Not unrolled: the writer warp has 24 registers (unrolled, ptxas spilled
    // the step walk's state around it in every hand-off).
#pragma unroll 1
    for (int i = lane; i < rows * 16; i += 32) {
      const int r = i / 16, b = (i / 8) % 2, c = i % 8;
      if (32 * b + 4 * c < cols)
        ptx::bulk_reduce_add_f32(dst + int64_t(r) * pitch + 32 * b + 4 * c,
                                 tile + sw128_offset<Cfg::kDqRows, 4>(r, 32 * b + 4 * c), 16u);
    }
  }

  // Both WGs stage the same slices (kDqSlices per step).
  template <bool kDet>
  JF_DEVICE static void store_uniform(const BwdKernelArgs& a, const BwdSmem<Cfg>& sm, const BwdTile& w) {
    using namespace ptx;
    static_assert(kDqTensor || Cfg::kDqRows == 64, "row reductions: 64-row tiles");
    if (w.iters == 0) return;
    const int lane = lane_id();
    // kDet: query blocks [pred_first, pred_last) also get block n + 1's dQ,
    // which adds first (see the top).
    int pred_first = 0, pred_last = 0;
    if constexpr (kDet)
      dq_pred_range(a.mask, w.n_block, w.num_n_blocks, Cfg::kBlockN, Cfg::kBlockM, pred_first,
                    pred_last);
    // Both staging tiles start out empty.
    named_bar_arrive(kBwdBarDqEmpty + 0, kBwdDqBarThreads);
    named_bar_arrive(kBwdBarDqEmpty + 1, kBwdDqBarThreads);
    // Varlen: rows count from the sequence's first query, dq_accum rows are
    // the packed ones, and none past the sequence's end is touched.
    const int seqlen_q = varlen_len_q(a, w);
    BwdStepWalker walk(w, a.heads_per_kv);
    // Hand-offs: kDqSlices per step (hdim 256: 2, the WG's columns
    // [128 wg + 64 sl, +64), one after the other through its staging tile).
    const int handoffs = w.iters * Cfg::kDqSlices;
    for (int it = 0; it < handoffs; ++it) {
      const int sl = it % Cfg::kDqSlices;
      const int m0 = walk.mb * Cfg::kBlockM;
      float* dq_bh = a.dq_accum + (int64_t(w.batch) * a.num_heads + walk.hq) *
                                      int64_t(a.seqlen_q_rounded) * a.dq_pitch;
      int* sem = nullptr;
      if constexpr (kDet) {
        sem = a.dq_sem + (int64_t(w.batch) * a.num_heads + walk.hq) * a.sem_m_blocks + walk.mb;
        // The lanes that issue reductions wait for block n + 1's adds (tensor
        // reductions: lane 0 only).
        if (sl == 0 && walk.mb >= pred_first && walk.mb < pred_last && (!kDqTensor || lane == 0)) {
          const int want = w.n_block + 2;
          while (ld_relaxed_gpu(sem) != want) nanosleep_ns(64);
          // Acquire (reads `want` again: only this CTA changes it next, so it
          // synchronizes with block n + 1's release), then order it before this
          // lane's async-proxy reductions.
          (void)ld_acquire_gpu(sem);
          fence_proxy_async_global();
        }
        __syncwarp();
      }
#pragma unroll
      for (int wg = 0; wg < Cfg::kConsumerWGs; ++wg) {
        const int row0 = m0 + (Cfg::kDqSplitM == 2 ? 64 * wg : 0);
        const int col0 = (Cfg::kDqSplitN == 2 ? Cfg::kDqWGCols * wg : 0) + Cfg::kDqCols * sl;
        // Slices entirely past head_dim (hdim 256 bucket, head_dim <= 192) hold
        // zeros: nothing to add. Else head_dim % 8 == 0 and > col0: a positive
        // multiple of 32 bytes.
        const bool cols_in = Cfg::kDqSlices == 1 || col0 < a.head_dim;
        const uint32_t bytes = uint32_t(min(Cfg::kDqCols, a.head_dim - col0)) * 4u;
        named_bar_sync(kBwdBarDqFull + wg, kBwdDqBarThreads);
        if constexpr (Cfg::kVarlen) {
          static_assert(kDqTensor, "varlen: the swizzled staging layout");
          if (row0 + Cfg::kDqRows <= seqlen_q) {
            if (lane == 0 && cols_in) {
#pragma unroll
              for (int b = 0; b < 2; ++b)
                if (col0 + 32 * b < a.head_dim)
                  tma_reduce_add_4d(&a.tm_dqacc, sm.dq(wg) + b * Cfg::kDqRows * 128, col0 + 32 * b,
                                    bwd_varlen<Cfg>(w).seq.offset_q + row0, walk.hq, w.batch);
            }
          } else if (row0 < seqlen_q && cols_in) {
            reduce_rows(dq_bh + int64_t(bwd_varlen<Cfg>(w).seq.offset_q + row0) * a.dq_pitch + col0, a.dq_pitch, sm.dq(wg), seqlen_q - row0,
                        a.head_dim - col0, lane);
          }
        } else if constexpr (kDqTensor) {
          if (lane == 0 && row0 < seqlen_q && cols_in) {  // no box entirely out of bounds
#pragma unroll
            for (int b = 0; b < 2; ++b)
              if (col0 + 32 * b < a.head_dim)
                tma_reduce_add_4d(&a.tm_dqacc, sm.dq(wg) + b * Cfg::kDqRows * 128, col0 + 32 * b, row0,
                                  walk.hq, w.batch);
          }
        } else {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int r = lane + 32 * i;
            if (row0 + r < seqlen_q && cols_in)
              bulk_reduce_add_f32(dq_bh + int64_t(row0 + r) * a.dq_pitch + col0,
                                  sm.dq(wg) + uint32_t(r * Cfg::kDqPitch * 4), bytes);
          }
        }
        bulk_commit();  // one group per WG tile (possibly empty for this lane)
        __syncwarp();
      }
      if (it + 1 < handoffs) {  // the last hand-back would have no taker
        bulk_wait_read<1>();   // WG 0's tile read out
        __syncwarp();
        named_bar_arrive(kBwdBarDqEmpty + 0, kBwdDqBarThreads);
        bulk_wait_read<0>();
        __syncwarp();
        named_bar_arrive(kBwdBarDqEmpty + 1, kBwdDqBarThreads);
      }
      if constexpr (kDet) {
        if (sl == Cfg::kDqSlices - 1) {  // the tile's reductions issued: announce them once done
          bulk_wait<0>();                // complete (writes performed), not only read out
          fence_proxy_async_global();    // async-proxy writes -> the generic release below
          __syncwarp();
          if (lane == 0) st_release_gpu(sem, w.n_block + 1);
        }
      }
      if (sl == Cfg::kDqSlices - 1) walk.advance();
    }
    bulk_wait<0>();  // every reduction complete before the CTA exits
  }

  // The head-dim pair (Cfg::dq_slices: WG 0 one slice, WG 1 two): per step
  // WG 0's slice and WG 1's first, then WG 1's second once its staging tile
  // is read out (both 64 x 64 at Cfg::dq_col0; head_dim exact, so only rows
  // past seqlen_q are clipped). The deterministic order as above, around
  // the step's three reductions.
  template <bool kDet>
  JF_DEVICE static void store_pair(const BwdKernelArgs& a, const BwdSmem<Cfg>& sm, const BwdTile& w) {
    using namespace ptx;
    static_assert(kDqTensor && Cfg::kDqRows == 64 && Cfg::dq_slices(0) == 1 && Cfg::dq_slices(1) == 2,
                  "the pair: tensor reductions of 64-row tiles, slices 1 + 2");
    if (w.iters == 0) return;
    const int lane = lane_id();
    int pred_first = 0, pred_last = 0;
    if constexpr (kDet)
      dq_pred_range(a.mask, w.n_block, w.num_n_blocks, Cfg::kBlockN, Cfg::kBlockM, pred_first,
                    pred_last);
    named_bar_arrive(kBwdBarDqEmpty + 0, kBwdDqBarThreads);
    named_bar_arrive(kBwdBarDqEmpty + 1, kBwdDqBarThreads);
    const int seqlen_q = a.mask.seqlen_q;
    BwdStepWalker walk(w, a.heads_per_kv);
    for (int it = 0; it < w.iters; ++it) {
      const int m0 = walk.mb * Cfg::kBlockM;
      const bool last = it + 1 == w.iters;  // then no hand-back: no taker
      int* sem = nullptr;
      if constexpr (kDet) {
        sem = a.dq_sem + (int64_t(w.batch) * a.num_heads + walk.hq) * a.sem_m_blocks + walk.mb;
        if (walk.mb >= pred_first && walk.mb < pred_last && lane == 0) {
          const int want = w.n_block + 2;
          while (ld_relaxed_gpu(sem) != want) nanosleep_ns(64);
          (void)ld_acquire_gpu(sem);
          fence_proxy_async_global();
        }
        __syncwarp();
      }
      // Slice sl of WG wg: one commit group (empty past seqlen_q).
      auto reduce = [&](int wg, int sl) {
        named_bar_sync(kBwdBarDqFull + wg, kBwdDqBarThreads);
        if (lane == 0 && m0 < seqlen_q) {
#pragma unroll
          for (int b = 0; b < 2; ++b)
            tma_reduce_add_4d(&a.tm_dqacc, sm.dq(wg) + b * Cfg::kDqRows * 128, Cfg::dq_col0(wg, sl) + 32 * b,
                              m0, walk.hq, w.batch);
        }
        bulk_commit();
        __syncwarp();
      };
      reduce(0, 0);
      reduce(1, 0);
      bulk_wait_read<1>();  // WG 0's tile read out
      __syncwarp();
      if (!last) named_bar_arrive(kBwdBarDqEmpty + 0, kBwdDqBarThreads);
      bulk_wait_read<0>();  // WG 1's: its second slice follows
      __syncwarp();
      named_bar_arrive(kBwdBarDqEmpty + 1, kBwdDqBarThreads);
      reduce(1, 1);
      if (!last) {
        bulk_wait_read<0>();
        __syncwarp();
        named_bar_arrive(kBwdBarDqEmpty + 1, kBwdDqBarThreads);
      }
      if constexpr (kDet) {
        bulk_wait<0>();
        fence_proxy_async_global();
        __syncwarp();
        if (lane == 0) st_release_gpu(sem, w.n_block + 1);
      }
      walk.advance();
    }
    bulk_wait<0>();  // every reduction complete before the CTA exits
  }
};

}  // namespace jax_flash::sm90
