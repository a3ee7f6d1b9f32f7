"""Attention implementations outside jax_flash that bench_attention.py times
beside it: each is fn(q, k, v, causal) -> o in the [B, T, H, D] layout, fed
the same q, k, v as jax_flash (v's head dim may differ from q's and k's; a
peer that does not take a shape raises, and the benchmark records the error).
Third-party packages are imported on first use, so that this module loads
where they are not installed (CPU, a machine without them).
"""

from __future__ import annotations

import sys
import types
import warnings

import jax


def dot_product_attention(impl):
  """jax.nn.dot_product_attention(implementation=impl). jax.nn asks for v's
  head dim to equal k's: a value head dim of its own is refused (ValueError),
  which the benchmark records rather than timing some other shape."""
  def fn(q, k, v, causal):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                        implementation=impl)
  return fn


def jax_pallas_triton(q, k, v, causal):
  """jax's own Pallas (Triton) flash attention, `mha`."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention
  if k.shape[2] != q.shape[2]:
    raise NotImplementedError("jax's Triton mha has no GQA")
  return pallas_attention.mha(q, k, v, None, sm_scale=q.shape[-1]**-0.5,
                              causal=causal)


def fa3(q, k, v, causal):
  """FlashAttention-3's kernels in JAX (the flash-attn3-jax wheel; sm90)."""
  from flash_attn3_jax import flash_mha
  return flash_mha(q, k, v, is_causal=causal)


def import_tokamax():
  """Imports tokamax. Its import pulls in `xprof.cli.tools` (for its own
  profiler-based timing, which nothing here uses) although the GPU machine
  installs tokamax without xprof: where xprof is missing, a stub module with
  `get_kernel_stats_tool = None` stands in for it."""
  try:
    import xprof  # noqa: F401
  except ImportError:
    tools = types.ModuleType("xprof.cli.tools")
    tools.get_kernel_stats_tool = None
    cli = types.ModuleType("xprof.cli")
    cli.tools = tools
    root = types.ModuleType("xprof")
    root.cli = cli
    sys.modules.update({"xprof": root, "xprof.cli": cli,
                        "xprof.cli.tools": tools})
  import tokamax
  return tokamax


def tokamax_attention(q, k, v, causal):
  """tokamax.dot_product_attention(implementation="mosaic"): tokamax's Pallas
  Mosaic GPU kernels (its sm90 forward and backward on the H200, with the
  configuration its heuristics pick), the fastest of its GPU implementations
  (mosaic, triton, cudnn, xla, xla_chunked). Named rather than left to
  tokamax's default, which tries mosaic, then triton, then xla and falls back
  silently: a row must say what it timed. It takes a value head dim of its own;
  a shape mosaic refuses raises NotImplementedError, recorded as the row's
  error."""
  tokamax = import_tokamax()
  return tokamax.dot_product_attention(q, k, v, is_causal=causal,
                                       implementation="mosaic")


PEERS = {
    "fa3": fa3,
    "cudnn": dot_product_attention("cudnn"),
    "tokamax": tokamax_attention,
    "xla": dot_product_attention("xla"),
    "jax_pallas_triton": jax_pallas_triton,
}

# Peers whose TF/s every row of a (shape, mode) carries beside its own, with
# its ratio to them: (impl, field of its TF/s, field of the ratio).
REFERENCE_PEERS = (("cudnn", "cudnn_tflops", "ratio_vs_cudnn"),
                   ("fa3", "fa3_tflops", "ratio_vs_fa3"),
                   ("tokamax", "tokamax_tflops", "ratio_vs_tokamax"))

# Peers that run on a GPU only (skipped elsewhere).
GPU_ONLY = ("cudnn", "fa3", "tokamax", "jax_pallas_triton")
