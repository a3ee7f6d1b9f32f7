"""The XLA program around the kernels of a `varlen_attention` call: with its
offsets known at trace time and no token outside a sequence, the same ops as
`jax_flash.attention` with one segment-id array for the same packing (no pass
over q, k, v before the kernels: at 16k tokens each such copy costs about as
much as a tenth of the forward kernel). Structural checks on the CPU: the
cuda backend is forced and its FFI calls stand in as host callbacks, so XLA
optimises the program around them as it would around the kernels."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash._src.backends import cuda as cuda_backend

T, H, D = 256, 2, 64
LENS = (64, 40, 100, 52)


@pytest.fixture
def fake_kernels(monkeypatch):
  """The cuda backend with host callbacks for its FFI calls (outputs of the
  right shapes; the program is only compiled, never run)."""

  def call(target, result_shapes, *args, **attrs):
    del target, attrs
    many = isinstance(result_shapes, (tuple, list))
    shapes = tuple(result_shapes) if many else (result_shapes,)
    out = jax.pure_callback(
        lambda *a: tuple(np.zeros(s.shape, s.dtype) for s in shapes), shapes,
        *args)
    return tuple(out) if many else out[0]

  monkeypatch.setattr(cuda_backend.CudaBackend, "check",
                      lambda self, spec, platform: None)
  monkeypatch.setattr(cuda_backend.ffi, "call", call)


def _entry_ops(f, *args):
  """Opcode -> count over the optimised program's entry computation, and
  the number of its ops (fusions included) that write a tensor of q's shape
  (what the kernels are given directly when nothing is copied)."""
  text = jax.jit(f).lower(*args).compile().as_text()
  entry = text[text.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  ops, q_sized = collections.Counter(), 0
  for line in entry.splitlines()[1:]:
    m = re.match(r"\s*(?:ROOT )?%\S+ = (\S+?)(?:\{[^}]*\})? (\w[\w-]*)\(",
                 line)
    if m is None:
      continue
    shape, op = m.groups()
    if op in ("parameter", "constant", "bitcast", "get-tuple-element",
              "tuple"):
      continue
    ops[op] += 1
    q_sized += shape.startswith(f"bf16[1,{T},{H},{D}]")
  return ops, q_sized


def _calls(cu, seg, grad):
  varlen = lambda q, k, v: jax_flash.varlen_attention(
      q, k, v, cu, cu, max_seqlen_q=max(LENS), max_seqlen_k=max(LENS),
      causal=True, implementation="cuda")
  segments = lambda q, k, v: jax_flash.attention(
      q[None], k[None], v[None], causal=True, segment_ids=seg,
      implementation="cuda")[0]
  if not grad:
    return varlen, segments
  step = lambda f: jax.grad(lambda q, k, v: jnp.sum(
      f(q, k, v).astype(jnp.float32)), (0, 1, 2))
  return step(varlen), step(segments)


@pytest.mark.parametrize("grad", [False, True], ids=["fwd", "fwd_bwd"])
def test_concrete_offsets_same_program_as_segment_ids(fake_kernels, grad):
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(LENS)]), jnp.int32)
  seg = jnp.asarray(np.repeat(np.arange(len(LENS)), LENS)[None], jnp.int32)
  x = jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16)
  varlen, segments = _calls(cu, seg, grad)
  ops_v, copies_v = _entry_ops(varlen, x, x, x)
  ops_s, copies_s = _entry_ops(segments, x, x, x)
  assert copies_v == copies_s == (1 if grad else 0)  # grad: the ones(o)
  assert ops_v == ops_s


def test_tokens_outside_are_still_zeroed(fake_kernels):
  """Padding after the last sequence may hold anything: the forward still
  passes v through the zeroing select (one pass; the kernels' masks drop
  unseen scores, so q and k need none), not skipped."""
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(LENS[:-1])]), jnp.int32)
  x = jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16)
  f = lambda q, k, v: jax_flash.varlen_attention(
      q, k, v, cu, cu, max_seqlen_q=max(LENS), max_seqlen_k=max(LENS),
      causal=True, implementation="cuda")
  _, copies = _entry_ops(f, x, x, x)
  assert copies == 1


def test_traced_offsets_zero_once_per_tensor(fake_kernels):
  """Traced offsets cannot rule out padding: the forward zeroes v alone; with
  the backward, one pass over each of q, k, v (v's shared with the forward,
  not one per kernel call)."""
  x = jax.ShapeDtypeStruct((T, H, D), jnp.bfloat16)
  cu = jax.ShapeDtypeStruct((len(LENS) + 1,), jnp.int32)
  f = lambda q, k, v, cu: jax_flash.varlen_attention(
      q, k, v, cu, cu, max_seqlen_q=max(LENS), max_seqlen_k=max(LENS),
      causal=True, implementation="cuda")
  g = jax.grad(lambda q, k, v, cu: jnp.sum(f(q, k, v, cu).astype(
      jnp.float32)), (0, 1, 2))
  ops, copies = _entry_ops(f, x, x, x, cu)
  assert copies == 1 and "sort" not in ops and "scatter" not in ops
  ops, copies = _entry_ops(g, x, x, x, cu)
  assert "sort" not in ops and "scatter" not in ops
  # the three zeroed inputs, and the cotangent ones(o) of the sum
  assert copies == 4
