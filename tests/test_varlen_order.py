"""The varlen forward's tile order (cuda/include/jax_flash/varlen_order.h)
on the host: cuda/tests/sm90_varlen_order_check.cpp, built and run here,
drives the kernel's decoding cursor from many CTAs over random packings and
checks that every (sequence, query block, head) comes exactly once, in the
order's definition (heaviest first for causal)."""

from __future__ import annotations

from host_check import run_host_check


def test_varlen_tile_order(tmp_path):
  out = run_host_check("sm90_varlen_order_check", tmp_path)
  assert out.startswith("ok"), out
