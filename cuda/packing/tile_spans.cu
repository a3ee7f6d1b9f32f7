// The tile-span pre-pass (tile_spans.h). One CTA per 64-token group of either
// side: it takes the group's smallest / largest id and diagonal, scans the
// other side's ids once (1/64 of a score matrix per batch element in all) for
// the run of every id of the group, and writes the group's span and, in
// exact groups, each token's visible interval (its id's run within the band). Each thread scans a contiguous chunk, so that with packed ids
// it meets one or two ids and flushes its run to shared memory once or twice
// (one shared atomic per key would serialise on the group's single id).
#include <climits>

#include "jax_flash/packing_layout.h"
#include "packing/tile_spans.h"

namespace jax_flash::packing {
namespace {

constexpr int kThreads = 1024;

__device__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : x > hi ? hi : x; }

__global__ void __launch_bounds__(kThreads) tile_spans_kernel(TileSpanArgs a, PackingLayout lay) {
  const int T = a.seqlen_q, S = a.seqlen_k, b = blockIdx.y;
  const int gq = (T + kSpanRows - 1) / kSpanRows;
  const bool q_side = int(blockIdx.x) < gq;
  const int g = q_side ? blockIdx.x : blockIdx.x - gq;
  const int own_len = q_side ? T : S, other_len = q_side ? S : T;
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

  __shared__ int s_min, s_max, s_pmin, s_pmax, s_lo, s_hi, s_count;
  __shared__ int t_lo[kSpanRows], t_hi[kSpanRows], t_count[kSpanRows];
  const int tid = threadIdx.x;
  if (tid == 0) {
    s_min = s_pmin = INT_MAX;
    s_max = s_pmax = INT_MIN;
    s_lo = other_len;
    s_hi = s_count = 0;
  }
  if (tid < kSpanRows) {
    t_lo[tid] = other_len;
    t_hi[tid] = t_count[tid] = 0;
  }
  __syncthreads();
  const int t0 = g * kSpanRows;
  const int rows = min(kSpanRows, own_len - t0);
  const bool mine = tid < rows;
  int id = 0, sh = 0, pos = 0;
  if (mine) {
    id = own[t0 + tid];
    sh = shift != nullptr ? shift[t0 + tid] : 0;
    pos = q_side ? t0 + tid + off + sh : t0 + tid - off - sh;
    atomicMin(&s_min, id);
    atomicMax(&s_max, id);
    atomicMin(&s_pmin, pos);
    atomicMax(&s_pmax, pos);
  }
  __syncthreads();
  const int smin = s_min, smax = s_max;
  const bool table = int64_t(smax) - smin < kSpanRows;  // ids index t_* directly
  int lo = other_len, hi = 0, count = 0;
  // This thread's run of the id it is on: [run_first, run_last], run_n keys.
  int cur = 0, run_first = 0, run_last = -1, run_n = 0;
  auto flush = [&] {
    if (run_n > 0) {
      atomicMin(&t_lo[cur - smin], run_first);
      atomicMax(&t_hi[cur - smin], run_last + 1);
      atomicAdd(&t_count[cur - smin], run_n);
    }
    run_n = 0;
  };
  const int chunk = ((other_len + kThreads - 1) / kThreads + 3) & ~3;
  const int j0 = min(tid * chunk, other_len), j1 = min(j0 + chunk, other_len);
  for (int j = j0; j < j1; ++j) {
    const int v = __ldg(other + j);
    if (v < smin || v > smax) continue;
    lo = min(lo, j);
    hi = max(hi, j + 1);
    ++count;
    if (table) {
      if (run_n > 0 && v != cur) flush();
      if (run_n == 0) {
        cur = v;
        run_first = j;
      }
      run_last = j;
      ++run_n;
    }
  }
  if (table) flush();
  for (int d = 16; d > 0; d /= 2) {
    lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, d));
    hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, d));
    count += __shfl_xor_sync(0xffffffffu, count, d);
  }
  if (tid % 32 == 0) {
    atomicMin(&s_lo, lo);
    atomicMax(&s_hi, hi);
    atomicAdd(&s_count, count);
  }
  __syncthreads();
  // Exact: every id of the group has one run on the other side (or none).
  bool ok = true;
  int run_lo = 0, run_hi = other_len;
  if (mine) {
    ok = table;
    if (table) {
      const int c = t_count[id - smin];
      run_lo = c > 0 ? t_lo[id - smin] : 0;
      run_hi = c > 0 ? t_hi[id - smin] : 0;
      ok = c == run_hi - run_lo;
    }
  }
  const bool exact = __syncthreads_and(ok);
  if (mine) {
    // Exact groups: the token's visible interval, its id's run cut to the band.
    int64_t vis_lo = run_lo, vis_hi = run_hi;
    if (band_lo >= 0) vis_lo = max(vis_lo, int64_t(pos) - band_lo);
    if (band_hi >= 0) vis_hi = min(vis_hi, int64_t(pos) + band_hi + 1);
    vis_lo = clamp64(vis_lo, 0, other_len);
    vis_hi = clamp64(vis_hi, vis_lo, other_len);
    int32_t* iv = a.out + (q_side ? lay.q_iv : lay.kv_iv) + 2 * (int64_t(b) * own_len + t0 + tid);
    iv[0] = exact ? int32_t(vis_lo) : 0;
    iv[1] = exact ? int32_t(vis_hi) : other_len;
    if (shift != nullptr) a.out[(q_side ? lay.q_shift : lay.kv_shift) + int64_t(b) * own_len + t0 + tid] = sh;
  }
  if (tid == 0) {
    // The same values as tile_spans.py's _summary.
    const bool one_run = smin == smax && s_count == s_hi - s_lo;
    int64_t l = s_lo, h = s_hi, fl = s_lo, fh = s_hi;
    if (band_lo >= 0) {
      l = max(l, int64_t(s_pmin) - band_lo);
      fl = max(fl, int64_t(s_pmax) - band_lo);
    }
    if (band_hi >= 0) {
      h = min(h, int64_t(s_pmax) + band_hi + 1);
      fh = min(fh, int64_t(s_pmin) + band_hi + 1);
    }
    l = clamp64(l, 0, other_len);
    h = clamp64(h, 0, other_len);
    if (h <= l) l = h = 0;
    fl = clamp64(fl, l, h);
    fh = clamp64(fh, l, h);
    if (!one_run || fh <= fl) fl = fh = 0;
    const int64_t gk = (S + kSpanRows - 1) / kSpanRows;
    int32_t* e = a.out + (q_side ? lay.q_span + (int64_t(b) * gq + g) * kSpanInts
                                 : lay.kv_span + (int64_t(b) * gk + g) * kSpanInts);
    e[0] = int32_t(l);
    e[1] = int32_t(h);
    e[2] = int32_t(fl);
    e[3] = int32_t(fh);
    e[4] = exact ? 1 : 0;
    e[5] = e[6] = e[7] = 0;
  }
}

}  // namespace

cudaError_t tile_spans(const TileSpanArgs& a, cudaStream_t stream) {
  if (a.batch <= 0 || a.seqlen_q <= 0 || a.seqlen_k <= 0) return cudaSuccess;
  const PackingLayout lay = packing_layout(a.batch, a.seqlen_q, a.seqlen_k, a.q_shift != nullptr);
  const int groups = (a.seqlen_q + kSpanRows - 1) / kSpanRows + (a.seqlen_k + kSpanRows - 1) / kSpanRows;
  if (a.batch > 65535) return cudaErrorInvalidConfiguration;
  tile_spans_kernel<<<dim3(groups, a.batch), kThreads, 0, stream>>>(a, lay);
  return cudaGetLastError();
}

}  // namespace jax_flash::packing
