"""The "pallas" backend: portable pallas_call kernels.

On GPU the kernels lower through Pallas' Triton backend (chosen by passing
Triton CompilerParams); on CPU they run in interpret mode (correct, slow: for
tests and debugging, which is why automatic dispatch prefers "xla" on CPU).
"""

from __future__ import annotations

from jax_flash._src.backends.registry import (Unsupported, default_platform,
                                              register)
from jax_flash._src.backends.pallas import backward as _backward
from jax_flash._src.backends.pallas import common
from jax_flash._src.backends.pallas import config as _config_mod
from jax_flash._src.backends.pallas import forward as _forward
from jax_flash._src.core.spec import AttentionSpec

PLATFORMS = ("cpu", "gpu", "cuda")
MIN_HEAD_DIM, MAX_HEAD_DIM = 32, 256
GPU_DTYPES = ("bfloat16", "float16", "float32")
CPU_DTYPES = GPU_DTYPES + ("float64",)


def _interpret(platform: str) -> bool:
  return platform == "cpu"


def _config(q, v):
  platform = default_platform()  # the arrays here are usually tracers
  # Tiles sized for the wider of the two head dims (q/k's, v's).
  head_dim = common.padded_head_dim(max(q.shape[-1], v.shape[-1]))
  cfg = _config_mod.config_for(platform, head_dim, q.dtype.itemsize)
  return cfg, _interpret(platform)


class PallasBackend:
  name = "pallas"

  def check(self, spec: AttentionSpec, platform: str) -> None:
    if spec.fp8 is not None:
      raise Unsupported(
          "fp8_attention: implementation='pallas' has no FP8 path; use "
          "implementation='xla' (the simulated FP8 kernel, plain JAX, runs "
          "everywhere) or 'cuda' (the sm90 FP8 kernel)")
    if platform not in PLATFORMS:
      raise Unsupported(
          f"implementation='pallas' runs on platforms {', '.join(PLATFORMS)} "
          f"(Triton on GPU, interpret mode on CPU); got platform "
          f"{platform!r}")
    for name, d in (("head_dim", spec.head_dim),
                    ("value head_dim", spec.v_head_dim)):
      if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise Unsupported(
            f"implementation='pallas' supports {name} {MIN_HEAD_DIM}..."
            f"{MAX_HEAD_DIM}; got {name}={d}")
    dtypes = CPU_DTYPES if _interpret(platform) else GPU_DTYPES
    if spec.dtype not in dtypes:
      where = ("interpret mode on CPU" if _interpret(platform) else
               "GPU (float64 only in interpret mode on CPU)")
      raise Unsupported(
          f"implementation='pallas' on {where} supports dtypes "
          f"{', '.join(dtypes)}; got dtype={spec.dtype}")
    # (Grid axes past CUDA's 65535 limit on y/z are folded by Pallas' Triton
    # lowering, so batch and heads need no limit here.)

  @staticmethod
  def forward(spec: AttentionSpec, q, k, v, q_seg=None, kv_seg=None, *,
              shifts=None, dropout_key=None, sinks=None):
    cfg, interpret = _config(q, v)
    return _forward.forward(spec, q, k, v, q_seg, kv_seg, cfg=cfg.forward,
                            interpret=interpret, shifts=shifts,
                            dropout_key=dropout_key, sinks=sinks)

  @staticmethod
  def backward(spec: AttentionSpec, q, k, v, o, lse, do, delta, q_seg=None,
               kv_seg=None, *, shifts=None, dropout_key=None):
    cfg, interpret = _config(q, v)
    return _backward.backward(
        spec, q, k, v, o, lse, do, delta, q_seg, kv_seg,
        dq_cfg=cfg.backward_dq, dkdv_cfg=cfg.backward_dkdv,
        interpret=interpret, shifts=shifts, dropout_key=dropout_key)


register("pallas", PallasBackend)
