"""The block-range math exists twice: in C++ for the CUDA kernels
(cuda/include/jax_flash/block_info.h, shared by the sm80 and sm90 families)
and in Python for the JAX backends (jax_flash/_src/core/masking.py). This test
compiles a small host program against the C++ header and checks, on many
random geometries (T != S, windows, causal, empty ranges, block starts that
are not block multiples), that both give the same block ranges, that the
C++ "does this block need the element mask" test is the complement of the
Python full-block ranges, and that the C++ row / key bounds are exactly the
visible intervals of `masking.visible`. It also checks the workspace rules
that jax_flash/_src/backends/cuda.py mirrors (head-dim bucket, semaphores).
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
