"""The FP8 forward transposes V in shared memory (cuda/sm90/fwd/v_transpose.h).
Its layout math runs on the host too: cuda/tests/sm90_fp8_vt_check.cpp replays
every transposer lane's loads, byte permutes and stores and checks that each
byte of the V^T stage is written once with the right key (the permuted key
order the PV GEMM's P fragment needs) and that no load or store instruction
of a warp has a bank conflict. This test builds and runs it (CPU only)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "cuda" / "tests" / "sm90_fp8_vt_check.cpp"


def test_v_transpose_layout(tmp_path):
  if not SRC.exists():
    pytest.skip("CUDA sources not in this checkout")
  cxx = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
  if cxx is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH")
  exe = tmp_path / "vt_check"
  subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror",
                  f"-I{ROOT / 'cuda' / 'include'}", f"-I{ROOT / 'cuda'}",
                  str(SRC), "-o", str(exe)], check=True, capture_output=True,
                 timeout=300)
  res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stdout + res.stderr
  assert res.stdout.startswith("ok"), res.stdout
