"""The decoding kernels' division of key positions by the page size
(cuda/decode/page_div.h: a multiply-high and a shift) against the integer
division, on the host (CPU only): cuda/tests/page_div_check.cpp built and
run here."""

from __future__ import annotations

from host_check import run_host_check


def test_page_div_matches_division(tmp_path):
  out = run_host_check("page_div_check", tmp_path, flags=("-O2",))
  assert out.strip().endswith("checked, 0 wrong"), out
