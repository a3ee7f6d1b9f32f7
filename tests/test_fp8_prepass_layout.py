"""The FP8 pre-pass's index math and rotation arithmetic on the host
(cuda/tests/fp8_prepass_check.cpp over cuda/fp8/prepass_layout.h): launch
1's unit order is a bijection, every element of Q and K is loaded and stored
once by the CTAs of one cluster, each descale written once, and the rotation
spread over 4-16 lanes of 16 values rounds bit for bit as the transform over
32 lanes did. This test builds and runs it (CPU only)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "cuda" / "tests" / "fp8_prepass_check.cpp"


def test_prepass_layout(tmp_path):
  if not SRC.exists():
    pytest.skip("CUDA sources not in this checkout")
  cxx = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
  if cxx is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH")
  exe = tmp_path / "prepass_check"
  # -ffp-contract=off: float32 sums and products rounded one by one, as the
  # check's two transforms are written.
  subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror",
                  "-ffp-contract=off", f"-I{ROOT / 'cuda' / 'include'}",
                  f"-I{ROOT / 'cuda'}", str(SRC), "-o", str(exe)], check=True,
                 capture_output=True, timeout=300)
  res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stdout + res.stderr
  assert res.stdout.startswith("ok"), res.stdout
