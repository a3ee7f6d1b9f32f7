"""Builds and runs one of the CPU-only C++ checks in cuda/tests/ (the kernels'
index and bit math replayed on the host), for the tests that wrap them."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_host_check(name: str, tmp_path, flags=("-O1",)) -> str:
  """Compiles cuda/tests/<name>.cpp with -Wall -Werror and the repo's CUDA
  include dirs, runs it and returns its stdout; skips where the sources or a
  C++ compiler are missing, fails on a non-zero exit."""
  src = ROOT / "cuda" / "tests" / f"{name}.cpp"
  if not src.exists():
    pytest.skip("CUDA sources not in this checkout")
  cxx = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
  if cxx is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH")
  exe = tmp_path / name
  subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", *flags,
                  f"-I{ROOT / 'cuda' / 'include'}", f"-I{ROOT / 'cuda'}",
                  str(src), "-o", str(exe)], check=True, capture_output=True,
                 timeout=300)
  res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stdout + res.stderr
  return res.stdout
