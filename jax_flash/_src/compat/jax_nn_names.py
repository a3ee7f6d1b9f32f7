"""Clear errors when `jax_flash.attention` is called with jax.nn's arguments.

Code moving over from `jax.nn.dot_product_attention` passes its keywords (or
a positional bias/mask); instead of Python's bare "unexpected keyword
argument" the error names jax_flash's equivalent, and the exact drop-in.
"""

from __future__ import annotations

_DROP_IN = ("jax_flash.dot_product_attention takes jax.nn's arguments with "
            "jax.nn's exact semantics")

# jax.nn keyword -> what to use with jax_flash.attention instead.
EQUIVALENTS = {
    "is_causal": (
        "use causal=True. Note: jax_flash.attention aligns causal "
        "bottom-right when T != S (query i sees keys j <= i + S - T, what "
        "decoding against a KV cache needs); jax.nn aligns top-left (j <= i)"),
    "local_window_size": (
        "use window=(left, right) (-1 = unbounded side), aligned bottom-right "
        "like causal=; jax.nn's int w means window=(w, w), top-left aligned"),
    "key_value_seq_lengths": (
        "use kv_seq_lengths= (valid keys per batch element, e.g. a "
        "preallocated KV cache; causal=/window= then align the queries to "
        "the end of the valid keys)"),
    "query_seq_lengths": (
        "attention has no query-length argument: mask padded query rows with "
        "segment_ids=(q_ids, kv_ids), giving padded rows an id no key has "
        "(they return zeros)"),
    "mask": (
        "attention takes no dense mask: express it with causal=, window= or "
        "segment_ids= (blockwise, O(seq) memory)"),
    "bias": ("attention takes no dense bias (softcap= is the one logit "
             "transform it fuses)"),
    "return_residual": (
        "use return_lse=True (lse is [..., H, T] float32, differentiable; "
        "jax.nn's residual is [B, T, N])"),
}
POSITIONAL = ("bias", "mask")  # jax.nn's 4th and 5th positional arguments


def refuse(args: tuple, kwargs: dict, implementation) -> None:
  """Raise TypeError/ValueError for jax.nn-style arguments to `attention`."""
  if args:
    names = ", ".join(POSITIONAL[:len(args)]) if len(args) <= 2 else (
        f"{len(args)} extra values")
    raise TypeError(
        f"attention() takes query, key, value positionally and everything "
        f"else by keyword; got {len(args)} more positional argument(s) "
        f"(jax.nn.dot_product_attention's positional {names}?): "
        f"{EQUIVALENTS['bias']}; {EQUIVALENTS['mask']}. {_DROP_IN} "
        "(a dense bias/mask runs on a slower dense XLA path)")
  for name in kwargs:
    if name in EQUIVALENTS:
      raise TypeError(f"{name}= is jax.nn's name: {EQUIVALENTS[name]}. Or: "
                      f"{_DROP_IN}.")
  if kwargs:
    raise TypeError(f"attention() got an unexpected keyword argument "
                    f"{next(iter(kwargs))!r}")
  if implementation == "cudnn":
    raise ValueError(
        "implementation='cudnn' is jax.nn's name for its fused GPU kernel; "
        "jax_flash's fused CUDA kernels are implementation='cuda' (or None "
        "for the best available)")
