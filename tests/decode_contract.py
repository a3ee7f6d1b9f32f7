"""`decode_cuda.forward`'s contract on the CPU, for tests of the kernel path's
Python wiring (operand order, tables, identity rows, sinks, the custom_vjp,
the sharding and vmap wrappers) without a GPU.

`use_contract(monkeypatch)` makes the kernels look available and replaces
their call by the same math on the xla backend: each sequence's pages
gathered (e4m3 pages dequantised with their descales), attention over its
first seqlens[b] keys, each row of the sinks [B, H] for its own sequence.
It returns the list of num_splits of every kernel call traced. The append
kernel (`decode_cuda.append`, cuda/decode/decode_append.h) is replaced too:
token t of sequence b at position seqlens[b] + t of its pages (row b
without a table), positions outside the capacity dropped, and the lengths
after, clamped to [0, capacity]; its calls are counted in `calls.appends`.
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


class Calls(list):
  """num_splits of each decoding kernel call; `appends`: append calls."""
  appends = 0


def _append(k_cache, v_cache, k_new, v_new, page_table, seqlens):
  B, T = k_new.shape[:2]
  if page_table is None:
    page_table = jnp.arange(B, dtype=jnp.int32)[:, None]
  page_size = k_cache.shape[1]
  capacity = page_table.shape[1] * page_size
  pos = seqlens[:, None] + jnp.arange(T)[None]
  page = page_table[jnp.arange(B)[:, None],
                    jnp.clip(pos // page_size, 0, page_table.shape[1] - 1)]
  page = jnp.where((pos >= 0) & (pos < capacity), page, k_cache.shape[0])
  put = lambda c, x: c.at[page, pos % page_size].set(x.astype(c.dtype),
                                                     mode="drop")
  return (put(k_cache, k_new), put(v_cache, v_new),
          jnp.clip(seqlens + T, 0, capacity).astype(jnp.int32))


def use_contract(monkeypatch):
  # Traces staged with an earlier test's contract (the ops' bodies are
  # cached by shape) would count their calls elsewhere.
  jax.clear_caches()
  calls = Calls()

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

  def append(*args):
    calls.appends += 1
    return _append(*args)

  monkeypatch.setattr(decode_cuda, "unsupported_reason", lambda *a: None)
  monkeypatch.setattr(decode_cuda, "forward", forward)
  monkeypatch.setattr(decode_cuda, "append", append)
  return calls
