"""The varlen tile orders (cuda/include/jax_flash/varlen_order.h, the
forward's; varlen_bwd_order.h, the backward's) on the host:
cuda/tests/sm90_varlen_order_check.cpp and sm90_varlen_bwd_order_check.cpp,
built and run here,
drives the kernel's decoding cursor from many CTAs over random packings and
checks that every (sequence, query block, head) comes exactly once, in the
order's definition (heaviest first for causal)."""

from __future__ import annotations

import pytest

from host_check import run_host_check


@pytest.mark.parametrize("name", ["sm90_varlen_order_check",
                                  "sm90_varlen_bwd_order_check"],
                         ids=["fwd", "bwd"])
def test_varlen_tile_order(tmp_path, name):
  out = run_host_check(name, tmp_path)
  assert out.startswith("ok"), out
