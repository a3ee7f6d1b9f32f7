"""The sm90 kernels can draw the dropout keep mask in the producer warpgroup
and hand it to the consumers as one bit per element (cuda/sm90/common/
drop_bits.h; the forward's layout cuda/sm90/fwd/drop_mask.h, the backward key
split's cuda/sm90/bwd/bwd_drop_mask.h). Their bit math runs on the host too:
cuda/tests/sm90_drop_mask_check.cpp writes every word as the mask warps do
and reads every element back as a consumer thread does, and checks each
decision against the generator's reference (philox.h Dropout::keep, the one
jax_flash/_src/core/dropout.py matches bit for bit). This test builds and
runs it (CPU only)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "cuda" / "tests" / "sm90_drop_mask_check.cpp"


def test_drop_mask_bits(tmp_path):
  if not SRC.exists():
    pytest.skip("CUDA sources not in this checkout")
  cxx = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
  if cxx is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH")
  exe = tmp_path / "drop_mask_check"
  subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror", "-Wno-unknown-pragmas",
                  f"-I{ROOT / 'cuda' / 'include'}", f"-I{ROOT / 'cuda'}",
                  str(SRC), "-o", str(exe)], check=True, capture_output=True,
                 timeout=300)
  res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stdout + res.stderr
  assert "PASS" in res.stdout, res.stdout
