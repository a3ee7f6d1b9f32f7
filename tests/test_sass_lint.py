"""SASS lint of the built CUDA extension (CPU only: needs nvcc's cuobjdump).

ptxas 13.0 was seen to miscompile the sm90 forward's Q-in-registers path in
one schedule (Q's registers handed to P inside the KV loop; the PTX was right,
the results wrong on the H200). tools/lint/check_wgmma_a_regs.py checks every sm90
forward kernel of a build for it; this runs it on the installed extension, so
a compiler or code change that brings the miscompile back fails CI on a
machine without a GPU. The synthetic cases show the lint can fail.
"""

from __future__ import annotations

import importlib.util
import pathlib
import shutil

import pytest

import jax_flash

_TOOL = pathlib.Path(__file__).resolve().parents[1] / "tools" / "lint" / "check_wgmma_a_regs.py"


def _lint():
  spec = importlib.util.spec_from_file_location("check_wgmma_a_regs", _TOOL)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


_LOAD = "LDSM.16.M88.4 R152, [R11+-0x2000]"
_QK = "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR20], RZ, !UPT"
_PV = "HGMMA.64x128x16.F32.BF16 R88, R184, gdesc[UR20].tnspB, R88"
_P_INTO_Q = "F2FP.BF16.F32.PACK_AB R153, R25, R24"  # P packed into a Q register


def _check(*texts):
  """check() on a listing with addresses 0x0, 0x10, ... (BRA targets use them)."""
  return _lint().check([(16 * i, t) for i, t in enumerate(texts)])


def test_lint_flags_q_register_written_in_the_kv_loop():
  # The ptxas miscompile's shape: P lands in a Q register, the loop's next QK^T reads it.
  used, bad = _check(_LOAD, _QK, _P_INTO_Q, _PV, "@P0 BRA 0x10", "EXIT")
  assert used == 1 and len(bad) == 1 and "R153" in bad[0]


def test_lint_flags_predicated_or_straight_line_writes():
  used, bad = _check(_LOAD, "@P1 IMAD.MOV.U32 R154, RZ, RZ, RZ", _QK, "EXIT")
  assert used == 1 and len(bad) == 1 and "R154" in bad[0]
  used, bad = _check(_LOAD, "LDS.64 R154, [R2]", _QK, "EXIT")  # writes R154 and R155
  assert used == 1 and len(bad) == 2


def test_lint_accepts_q_registers_kept_and_reused_between_tiles():
  used, bad = _check(
      _LOAD,                                    # 0x00 tile loop: Q of the tile
      _QK,                                      # 0x10 KV loop
      "F2FP.BF16.F32.PACK_AB R184, R25, R24",   # 0x20 P in its own registers
      _PV,                                      # 0x30
      "ISETP.NE.AND P0, PT, R152, RZ, PT",      # 0x40 reads, does not write
      "@P0 BRA 0x10",                           # 0x50 next KV block
      "IMAD.MOV.U32 R152, RZ, RZ, RZ",          # 0x60 after the tile: register reused
      "@P1 BRA 0x0",                            # 0x70 next tile reloads Q first
      "EXIT")
  assert used == 1 and bad == []


def test_lint_without_ldsm_checks_nothing():
  assert _check(_PV, "FADD.FTZ R152, R152, 1") is None


def test_lint_ignores_transposed_ldsm():
  # The FP8 forward's V transposer (ldmatrix .trans); FP8 kernels keep no Q in registers.
  assert _check("LDSM.16.MT88.4 R4, [R2+UR4+0x1000]", "PRMT R8, R4, R0, R5",
                "STSM.16.M88.4 [R3], R8", _PV, "EXIT") is None


def test_extension_sm90_forward_keeps_q_registers(capsys):
  ext = sorted(pathlib.Path(jax_flash.__file__).parent.glob("_jax_flash_cuda*.so"))
  if not ext:
    pytest.skip("the CUDA extension is not built in this install")
  if shutil.which("cuobjdump") is None:
    pytest.skip("no cuobjdump on PATH")
  rc = _lint().main([str(ext[0])])
  out = capsys.readouterr().out
  if "0 kernels with LDSM checked, 0 failed" in out:
    pytest.skip("this build has no sm90 forward kernels (JAX_FLASH_CUDA_ARCHS without 90)")
  assert rc == 0, out
