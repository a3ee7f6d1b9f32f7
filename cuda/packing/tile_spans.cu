// The tile-span pre-pass (tile_spans.h). A small grid: each CTA owns a run
// of 64-token groups of one side. It takes the id range of its groups, reads
// the other side once (contiguous chunks per thread, 16-byte loads) and keeps
// the fragments (maximal same-id stretches of a thread's chunk) whose id is in
// that range, in shared memory; then one warp per group reduces the group's
// ids and diagonals with shuffles and folds the fragments into the group's
// span and per-id runs. Fragments suffice: a run's first / last key and its
// key count are a min / max / sum over its fragments. With packed ids a CTA
// keeps a few hundred fragments; more than fit (ids far from sorted) falls
// back to each group's warp reading the other side itself (the same values).
// Every CTA reads the whole other side, so the grid stays small: at least
// kMinGroups groups per CTA, and at most kMaxCtas CTAs per side and batch
// element.
#include <climits>
#include <cstdint>

#include "jax_flash/packing_layout.h"
#include "packing/tile_spans.h"

#ifndef JF_SMEM
#define JF_SMEM(name) extern __shared__ __align__(16) char name[]
#define JF_LAUNCH(kernel, grid, block, smem, stream) kernel<<<grid, block, smem, stream>>>
#endif

namespace jax_flash::packing {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kMinGroups = kWarps;  // groups per CTA: one per warp at least
constexpr int kMaxCtas = 64;        // CTAs per side and batch element
constexpr int kFragCap = 2560;      // fragments kept in shared memory
// Shared memory: fragments {first, last + 1, id}, one 64-id table {lo, hi,
// count} per warp, the fragment counter and the CTA's id range.
constexpr int kSmemInts = 3 * kFragCap + kWarps * 3 * kSpanRows + 4;
constexpr size_t kSmemBytes = size_t(kSmemInts) * sizeof(int);

struct Args {
  TileSpanArgs a;
  PackingLayout lay;
  int per_cta_q, per_cta_k;  // groups per CTA of each side
  int ctas_q;                // CTAs of the query side (the key side follows)
};

__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : x > hi ? hi : x;
}

__device__ __forceinline__ int shfl_xor(int v, int d) {
#ifdef JAX_FLASH_HOST_EMULATION
  return jf_emu::shfl_xor_bits(v, d);
#else
  return __shfl_xor_sync(0xffffffffu, v, d);
#endif
}
__device__ __forceinline__ int warp_min(int v) {
  for (int d = 16; d > 0; d /= 2) v = min(v, shfl_xor(v, d));
  return v;
}
__device__ __forceinline__ int warp_max(int v) {
  for (int d = 16; d > 0; d /= 2) v = max(v, shfl_xor(v, d));
  return v;
}
__device__ __forceinline__ int warp_sum(int v) {
  for (int d = 16; d > 0; d /= 2) v += shfl_xor(v, d);
  return v;
}

__global__ void __launch_bounds__(kThreads) tile_spans_kernel(const Args args) {
  const TileSpanArgs& a = args.a;
  const PackingLayout& lay = args.lay;
  const int T = a.seqlen_q, S = a.seqlen_k, b = blockIdx.y;
  const bool q_side = int(blockIdx.x) < args.ctas_q;
  const int cta = q_side ? blockIdx.x : blockIdx.x - args.ctas_q;
  const int per_cta = q_side ? args.per_cta_q : args.per_cta_k;
  const int own_len = q_side ? T : S, other_len = q_side ? S : T;
  const int own_groups = (own_len + kSpanRows - 1) / kSpanRows;
  const int g_begin = cta * per_cta, g_end = min(g_begin + per_cta, own_groups);
  const int32_t* own = (q_side ? a.q_seg : a.kv_seg) + int64_t(b) * own_len;
  const int32_t* other = (q_side ? a.kv_seg : a.q_seg) + int64_t(b) * other_len;
  const int32_t* shift = q_side ? a.q_shift : a.kv_shift;
  if (shift != nullptr) shift += int64_t(b) * own_len;
  // Token t of this side sees index u of the other iff pos(t) - band_lo <= u
  // <= pos(t) + band_hi (sides < 0: unbounded) and the ids are equal; a
  // query's pos is its aligned key, a key's the row aligned with it.
  const int off = S - T;
  const int band_lo = q_side ? a.window_left : a.window_right;
  const int band_hi = q_side ? a.window_right : a.window_left;

  JF_SMEM(smem_raw);
  int* smem = reinterpret_cast<int*>(smem_raw);
  int* f_lo = smem;
  int* f_hi = f_lo + kFragCap;
  int* f_id = f_hi + kFragCap;
  int* tables = f_id + kFragCap;
  int* s_scalars = tables + kWarps * 3 * kSpanRows;  // {fragments, id min, id max}
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  if (tid == 0) {
    s_scalars[0] = 0;
    s_scalars[1] = INT_MAX;
    s_scalars[2] = INT_MIN;
  }
  __syncthreads();

  // The id range of the CTA's groups.
  {
    int mn = INT_MAX, mx = INT_MIN;
    const int t_end = min(g_end * kSpanRows, own_len);
    for (int t = g_begin * kSpanRows + tid; t < t_end; t += kThreads) {
      const int v = __ldg(own + t);
      mn = min(mn, v);
      mx = max(mx, v);
    }
    mn = warp_min(mn);
    mx = warp_max(mx);
    if (lane == 0) {
      atomicMin(&s_scalars[1], mn);
      atomicMax(&s_scalars[2], mx);
    }
  }
  __syncthreads();
  const int cmin = s_scalars[1], cmax = s_scalars[2];

  // The other side's fragments with ids in [cmin, cmax].
  {
    const int chunk = ((other_len + kThreads - 1) / kThreads + 3) & ~3;
    const int j0 = min(tid * chunk, other_len), j1 = min(j0 + chunk, other_len);
    int cur = 0, first = j0;
    bool open = false;
    auto flush = [&](int end) {
      if (open && cur >= cmin && cur <= cmax) {
        const int i = atomicAdd(&s_scalars[0], 1);
        if (i < kFragCap) {
          f_lo[i] = first;
          f_hi[i] = end;
          f_id[i] = cur;
        }
      }
    };
    auto take = [&](int j, int v) {
      if (!open || v != cur) {
        flush(j);
        cur = v;
        first = j;
        open = true;
      }
    };
    int j = j0;
    if ((reinterpret_cast<uintptr_t>(other) & 15) == 0) {
      // j0 is a multiple of 4: 16-byte aligned.
      for (; j + 4 <= j1; j += 4) {
        const int4 v = __ldg(reinterpret_cast<const int4*>(other + j));
        if (open && v.x == cur && v.y == cur && v.z == cur && v.w == cur) continue;  // inside a run
        take(j, v.x);
        take(j + 1, v.y);
        take(j + 2, v.z);
        take(j + 3, v.w);
      }
    }
    for (; j < j1; ++j) take(j, __ldg(other + j));
    flush(j1);
  }
  __syncthreads();
  const int n_frag = s_scalars[0];
  const bool spill = n_frag > kFragCap;

  int* t_lo = tables + warp * 3 * kSpanRows;
  int* t_hi = t_lo + kSpanRows;
  int* t_count = t_hi + kSpanRows;
  const int64_t gq = (T + kSpanRows - 1) / kSpanRows, gk = (S + kSpanRows - 1) / kSpanRows;
  for (int g = g_begin + warp; g < g_end; g += kWarps) {
    const int t0 = g * kSpanRows;
    const int rows = min(kSpanRows, own_len - t0);
    // Lane l holds the group's tokens l and l + 32.
    int id[2] = {0, 0}, sh[2] = {0, 0}, pos[2] = {0, 0};
    int smin = INT_MAX, smax = INT_MIN, pmin = INT_MAX, pmax = INT_MIN;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int r = lane + 32 * k;
      if (r < rows) {
        id[k] = __ldg(own + t0 + r);
        sh[k] = shift != nullptr ? __ldg(shift + t0 + r) : 0;
        pos[k] = q_side ? t0 + r + off + sh[k] : t0 + r - off - sh[k];
        smin = min(smin, id[k]);
        smax = max(smax, id[k]);
        pmin = min(pmin, pos[k]);
        pmax = max(pmax, pos[k]);
      }
    }
    smin = warp_min(smin);
    smax = warp_max(smax);
    pmin = warp_min(pmin);
    pmax = warp_max(pmax);
    const bool table = int64_t(smax) - smin < kSpanRows;  // ids index t_* directly
    t_lo[lane] = t_lo[lane + 32] = other_len;
    t_hi[lane] = t_hi[lane + 32] = 0;
    t_count[lane] = t_count[lane + 32] = 0;
    __syncwarp();
    int lo = other_len, hi = 0, count = 0;
    auto visit = [&](int f0, int f1, int v) {
      if (v < smin || v > smax) return;
      lo = min(lo, f0);
      hi = max(hi, f1);
      count += f1 - f0;
      if (table) {
        atomicMin(&t_lo[v - smin], f0);
        atomicMax(&t_hi[v - smin], f1);
        atomicAdd(&t_count[v - smin], f1 - f0);
      }
    };
    if (!spill) {
      for (int i = lane; i < n_frag; i += 32) visit(f_lo[i], f_hi[i], f_id[i]);
    } else {
      for (int j = lane; j < other_len; j += 32) visit(j, j + 1, __ldg(other + j));
    }
    lo = warp_min(lo);
    hi = warp_max(hi);
    count = warp_sum(count);
    __syncwarp();
    // Exact: every id of the group has one run on the other side (or none).
    int run_lo[2] = {0, 0}, run_hi[2] = {0, 0};
    int ok = 1;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (lane + 32 * k < rows) {
        if (!table) {
          ok = 0;
        } else {
          const int c = t_count[id[k] - smin];
          run_lo[k] = c > 0 ? t_lo[id[k] - smin] : 0;
          run_hi[k] = c > 0 ? t_hi[id[k] - smin] : 0;
          if (c != run_hi[k] - run_lo[k]) ok = 0;
        }
      }
    }
    const bool exact = warp_min(ok) != 0;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int r = lane + 32 * k;
      if (r >= rows) continue;
      // Exact groups: the token's visible interval, its id's run cut to the band.
      int64_t vis_lo = run_lo[k], vis_hi = run_hi[k];
      if (band_lo >= 0) vis_lo = max(vis_lo, int64_t(pos[k]) - band_lo);
      if (band_hi >= 0) vis_hi = min(vis_hi, int64_t(pos[k]) + band_hi + 1);
      vis_lo = clamp64(vis_lo, 0, other_len);
      vis_hi = clamp64(vis_hi, vis_lo, other_len);
      const int64_t tok = int64_t(b) * own_len + t0 + r;
      int2 iv;
      iv.x = exact ? int32_t(vis_lo) : 0;
      iv.y = exact ? int32_t(vis_hi) : other_len;
      *reinterpret_cast<int2*>(a.out + (q_side ? lay.q_iv : lay.kv_iv) + 2 * tok) = iv;
      if (shift != nullptr) a.out[(q_side ? lay.q_shift : lay.kv_shift) + tok] = sh[k];
    }
    if (lane == 0) {
      // The same values as tile_spans.py's _summary.
      const bool one_run = smin == smax && count == hi - lo;
      int64_t l = lo, h = hi, fl = lo, fh = hi;
      if (band_lo >= 0) {
        l = max(l, int64_t(pmin) - band_lo);
        fl = max(fl, int64_t(pmax) - band_lo);
      }
      if (band_hi >= 0) {
        h = min(h, int64_t(pmax) + band_hi + 1);
        fh = min(fh, int64_t(pmin) + band_hi + 1);
      }
      l = clamp64(l, 0, other_len);
      h = clamp64(h, 0, other_len);
      if (h <= l) l = h = 0;
      fl = clamp64(fl, l, h);
      fh = clamp64(fh, l, h);
      if (!one_run || fh <= fl) fl = fh = 0;
      int32_t* e = a.out + (q_side ? lay.q_span + (int64_t(b) * gq + g) * kSpanInts
                                   : lay.kv_span + (int64_t(b) * gk + g) * kSpanInts);
      int4 e0, e1;
      e0.x = int32_t(l);
      e0.y = int32_t(h);
      e0.z = int32_t(fl);
      e0.w = int32_t(fh);
      e1.x = exact ? 1 : 0;
      e1.y = e1.z = e1.w = 0;
      reinterpret_cast<int4*>(e)[0] = e0;
      reinterpret_cast<int4*>(e)[1] = e1;
    }
    __syncwarp();  // the table's reads before the next group's reset
  }
}

// Groups per CTA of a side of `groups` groups: kMinGroups at least, and at
// most kMaxCtas CTAs.
int per_cta(int groups) {
  const int spread = (groups + kMaxCtas - 1) / kMaxCtas;
  return spread > kMinGroups ? spread : kMinGroups;
}

}  // namespace

cudaError_t tile_spans(const TileSpanArgs& a, cudaStream_t stream) {
  if (a.batch <= 0 || a.seqlen_q <= 0 || a.seqlen_k <= 0) return cudaSuccess;
  if (a.batch > 65535) return cudaErrorInvalidConfiguration;
  Args args;
  args.a = a;
  args.lay = packing_layout(a.batch, a.seqlen_q, a.seqlen_k, a.q_shift != nullptr);
  const int gq = (a.seqlen_q + kSpanRows - 1) / kSpanRows;
  const int gk = (a.seqlen_k + kSpanRows - 1) / kSpanRows;
  args.per_cta_q = per_cta(gq);
  args.per_cta_k = per_cta(gk);
  args.ctas_q = (gq + args.per_cta_q - 1) / args.per_cta_q;
  const int ctas = args.ctas_q + (gk + args.per_cta_k - 1) / args.per_cta_k;
  auto* kernel = &tile_spans_kernel;
  JF_LAUNCH(kernel, dim3(ctas, a.batch), kThreads, kSmemBytes, stream)(args);
  return cudaGetLastError();
}

}  // namespace jax_flash::packing
