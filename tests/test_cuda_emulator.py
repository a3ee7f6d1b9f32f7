"""The sm80 CUDA kernels, run on the CPU by the host emulator.

cuda/tests/emu compiles the unmodified kernel sources with g++: every CUDA
thread is a coroutine and mma.sync / ldmatrix / shfl / cp.async /
__syncthreads are implemented from the PTX ISA fragment tables. The
self-test (cuda/tests/selftest.cu) then checks forward and backward against a
float64 reference at odd sizes with every masking feature, with outputs
poisoned first. This is how CI (no GPU) checks kernel logic on every change;
the H200 run (tools/gpu/gpu_check.sh) checks the real hardware path.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUILD = ROOT / "cuda" / "tests" / "emu" / "build_emu.sh"


def _cuda_headers_present() -> bool:
  nvcc = shutil.which("nvcc")
  candidates = [pathlib.Path("/usr/local/cuda/include")]
  if nvcc:
    candidates.append(pathlib.Path(nvcc).resolve().parent.parent / "include")
  return any((c / "cuda_bf16.h").exists() for c in candidates)


pytestmark = pytest.mark.skipif(
    not (BUILD.exists() and shutil.which("g++") and _cuda_headers_present()),
    reason="needs g++ and the CUDA toolkit headers (cuda_bf16.h)")


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
  out = tmp_path_factory.mktemp("emu")
  subprocess.run(["bash", str(BUILD), str(out), "sm80"], check=True,
                 cwd=ROOT, capture_output=True, timeout=900)
  return out / "selftest_emu"


@pytest.fixture(scope="module")
def decode_emulator(tmp_path_factory):
  out = tmp_path_factory.mktemp("emu_decode")
  subprocess.run(["bash", str(BUILD), str(out), "decode"], check=True,
                 cwd=ROOT, capture_output=True, timeout=900)
  return out / "selftest_decode_emu"


# The decoding kernels (cuda/decode/): split-KV, pack-GQA, paged and
# contiguous caches, the combine kernel and the split policy, against
# float64 (cuda/tests/selftest_decode.cu); also under the stress knobs.
@pytest.mark.parametrize("env", [{}, {"JF_EMU_CPASYNC": "eager",
                                      "JF_EMU_SHUFFLE": "5"}],
                         ids=["default", "stress"])
def test_decode_kernels_in_emulator(decode_emulator, env):
  run = subprocess.run([str(decode_emulator)], capture_output=True, text=True,
                       timeout=600, env={**os.environ, **env})
  assert run.returncode == 0, f"emulated decode self-test failed:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
  assert " 0 failed" in run.stdout, run.stdout[-2000:]


# Attention dropout: every dropout case of the self-test (the --quick list
# has a few), whose reference draws the generator's keep bit per element, so
# the kernels' mask must be the one of jax_flash/_src/core/dropout.py;
# with the stress knobs, and with 99 KB of shared memory (the smaller tile
# configurations, whose backward S tiles are 16 or 32 keys wide).
@pytest.mark.slow
@pytest.mark.parametrize("env", [{"JF_EMU_CPASYNC": "eager", "JF_EMU_SHUFFLE": "11"},
                                 {"JF_EMU_SMEM_KB": "99"}],
                         ids=["stress", "small_tiles"])
def test_sm80_dropout_in_emulator(emulator, env):
  run = subprocess.run([str(emulator), "dropout"], capture_output=True,
                       text=True, timeout=900, env={**os.environ, **env})
  tail = "\n".join(run.stdout.splitlines()[-15:])
  assert run.returncode == 0, f"emulated dropout self-test failed:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
  assert " 0 failed" in run.stdout, tail
  assert "dropout" in run.stdout, tail


# sm90: the launchers see compute capability 9, so the backward stages dQ in
# shared memory and adds it to dq_accum by bulk reductions (performed by the
# emulator at the wait that covers them: a tile overwritten too early shows).
@pytest.mark.slow
@pytest.mark.parametrize("env", [{}, {"JF_EMU_CPASYNC": "eager",
                                      "JF_EMU_SHUFFLE": "7"},
                                 {"JF_EMU_CC_MAJOR": "9", "JF_EMU_SHUFFLE": "3"}],
                         ids=["default", "stress", "sm90_bulk_dq"])
def test_sm80_kernels_in_emulator(emulator, env):
  run = subprocess.run([str(emulator), "--quick"], capture_output=True,
                       text=True, timeout=900, env={**os.environ, **env})
  tail = "\n".join(run.stdout.splitlines()[-15:])
  assert run.returncode == 0, f"emulated self-test failed:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
  assert " 0 failed" in run.stdout, tail


# The tile-span pre-pass (cuda/packing/tile_spans.cu) against the packing
# buffer's definition, word for word (cuda/tests/tile_spans_check.cpp):
# sorted runs, padding, unsorted and wide ids, the shared-memory spill, T != S,
# batch > 1, shifts, bands; also in random thread order.
@pytest.fixture(scope="module")
def packing_emulator(tmp_path_factory):
  out = tmp_path_factory.mktemp("emu_packing")
  subprocess.run(["bash", str(BUILD), str(out), "packing"], check=True,
                 cwd=ROOT, capture_output=True, timeout=900)
  return out / "tile_spans_check_emu"


@pytest.mark.parametrize("env", [{}, {"JF_EMU_SHUFFLE": "3"}],
                         ids=["default", "shuffled"])
def test_tile_spans_in_emulator(packing_emulator, env):
  run = subprocess.run([str(packing_emulator)], capture_output=True,
                       text=True, timeout=600, env={**os.environ, **env})
  assert run.returncode == 0, f"tile-span pre-pass differs:\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}"
  assert "0 of " in run.stdout.splitlines()[-1], run.stdout[-2000:]
