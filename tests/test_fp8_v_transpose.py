"""The FP8 forward transposes V in shared memory (cuda/sm90/fwd/v_transpose.h).
Its layout math runs on the host too: cuda/tests/sm90_fp8_vt_check.cpp replays
every transposer lane's loads, byte permutes and stores and checks that each
byte of the V^T stage is written once with the right key (the permuted key
order the PV GEMM's P fragment needs) and that no load or store instruction
of a warp has a bank conflict. This test builds and runs it (CPU only)."""

from __future__ import annotations

from host_check import run_host_check


def test_v_transpose_layout(tmp_path):
  out = run_host_check("sm90_fp8_vt_check", tmp_path)
  assert out.startswith("ok"), out
