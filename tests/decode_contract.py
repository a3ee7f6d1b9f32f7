"""`decode_cuda.forward`'s contract on the CPU, for tests of the kernel path's
Python wiring (operand order, tables, identity rows, sinks, the custom_vjp,
the sharding and vmap wrappers) without a GPU.

`use_contract(monkeypatch)` makes the kernels look available and replaces
their call by the same math on the xla backend: each sequence's pages
gathered (e4m3 pages dequantised with their descales), attention over its
first seqlens[b] keys, each row of the sinks [B, H] for its own sequence.
It returns the list of num_splits of every kernel call traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash._src.api import attention as api
from jax_flash._src.decode import cuda as decode_cuda


def _gather(pages, table):
  B, n = table.shape
  return pages[table].reshape((B, n * pages.shape[1]) + pages.shape[2:])


def _dequantize(x8, descale):
  return x8.astype(jnp.float32) * jnp.swapaxes(descale, 1, 2)[..., None]


def use_contract(monkeypatch):
  calls = []

  def forward(q, k_pages, v_pages, *args, scale, softcap, window_left,
              window_right, num_splits, sinks=None):
    calls.append(num_splits)
    *descales, table, seqlens = args
    if descales:
      k_pages, v_pages = (_dequantize(x, d).astype(q.dtype)
                          for x, d in zip((k_pages, v_pages), descales))
    k, v = _gather(k_pages, table), _gather(v_pages, table)

    def one(q, k, v, length, sink_logits):
      return api.attention(q, k, v, scale=scale, softcap=softcap,
                           window=(window_left, window_right),
                           kv_seq_lengths=length, sinks=sink_logits,
                           return_lse=True, implementation="xla")

    if sinks is None:
      return one(q, k, v, seqlens, None)
    return jax.vmap(one)(q, k, v, seqlens, sinks)

  monkeypatch.setattr(decode_cuda, "unsupported_reason", lambda *a: None)
  monkeypatch.setattr(decode_cuda, "forward", forward)
  return calls
