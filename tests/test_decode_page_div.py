"""The decoding kernels' division of key positions by the page size
(cuda/decode/page_div.h: a multiply-high and a shift) against the integer
division, on the host (CPU only): cuda/tests/page_div_check.cpp built and
run here."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "cuda" / "tests" / "page_div_check.cpp"


def test_page_div_matches_division(tmp_path):
  if not SRC.exists():
    pytest.skip("CUDA sources not in this checkout")
  cxx = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
  if cxx is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH")
  exe = tmp_path / "page_div_check"
  subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Werror",
                  f"-I{ROOT / 'cuda' / 'include'}", f"-I{ROOT / 'cuda'}",
                  str(SRC), "-o", str(exe)], check=True, capture_output=True,
                 timeout=300)
  res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stdout + res.stderr
  assert res.stdout.strip().endswith("checked, 0 wrong"), res.stdout
