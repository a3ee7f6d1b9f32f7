"""The FP8 scheme's descale blocks on both sides: scheme.py (Q_BLOCK,
k_block: what the quantiser, the simulation and the FFI shapes use) and
cuda/include/jax_flash/fp8_scheme.h (what the CUDA pre-pass and the sm90
FP8 forward use; fwd_tuning.h asserts that the forward's KV tile is the K
block). This test compiles a small program that prints the C++ values
(CPU only) and compares them with the Python ones."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

from jax_flash._src.fp8 import scheme

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEADER = ROOT / "cuda" / "include" / "jax_flash" / "fp8_scheme.h"
TUNING = ROOT / "cuda" / "sm90" / "fwd" / "fwd_tuning.h"

PROGRAM = r"""
#include <cstdio>
#include <initializer_list>
#include "jax_flash/fp8_scheme.h"
#include "sm90/fwd/fwd_tuning.h"
int main() {
  std::printf("q %d\n", jax_flash::kFp8QBlock);
  for (int d = 1; d <= 512; ++d) std::printf("k %d %d\n", d, jax_flash::fp8_k_block(d));
  for (int d : {64, 128, 256})
    for (int causal = 0; causal < 2; ++causal) {
      const auto t = jax_flash::sm90::fwd_default_tuning(d, d, causal != 0, 1);
      std::printf("tile %d %d %d %d\n", d, causal, t.block_n, t.block_m());
    }
}
"""


def _cpp_values(tmp_path):
  if not HEADER.exists() or not TUNING.exists():
    pytest.skip("CUDA sources not in this checkout")
  cxx = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
  if cxx is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH")
  src, exe = tmp_path / "blocks.cpp", tmp_path / "blocks"
  src.write_text(PROGRAM)
  subprocess.run([cxx, "-std=c++17", "-O0", "-Wall", "-Werror",
                  f"-I{ROOT / 'cuda' / 'include'}", f"-I{ROOT / 'cuda'}",
                  str(src), "-o", str(exe)], check=True, capture_output=True,
                 timeout=300)
  out = subprocess.run([str(exe)], check=True, capture_output=True, text=True,
                       timeout=60).stdout.split("\n")
  rows = [line.split() for line in out if line]
  q = [int(r[1]) for r in rows if r[0] == "q"]
  k = {int(r[1]): int(r[2]) for r in rows if r[0] == "k"}
  tiles = {(int(r[1]), bool(int(r[2]))): (int(r[3]), int(r[4]))
           for r in rows if r[0] == "tile"}
  return q[0], k, tiles


def test_python_and_cpp_blocks_agree(tmp_path):
  q_block, k_blocks, tiles = _cpp_values(tmp_path)
  assert q_block == scheme.Q_BLOCK
  # The C++ function takes the padded head dim; others give 0 (refused).
  for d, kb in k_blocks.items():
    if d in scheme.HEAD_DIMS:
      assert kb == scheme.k_block(d) == scheme.K_BLOCKS[d], d
    else:
      assert kb == 0, d
  for d in range(1, scheme.HEAD_DIMS[-1] + 1):  # Python pads first
    assert scheme.k_block(d) == k_blocks[scheme.padded_head_dim(d)], d
  # The forward's FP8 KV tile is the K block (also a static_assert there),
  # and the Q block divides its query tile (one descale per warpgroup).
  for (d, causal), (block_n, block_m) in tiles.items():
    assert block_n == scheme.k_block(d), (d, causal)
    assert block_m % scheme.Q_BLOCK == 0, (d, causal)


def test_k_blocks_are_whole_kernel_steps():
  """Each K block is whole e4m3 wgmma k-steps of 32 keys (the PV GEMM) and
  at most 256 keys (wgmma N of S = Q K^T)."""
  assert set(scheme.K_BLOCKS) == set(scheme.HEAD_DIMS)
  for d, kb in scheme.K_BLOCKS.items():
    assert kb % 32 == 0 and 0 < kb <= 256, d
  with pytest.raises(ValueError):
    scheme.k_block(scheme.HEAD_DIMS[-1] + 1)
