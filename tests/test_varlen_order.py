"""The varlen tile orders (cuda/include/jax_flash/varlen_order.h, the
forward's; varlen_bwd_order.h, the backward's) on the host:
cuda/tests/sm90_varlen_order_check.cpp and sm90_varlen_bwd_order_check.cpp,
built and run here,
drives the kernel's decoding cursor from many CTAs over random packings and
checks that every (sequence, query block, head) comes exactly once, in the
order's definition (heaviest first for causal)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "cuda" / "tests" / "sm90_varlen_order_check.cpp"
BWD_SRC = ROOT / "cuda" / "tests" / "sm90_varlen_bwd_order_check.cpp"


@pytest.mark.parametrize("src", [SRC, BWD_SRC], ids=["fwd", "bwd"])
def test_varlen_tile_order(tmp_path, src):
  if not src.exists():
    pytest.skip("CUDA sources not in this checkout")
  cxx = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
  if cxx is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH")
  exe = tmp_path / "varlen_order_check"
  subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror",
                  f"-I{ROOT / 'cuda' / 'include'}", f"-I{ROOT / 'cuda'}",
                  str(src), "-o", str(exe)], check=True, capture_output=True,
                 timeout=300)
  res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stdout + res.stderr
  assert res.stdout.startswith("ok"), res.stdout
