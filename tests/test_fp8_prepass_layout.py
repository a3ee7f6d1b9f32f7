"""The FP8 pre-pass's index math and rotation arithmetic on the host (CPU
only):
* cuda/tests/fp8_prepass_check.cpp over cuda/fp8/prepass_layout.h (built and
  run here): launch 1's unit order is a bijection, every element of Q and K
  is loaded and stored once by the CTAs of one cluster, each descale written
  once, and the rotation spread over 4-16 lanes of 16 values rounds bit for
  bit as the transform over 32 lanes did;
* tests/fp8_prepass_oracle.py, the numpy emulation of the pre-pass's
  rotation that tests/test_fp8_cuda.py holds the kernel to bit for bit,
  against quantize.py: the same values but for the rounding of the
  rotation's sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8_prepass_oracle as oracle
from host_check import run_host_check
from jax_flash._src.fp8 import quantize, scheme


def test_prepass_layout(tmp_path):
  out = run_host_check(
      "fp8_prepass_check", tmp_path,
      # -ffp-contract=off: float32 sums and products rounded one by one, as
      # the check's two transforms are written.
      flags=("-O1", "-ffp-contract=off"))
  assert out.startswith("ok"), out


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("seed", [None, 5])
def test_oracle_matches_quantize_py(D, seed, rng):
  q = jnp.asarray(rng.standard_normal((2, 131, 3, D)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((2, 203, 1, D)), jnp.bfloat16)
  got = oracle.quantize_qk(q, k, seed)
  cpu = jax.devices("cpu")[0]
  with jax.default_device(cpu):
    want = quantize.quantize_qkv(*jax.device_put((q, k, k), cpu), seed=seed)
  for name, g, w in zip(("q8", "qd", "k8", "kd"), got, want[:4]):
    assert g.shape == w.shape and g.dtype == w.dtype, name
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    if name in ("qd", "kd"):
      np.testing.assert_allclose(g, w, rtol=1e-6, err_msg=name)
    elif seed is None:  # no rotation: the same float ops
      np.testing.assert_array_equal(g, w, err_msg=name)
    else:  # the rotation's sums round differently: rare one-step flips
      differ = g != w
      assert differ.mean() <= 2e-3, (name, differ.mean())
      step = np.abs(w) * 2.0**-3 + 2.0**-9
      assert np.all(np.abs(g - w)[differ] <= 1.01 * step[differ]), name
  x = rng.standard_normal((4, D)).astype(np.float32)
  np.testing.assert_allclose(oracle.rotate(x, scheme.rotation_signs(D, 1)),
                             x @ scheme.rotation_matrix(D, 1), atol=1e-5)
