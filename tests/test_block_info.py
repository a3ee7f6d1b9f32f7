"""The block-range math exists twice: in C++ for the CUDA kernels
(cuda/include/jax_flash/block_info.h, shared by the sm80 and sm90 families)
and in Python for the JAX backends (jax_flash/_src/core/masking.py). This test
compiles a small host program against the C++ header and checks, on many
random geometries (T != S, windows, causal, empty ranges, block starts that
are not block multiples), that both give the same block ranges, that the
C++ "does this block need the element mask" test is the complement of the
Python full-block ranges, and that the C++ row / key bounds are exactly the
visible intervals of `masking.visible`. The same brute force checks what the
decoding kernel takes from BlockInfo: pack-GQA rows (query heads folded into
the rows), the keys every row of a tile sees, split-KV block shares; and
SeqlenInfo per batch element (seqlen_info.h: cumulative offsets, used
lengths). It also checks the workspace rules that
jax_flash/_src/backends/cuda.py mirrors (head-dim bucket, semaphores).
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import numpy as np
import pytest

from jax_flash._src.api import attention as api
from jax_flash._src.core import masking
from jax_flash._src.core.spec import AttentionSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
INCLUDE = ROOT / "cuda" / "include"

# One query per input line: T S wl wr bm bn m0 n0 row key. One output line:
# kv_first kv_last q_first q_last needs_mask row_lo row_hi key_lo key_hi.
PROGRAM = r"""
#include <cstdio>
#include "jax_flash/block_info.h"
int main() {
  int T, S, wl, wr, bm, bn, m0, n0, row, key;
  while (std::scanf("%d %d %d %d %d %d %d %d %d %d", &T, &S, &wl, &wr, &bm, &bn, &m0, &n0,
                    &row, &key) == 10) {
    const jax_flash::BatchSeqlens seqlens{T, S};
    const jax_flash::BlockInfo b = jax_flash::make_block_info(seqlens(0), wl, wr);
    int kf, kl, qf, ql, rlo, rhi;
    long long klo, khi;
    b.kv_block_range(m0, bm, bn, kf, kl);
    b.q_block_range(n0, bn, bm, qf, ql);
    const bool needs = b.block_needs_mask(m0, bm, n0, bn);
    b.row_bounds(row, rlo, rhi);
    int64_t lo64, hi64;
    b.key_bounds(key, lo64, hi64);
    klo = lo64;
    khi = hi64;
    std::printf("%d %d %d %d %d %d %d %lld %lld\n", kf, kl, qf, ql, int(needs), rlo, rhi, klo, khi);
  }
  return 0;
}
"""


def _compiler():
  for name in ("g++", "c++", "clang++"):
    if shutil.which(name):
      return name
  return None


@pytest.fixture(scope="module")
def block_info_cli(tmp_path_factory):
  cxx = _compiler()
  if cxx is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH to build the "
                "block_info.h check program")
  out = tmp_path_factory.mktemp("block_info")
  src = out / "block_info_cli.cpp"
  src.write_text(PROGRAM)
  exe = out / "block_info_cli"
  subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{INCLUDE}",
                  str(src), "-o", str(exe)], check=True, capture_output=True,
                 timeout=300)

  def run(rows):
    text = "".join(" ".join(str(int(x)) for x in r) + "\n" for r in rows)
    res = subprocess.run([str(exe)], input=text, capture_output=True,
                         text=True, check=True, timeout=300)
    return np.array([[int(x) for x in line.split()]
                     for line in res.stdout.splitlines()], dtype=np.int64)

  return run


def _ceil_div(a, b):
  return -(-a // b)


def _random_geometry(rng):
  """(spec, bm, bn): bottom-right specs with every kind of window."""
  T = int(rng.choice([1, 2, 7, 64, 100, 128, 129, 300, 517]))
  S = int(rng.choice([1, 3, 64, 77, 128, 200, 300, 1000]))
  if rng.random() < 0.5:
    T = int(rng.integers(1, 400))
  if rng.random() < 0.5:
    S = int(rng.integers(1, 400))
  side = lambda: int(rng.choice([-1, -1, 0, 1, 3, 16, 63, 64, 100, 500]))
  window = None if rng.random() < 0.2 else (side(), side())
  causal = bool(rng.random() < 0.35)
  fields = api.window_fields(window, causal)  # causal folded as the API does
  spec = AttentionSpec(scale=1.0, causal=causal, q_len=T, kv_len=S, **fields)
  bm = int(rng.choice([16, 64, 80, 128, 176]))
  bn = int(rng.choice([16, 64, 128, 144]))
  return spec, bm, bn


def _visible(spec, rows, keys):
  return np.asarray(masking.visible(spec, rows[:, None], keys[None, :]))


@pytest.mark.parametrize("seed", range(6))
def test_cpp_block_info_matches_masking_py(block_info_cli, seed):
  rng = np.random.default_rng(1000 + seed)
  queries, expect = [], []
  empty_kv = empty_q = 0
  for _ in range(60):
    spec, bm, bn = _random_geometry(rng)
    T, S = spec.q_len, spec.kv_len
    nq, nk = _ceil_div(T, bm), _ceil_div(S, bn)
    wl, wr = spec.window_left, spec.window_right
    # Block-aligned starts (every block) plus starts off the block grid.
    m_starts = sorted(set(range(0, T, bm)) |
                      {int(x) for x in rng.integers(0, T + bm, 3)})
    n_starts = sorted(set(range(0, S, bn)) |
                      {int(x) for x in rng.integers(0, S + bn, 3)})
    pairs = [(m0, n0) for m0 in m_starts for n0 in n_starts]
    if len(pairs) > 40:
      pairs = [pairs[i] for i in rng.choice(len(pairs), 40, replace=False)]
    all_keys, all_rows = np.arange(S), np.arange(T)
    for m0, n0 in pairs:
      row = int(rng.integers(0, T))
      key = int(rng.integers(0, S + 3))  # keys past the end: no row sees them
      kf, kl = masking.kv_block_range(spec, m0, bm, bn, nk)
      qf, ql = masking.q_block_range(spec, n0, bn, bm, nq)
      empty_kv += int(kl) == int(kf)
      empty_q += int(ql) == int(qf)
      # The block needs the element mask iff some (row < T, key) pair of it
      # is invisible (keys >= S are invisible): exact whenever it has rows.
      rows = np.arange(m0, min(m0 + bm, T))
      keys = np.arange(n0, n0 + bn)
      needs = (not _visible(spec, rows, keys).all()) if rows.size else None
      # The visible interval of one row / one key (by brute force).
      vis_row = np.flatnonzero(_visible(spec, np.array([row]), all_keys)[0])
      vis_key = (np.flatnonzero(_visible(spec, all_rows, np.array([key]))[:, 0])
                 if key < S else np.array([], np.int64))
      queries.append((T, S, wl, wr, bm, bn, m0, n0, row, key))
      expect.append(dict(spec=spec, bm=bm, bn=bn, m0=m0, n0=n0, kv=(int(kf), int(kl)),
                         q=(int(qf), int(ql)), needs=needs, vis_row=vis_row,
                         vis_key=vis_key))
  got = block_info_cli(queries)
  assert got.shape == (len(queries), 9)
  for e, g, qu in zip(expect, got, queries):
    where = f"(T, S, wl, wr, bm, bn, m0, n0, row, key) = {qu}"
    assert (g[0], g[1]) == e["kv"], f"kv_block_range differs at {where}"
    assert (g[2], g[3]) == e["q"], f"q_block_range differs at {where}"
    if e["needs"] is not None:
      assert bool(g[4]) == e["needs"], f"block_needs_mask wrong at {where}"
    spec, bm, bn, m0, n0 = e["spec"], e["bm"], e["bn"], e["m0"], e["n0"]
    # The complement of masking.py's full-block ranges for blocks of full
    # rows. Python counts a block with rows past T as needing the mask; C++
    # ignores those rows (never stored, P = 0), so there only "full" implies
    # "no mask".
    full_rows = m0 + bm <= spec.q_len
    if n0 % bn == 0:
      lo, hi = masking.kv_block_full_range(spec, m0, bm, bn)
      full = int(lo) <= n0 // bn < int(hi)
      assert (not g[4]) == full if full_rows else (not full or not g[4]), (
          f"block_needs_mask vs kv_block_full_range at {where}")
    if n0 + bn <= spec.kv_len and m0 % bm == 0:
      lo, hi = masking.q_block_full_range(spec, n0, bn, bm)
      full = int(lo) <= m0 // bm < int(hi)
      assert (not g[4]) == full if full_rows else (not full or not g[4]), (
          f"block_needs_mask vs q_block_full_range at {where}")
    vr, vk = e["vis_row"], e["vis_key"]
    if vr.size:
      assert (g[5], g[6]) == (vr[0], vr[-1]), f"row_bounds at {where}"
      assert vr.size == vr[-1] - vr[0] + 1
    else:
      assert g[5] > g[6], f"row_bounds not empty at {where}"
    # key_bounds is not clamped to [0, T): compare its intersection.
    klo, khi = max(g[7], 0), min(g[8], spec.q_len - 1)
    if vk.size:
      assert (klo, khi) == (vk[0], vk[-1]), f"key_bounds at {where}"
    else:
      assert klo > khi, f"key_bounds not empty at {where}"
  # The random geometries reach the edge cases this test is about.
  assert empty_kv > 0 and empty_q > 0


# The host rules that Python mirrors to size the CUDA workspaces
# (cuda_backend.py): the head-dim bucket of dq_accum's pitch and the sm90
# deterministic backward's semaphore count; and the sm90 buckets of the kernel
# table. One output line per query: rounded_head_dim(d)
# Sm90FwdHeadDims::bucket(d) Sm90BwdHeadDims::bucket(d)
# sm90_bwd_semaphore_ints(b, h, t).
RULES_PROGRAM = r"""
#include <cstdio>
#include "jax_flash/head_dim.h"
#include "jax_flash/params.h"
int main() {
  int d, b, h, t;
  while (std::scanf("%d %d %d %d", &d, &b, &h, &t) == 4)
    std::printf("%d %d %d %lld\n", jax_flash::rounded_head_dim(d), jax_flash::Sm90FwdHeadDims::bucket(d),
                jax_flash::Sm90BwdHeadDims::bucket(d), (long long)jax_flash::sm90_bwd_semaphore_ints(b, h, t));
  return 0;
}
"""


def test_cpp_workspace_rules_match_cuda_backend(tmp_path):
  from jax_flash._src.backends import cuda as cuda_backend, kernel_table
  cxx = _compiler()
  if cxx is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH to build the "
                "head_dim.h check program")
  src, exe = tmp_path / "rules.cpp", tmp_path / "rules"
  src.write_text(RULES_PROGRAM)
  subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", f"-I{INCLUDE}", str(src),
                  "-o", str(exe)], check=True, capture_output=True, timeout=300)
  rng = np.random.default_rng(7)
  queries = [(d, int(rng.integers(0, 9)), int(rng.integers(1, 33)),
              int(rng.integers(0, 3000))) for d in range(1, 301)]
  out = subprocess.run([str(exe)], input="".join(" ".join(map(str, q)) + "\n"
                                                for q in queries),
                       capture_output=True, text=True, check=True, timeout=60)
  for (d, b, h, t), line in zip(queries, out.stdout.splitlines(), strict=True):
    pitch, fwd90, bwd90, sems = (int(x) for x in line.split())
    assert pitch == cuda_backend.rounded_head_dim(d), d
    assert fwd90 == kernel_table.bucket("sm90_fwd", d), d
    assert bwd90 == kernel_table.bucket("sm90_bwd", d), d
    assert bwd90 == 0 or pitch <= bwd90, d
    assert sems == cuda_backend.sm90_bwd_semaphore_ints(b, h, t), (b, h, t)


# The head-dim pairs (a value head dim of its own): one query "d dv" per
# line; one output line: rounded_head_dim(d, dv) (the dq_accum pitch, 0 for a
# pair without kernels), Sm80HeadDimPairs::contains(d, dv),
# Sm90FwdHeadDimPairs::contains(d, dv) and Sm90BwdHeadDimPairs::contains(d, dv).
PAIRS_PROGRAM = r"""
#include <cstdio>
#include "jax_flash/head_dim.h"
int main() {
  int d, dv;
  while (std::scanf("%d %d", &d, &dv) == 2)
    std::printf("%d %d %d %d\n", jax_flash::rounded_head_dim(d, dv),
                int(jax_flash::Sm80HeadDimPairs::contains(d, dv)),
                int(jax_flash::Sm90FwdHeadDimPairs::contains(d, dv)),
                int(jax_flash::Sm90BwdHeadDimPairs::contains(d, dv)));
  return 0;
}
"""


def test_cpp_head_dim_pairs_match_cuda_backend(tmp_path):
  from jax_flash._src.backends import cuda as cuda_backend, kernel_table
  cxx = _compiler()
  if cxx is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH to build the "
                "head_dim.h check program")
  src, exe = tmp_path / "pairs.cpp", tmp_path / "pairs"
  src.write_text(PAIRS_PROGRAM)
  subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", f"-I{INCLUDE}", str(src),
                  "-o", str(exe)], check=True, capture_output=True, timeout=300)
  queries = [(d, dv) for d in range(8, 257, 8) for dv in range(8, 257, 8)]
  out = subprocess.run([str(exe)], input="".join(f"{d} {dv}\n" for d, dv in queries),
                       capture_output=True, text=True, check=True, timeout=60)
  served = 0
  for (d, dv), line in zip(queries, out.stdout.splitlines(), strict=True):
    pitch, contains, contains90, contains90_bwd = (int(x) for x in line.split())
    pair = d != dv and kernel_table.serves_pair("sm80", d, dv)
    assert contains == pair, (d, dv)
    assert contains90 == (d != dv and kernel_table.serves_pair("sm90_fwd", d, dv)), (d, dv)
    assert contains90_bwd == (d != dv and kernel_table.serves_pair("sm90_bwd", d, dv)), (d, dv)
    if d == dv or pair:
      assert pitch == cuda_backend.dq_accum_pitch(d, dv), (d, dv)
    else:
      assert pitch == 0, (d, dv)
    served += pair
  assert served == len(kernel_table.HEAD_DIM_PAIRS["sm80"])


# Per batch element (seqlen_info.h): BatchSeqlens from cumulative offsets and
# used lengths. One query per input line: B T S flags, then B + 1 cumulative
# q offsets, B + 1 cumulative k offsets, B used q lengths, B used k lengths
# (flags bit 0..3: which of the four arrays the launch passes). One output
# line per batch element: offset_q offset_k seqlen_q seqlen_k, then uniform().
SEQLEN_PROGRAM = r"""
#include <cstdio>
#include <vector>
#include "jax_flash/seqlen_info.h"
int main() {
  int B, T, S, flags;
  while (std::scanf("%d %d %d %d", &B, &T, &S, &flags) == 4) {
    std::vector<int32_t> cq(B + 1), ck(B + 1), uq(B), uk(B);
    for (auto* v : {&cq, &ck, &uq, &uk})
      for (int32_t& x : *v) std::scanf("%d", &x);
    jax_flash::BatchSeqlens s{T, S};
    if (flags & 1) s.cu_seqlens_q = cq.data();
    if (flags & 2) s.cu_seqlens_k = ck.data();
    if (flags & 4) s.seqused_q = uq.data();
    if (flags & 8) s.seqused_k = uk.data();
    for (int b = 0; b < B; ++b) {
      const jax_flash::SeqlenInfo i = s(b);
      std::printf("%d %d %d %d ", i.offset_q, i.offset_k, i.seqlen_q, i.seqlen_k);
    }
    std::printf("%d\n", int(s.uniform()));
  }
  return 0;
}
"""


def _build(tmp_path, name, program):
  cxx = _compiler()
  if cxx is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH")
  src, exe = tmp_path / f"{name}.cpp", tmp_path / name
  src.write_text(program)
  subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", f"-I{INCLUDE}", str(src),
                  "-o", str(exe)], check=True, capture_output=True, timeout=300)

  def run(lines):
    res = subprocess.run([str(exe)], input="".join(lines), capture_output=True,
                         text=True, check=True, timeout=300)
    return [[int(x) for x in line.split()] for line in res.stdout.splitlines()]

  return run


def test_cpp_seqlen_info_per_batch(tmp_path):
  run = _build(tmp_path, "seqlen_info", SEQLEN_PROGRAM)
  rng = np.random.default_rng(11)
  lines, expect = [], []
  for _ in range(300):
    B = int(rng.integers(1, 6))
    T, S = int(rng.integers(0, 300)), int(rng.integers(0, 300))
    flags = int(rng.integers(0, 16))
    lq, lk = rng.integers(0, 200, B), rng.integers(0, 200, B)
    cq = np.concatenate([[0], np.cumsum(lq)])
    ck = np.concatenate([[0], np.cumsum(lk)])
    uq = rng.integers(-5, 400, B)  # clamped into [0, the length before]
    uk = rng.integers(-5, 400, B)
    arrays = (cq, ck, uq, uk)
    lines.append(f"{B} {T} {S} {flags} " + " ".join(" ".join(map(str, a)) for a in arrays) + "\n")
    rows = []
    for b in range(B):
      off_q, off_k, sq, sk = 0, 0, T, S
      if flags & 1:
        off_q, sq = int(cq[b]), int(lq[b])
      if flags & 2:
        off_k, sk = int(ck[b]), int(lk[b])
      if flags & 4:
        sq = min(max(int(uq[b]), 0), sq)
      if flags & 8:
        sk = min(max(int(uk[b]), 0), sk)
      rows += [off_q, off_k, sq, sk]
    expect.append(rows + [int(flags == 0)])
  assert run(lines) == expect


# Pack-GQA rows and split-KV blocks (BlockInfo, as the decoding kernel takes
# them). One query per input line: T S wl wr group r0 n bn num_splits row.
# One output line: the packed rows' KV blocks [first, last), the keys every
# row sees [lo, hi), the packed row's visible keys [lo, hi] (inclusive), then
# each split's blocks [first, last).
PACKED_PROGRAM = r"""
#include <cstdio>
#include "jax_flash/block_info.h"
int main() {
  int T, S, wl, wr, group, r0, n, bn, splits, row;
  while (std::scanf("%d %d %d %d %d %d %d %d %d %d", &T, &S, &wl, &wr, &group, &r0, &n, &bn, &splits,
                    &row) == 10) {
    const jax_flash::BatchSeqlens seqlens{T, S};
    const jax_flash::BlockInfo b = jax_flash::make_block_info(seqlens(0), wl, wr, group);
    int first, last, rlo, rhi;
    int64_t flo, fhi;
    b.packed_kv_block_range(r0, n, bn, first, last);
    b.packed_full_keys(r0, n, flo, fhi);
    b.packed_row_bounds(row, rlo, rhi);
    std::printf("%d %d %lld %lld %d %d", first, last, (long long)flo, (long long)fhi, rlo, rhi);
    for (int s = 0; s < splits; ++s) {
      int f = first, l = last;
      jax_flash::BlockInfo::split_blocks(s, splits, f, l);
      std::printf(" %d %d", f, l);
    }
    std::printf("\n");
  }
  return 0;
}
"""


def test_cpp_block_info_packed_gqa_and_split_kv(tmp_path):
  run = _build(tmp_path, "block_info_packed", PACKED_PROGRAM)
  rng = np.random.default_rng(23)
  queries, cases = [], []
  for _ in range(1500):
    spec, _, bn = _random_geometry(rng)
    T, S = spec.q_len, spec.kv_len
    group = int(rng.choice([1, 2, 3, 4, 8]))
    n = int(rng.choice([16, 32]))
    rows = T * group
    r0 = int(rng.integers(0, _ceil_div(rows, n))) * n
    row = int(rng.integers(r0, min(r0 + n, rows)))  # rows past the end: never stored
    splits = int(rng.choice([1, 2, 3, 5, 8]))
    queries.append(f"{T} {S} {spec.window_left} {spec.window_right} {group} {r0} {n} {bn} "
                   f"{splits} {row}\n")
    cases.append((spec, group, r0, n, bn, splits, row))
  got = run(queries)
  empty = 0
  for (spec, group, r0, n, bn, splits, row), g in zip(cases, got, strict=True):
    T, S = spec.q_len, spec.kv_len
    where = f"(T, S, wl, wr, group, r0, n, bn, splits, row) = {(T, S, spec.window_left, spec.window_right, group, r0, n, bn, splits, row)}"
    tokens = np.arange(r0, min(r0 + n, T * group)) // group
    keys = np.arange(S)
    vis = _visible(spec, tokens, keys)  # [rows of the tile, keys]
    first, last, flo, fhi, rlo, rhi = g[:6]
    # The KV blocks: the hull of the blocks holding a visible key.
    seen = np.flatnonzero(vis.any(axis=0))
    if seen.size:
      assert (first, last) == (seen[0] // bn, seen[-1] // bn + 1), f"packed_kv_block_range at {where}"
    else:
      empty += 1
      assert first == last, f"packed_kv_block_range not empty at {where}"
    # A block of keys needs the element mask iff some pair of it is hidden.
    for n0 in range(0, S + bn, bn):
      blk = np.arange(n0, n0 + bn)
      full = bool(np.all(blk < S) and vis[:, blk[blk < S]].all())
      assert (not (n0 < flo or n0 + bn > fhi)) == full, f"packed_full_keys at {where} n0={n0}"
    # One packed row: its token's visible keys.
    vr = np.flatnonzero(_visible(spec, np.array([row // group]), keys)[0])
    if vr.size:
      assert (rlo, rhi) == (vr[0], vr[-1]), f"packed_row_bounds at {where}"
    else:
      assert rlo > rhi, f"packed_row_bounds not empty at {where}"
    # The splits cut [first, last) into consecutive shares of whole blocks.
    parts = np.array(g[6:]).reshape(splits, 2)
    per = _ceil_div(last - first, splits)
    at = first
    for f, l in parts:
      assert f == at and f <= l <= f + per, f"split_blocks at {where}: {parts.tolist()}"
      at = l
    assert at == last, f"split_blocks do not cover [{first}, {last}) at {where}"
  assert empty > 0
