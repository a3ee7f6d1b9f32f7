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

from host_check import run_host_check


def test_drop_mask_bits(tmp_path):
  out = run_host_check("sm90_drop_mask_check", tmp_path,
                       flags=("-O2", "-Wno-unknown-pragmas"))
  assert "PASS" in out, out
