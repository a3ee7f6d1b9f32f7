"""Serving with a KV cache: one-call prefill, then greedy decoding, against Flax.

A decoder-only language model (pre-LayerNorm blocks, learned positions) is
built twice from one parameter tree: with `jax_flash.flax.SelfAttention(
decode=True)` and with flax's own `nn.MultiHeadDotProductAttention(
decode=True)`. Both generate greedily from the same prompt:

  * jax_flash prefills the whole prompt in one call (its keys and values
    are written into the cache and it attends causally to itself in one
    `jax_flash.attention_with_kvcache` call), then decodes one token per
    step;
  * flax's decode takes one token per call, so it feeds the prompt token by
    token, then decodes the same way.

Each phase is jitted (the steps in a `lax.scan`) and timed on its own; the
script reports prefill tokens/s, decode tokens/s and the end-to-end time of
each. The one-call prefill is also set against what a stock Flax model does
with a whole prompt when it does not serve: one causal forward over it
(`nn.MultiHeadDotProductAttention` with a causal mask, no cache). It then checks, in float32 on the same parameters, that each decoder's
greedy tokens are identical to those a cache-free causal forward over the
same sequence picks, and that their logits agree; exit status 1 otherwise.

    python3 examples/generate.py            # GPU configuration (below)
    python3 examples/generate.py --small    # CPU-friendly, a few seconds
    python3 examples/generate.py --out benchmarks/results/h200.json  # on an H200

The default is the GPU configuration: batch 8, a 4000-token prompt, 96 new
tokens, 4 layers, d_model 2048, 16 heads, vocabulary 32000, bfloat16. Any
option overrides the chosen configuration:
    [--batch B] [--prompt P] [--new N] [--layers L] [--d-model D]
    [--heads H] [--vocab V] [--dtype float32|bfloat16]
    [--implementation None|xla|pallas|cuda] [--repeats R] [--out FILE]

--out merges one row per decoder into a results JSON list, with
benchmarks/bench_attention.py's merge (rows of the same key replaced; a file
holding another device's rows is refused before anything runs). The rows:
`case` generate_b{batch}_p{prompt}_n{new}_l{layers}_d{d_model}_v{vocab},
`impl` jax_flash (jax_flash_<backend> with --implementation) or flax,
mode "generate", B / T / S / H / H_kv / D = batch, prompt, prompt + new,
heads, heads, d_model / heads, the model's configuration, `tokens_per_s`
(decode), `prefill_tokens_per_s`, `end_to_end_ms`, `prefill_ms`, `decode_ms`,
the same run's Flax figures (`flax_tokens_per_s`,
`flax_prefill_tokens_per_s`, `flax_end_to_end_ms`, and
`flax_forward_tokens_per_s`: the stock causal forward over the prompt, on
every row), the float32
check (`greedy_match`, `logits_max_rel_err`, `check_ok`), `date`, `command`
and `device`.

The parameters are random (speed and agreement do not need a trained model).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

import jax_flash.flax as jff

CONFIGS = {
    "gpu": dict(batch=8, prompt=4000, new=96, layers=4, d_model=2048,
                heads=16, vocab=32000, dtype="bfloat16"),
    "small": dict(batch=2, prompt=45, new=9, layers=2, d_model=64, heads=4,
                  vocab=128, dtype="float32"),
}
#: Largest logit difference from the cache-free forward, relative to the
#: largest logit, that the float32 check accepts.
LOGITS_RTOL = 1e-3


class DecoderLM(nn.Module):
  vocab: int
  d_model: int
  heads: int
  layers: int
  max_len: int
  stock: bool = False
  decode: bool = False
  implementation: str | None = None
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens, positions, last_only: bool = False):
    """Logits [batch, T, vocab] (float32), or of the last token only."""
    x = nn.Embed(self.vocab, self.d_model, dtype=self.dtype)(tokens)
    x = x + nn.Embed(self.max_len, self.d_model, dtype=self.dtype)(positions)
    for i in range(self.layers):
      h = nn.LayerNorm(dtype=self.dtype, name=f"ln{i}")(x)
      if self.stock:
        mask = None if self.decode else nn.make_causal_mask(tokens)
        h = nn.MultiHeadDotProductAttention(
            self.heads, dtype=self.dtype, decode=self.decode,
            name=f"attn{i}")(h, mask=mask)
      else:
        h = jff.SelfAttention(
            num_heads=self.heads, causal=True, decode=self.decode,
            implementation=self.implementation, dtype=self.dtype,
            name=f"attn{i}")(h)
      x = x + h
      h = nn.LayerNorm(dtype=self.dtype, name=f"ln_mlp{i}")(x)
      h = nn.Dense(4 * self.d_model, dtype=self.dtype, name=f"up{i}")(h)
      x = x + nn.Dense(self.d_model, dtype=self.dtype, name=f"down{i}")(
          nn.gelu(h))
    if last_only:  # serving needs the next token's logits only
      x = x[:, -1:]
    x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
    return nn.Dense(self.vocab, dtype=self.dtype, name="head")(x).astype(
        jnp.float32)


IMPLEMENTATIONS = ("cuda", "pallas", "xla")


def implementation_arg(text: str) -> str | None:
  """--implementation: "None" (or "auto") is Python's None, the best
  available backend; otherwise one of jax_flash's backend names."""
  if text in ("None", "none", "auto"):
    return None
  if text not in IMPLEMENTATIONS:
    raise argparse.ArgumentTypeError(
        f"--implementation {text!r} is not known; supported: None (best "
        f"available), {', '.join(IMPLEMENTATIONS)}")
  return text


def _apply(model, params, cache, tokens, start, last_only=True):
  """Runs tokens [batch, T] at positions start... against the cache."""
  positions = start + jnp.arange(tokens.shape[1])[None]
  logits, upd = model.apply({"params": params, "cache": cache}, tokens,
                            jnp.broadcast_to(positions, tokens.shape),
                            last_only, mutable=["cache"])
  return upd["cache"], logits[:, -1]


def make_prefill(model, one_call: bool):
  """jit(params, cache, prompt) -> (cache, first token, its logits): the
  prompt in one call, or one token per step (flax's decode)."""

  def prefill(params, cache, prompt):
    if one_call:
      cache, logits = _apply(model, params, cache, prompt, 0)
    else:
      def step(cache, pos):
        token = jax.lax.dynamic_slice_in_dim(prompt, pos, 1, 1)
        return _apply(model, params, cache, token, pos)[0], None
      cache, _ = jax.lax.scan(step, cache, jnp.arange(prompt.shape[1] - 1))
      cache, logits = _apply(model, params, cache, prompt[:, -1:],
                             prompt.shape[1] - 1)
    return cache, jnp.argmax(logits, -1).astype(prompt.dtype), logits

  return jax.jit(prefill, donate_argnums=1)


def make_decode(model, prompt_len: int, new: int):
  """jit(params, cache, first token) -> (cache, tokens, logits) [batch,
  new - 1, ...]: greedy steps; logits[:, i] are those that chose
  tokens[:, i]."""

  def decode(params, cache, token):
    def step(carry, pos):
      cache, token = carry
      cache, logits = _apply(model, params, cache, token[:, None], pos)
      nxt = jnp.argmax(logits, -1).astype(token.dtype)
      return (cache, nxt), (nxt, logits)
    (cache, _), (tokens, logits) = jax.lax.scan(
        step, (cache, token), prompt_len + jnp.arange(new - 1))
    return cache, tokens.T, jnp.swapaxes(logits, 0, 1)

  return jax.jit(decode, donate_argnums=1)


class Decoder:
  """One model's prefill and decode, with a fresh cache for every run."""

  def __init__(self, model, prompt_len, new, one_call, cache_shapes):
    self.prefill = make_prefill(model, one_call)
    self.decode = make_decode(model, prompt_len, new)
    self.empty_cache = jax.jit(lambda: jax.tree.map(
        lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes))

  def generate(self, params, prompt):
    """(tokens [batch, new], logits [batch, new, vocab], seconds in prefill,
    seconds in decode)."""
    cache = jax.block_until_ready(self.empty_cache())
    t0 = time.perf_counter()
    cache, first, first_logits = jax.block_until_ready(
        self.prefill(params, cache, prompt))
    t1 = time.perf_counter()
    _, rest, rest_logits = jax.block_until_ready(
        self.decode(params, cache, first))
    t2 = time.perf_counter()
    tokens = jnp.concatenate([first[:, None], rest], 1)
    logits = jnp.concatenate([first_logits[:, None], rest_logits], 1)
    return tokens, logits, t1 - t0, t2 - t1


def build(args, dtype):
  """(jax_flash decoder, flax decoder, cache-free forward) in `dtype`."""
  total = args.prompt + args.new
  common = dict(vocab=args.vocab, d_model=args.d_model, heads=args.heads,
                layers=args.layers, max_len=total, dtype=dtype)
  ours = DecoderLM(**common, decode=True, implementation=args.implementation)
  stock = DecoderLM(**common, decode=True, stock=True)
  full = DecoderLM(**common, implementation=args.implementation)
  tokens = jax.ShapeDtypeStruct((args.batch, total), jnp.int32)
  shapes = lambda m: jax.eval_shape(m.init, jax.random.key(0), tokens,
                                    tokens)["cache"]
  return (Decoder(ours, args.prompt, args.new, True, shapes(ours)),
          Decoder(stock, args.prompt, args.new, False, shapes(stock)),
          jax.jit(lambda p, s: full.apply(
              {"params": p}, s, jnp.broadcast_to(jnp.arange(s.shape[1]),
                                                 s.shape))))


def stock_forward(args, dtype):
  """jit(params, prompt) -> the last token's logits: a stock Flax model's
  cache-free causal forward over the whole prompt."""
  model = DecoderLM(vocab=args.vocab, d_model=args.d_model, heads=args.heads,
                    layers=args.layers, max_len=args.prompt + args.new,
                    dtype=dtype, stock=True)
  return jax.jit(lambda p, s: model.apply(
      {"params": p}, s, jnp.broadcast_to(jnp.arange(s.shape[1]), s.shape),
      True))


def time_forward(forward, params, prompt, repeats):
  """Median seconds of one forward over the prompt (compiled first)."""
  jax.block_until_ready(forward(params, prompt))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(forward(params, prompt))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def check(forward, params, prompt, tokens, logits):
  """(fraction of greedy tokens the cache-free forward picks too, largest
  logit difference relative to the largest logit)."""
  seq = jnp.concatenate([prompt, tokens[:, :-1]], 1)
  want = forward(params, seq)[:, prompt.shape[1] - 1:]
  same = float(jnp.mean(jnp.argmax(want, -1) == tokens))
  err = float(jnp.max(jnp.abs(logits - want)) / jnp.max(jnp.abs(want)))
  return same, err


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--small", action="store_true",
                 help="CPU-friendly configuration: " + ", ".join(
                     f"{k} {v}" for k, v in CONFIGS["small"].items()))
  for name, kind in (("batch", int), ("prompt", int), ("new", int),
                     ("layers", int), ("d-model", int), ("heads", int),
                     ("vocab", int)):
    p.add_argument(f"--{name}", type=kind, default=None,
                   help=f"default: {CONFIGS['gpu'][name.replace('-', '_')]} "
                   f"({CONFIGS['small'][name.replace('-', '_')]} with --small)")
  p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                 help="parameters and activations of the timed runs "
                 "(default: bfloat16; float32 with --small)")
  p.add_argument("--implementation", default=None, type=implementation_arg,
                 help="attention backend: None (best available), cuda, "
                 "pallas or xla (default: None)")
  p.add_argument("--repeats", type=int, default=3,
                 help="timed generations, the median reported (default: 3)")
  p.add_argument("--out", type=pathlib.Path,
                 help="merge one row per decoder into this results JSON "
                 "(default: write nothing); refused if it holds another "
                 "device's rows")
  args = p.parse_args(argv)
  for k, v in CONFIGS["small" if args.small else "gpu"].items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  if min(args.new, args.prompt, args.repeats) < 1:
    p.error("--prompt, --new and --repeats must be at least 1")
  if args.out is not None:  # refuse before timing, not after
    results = results_module()
    try:
      results.check_same_device(args.out, jax.devices()[0].device_kind)
    except results.OtherDeviceError as e:
      p.error(str(e))
  return args


def results_module():
  """benchmarks/bench_attention.py, whose merge and device check the
  results files share."""
  here = str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks")
  if here not in sys.path:
    sys.path.insert(0, here)
  import bench_attention
  return bench_attention


def figures(args, t_prefill, t_decode, t_all):
  """One decoder's figures from its median seconds in prefill, in decode and
  end to end; decode tokens/s is None with a single new token (the prefill
  picks it)."""
  return dict(
      prefill_tokens_per_s=args.batch * args.prompt / t_prefill,
      tokens_per_s=(args.batch * (args.new - 1) / t_decode
                    if args.new > 1 else None),
      end_to_end_ms=t_all * 1e3, prefill_ms=t_prefill * 1e3,
      decode_ms=t_decode * 1e3)


def _rounded(x):
  return None if x is None else float(f"{x:.5g}")


def result_rows(args, figs, checks, *, command, device):
  """One results row per decoder (fields: the module docstring). figs and
  checks: {"jax_flash" | "flax": figures(...)} and {...: (greedy_match,
  logits_max_rel_err, check_ok)}."""
  head_dim = args.d_model // args.heads
  case = (f"generate_b{args.batch}_p{args.prompt}_n{args.new}_l{args.layers}"
          f"_d{args.d_model}_v{args.vocab}")
  date = datetime.date.today().isoformat()
  flax = {f"flax_{k}": _rounded(figs["flax"][k]) for k in (
      "tokens_per_s", "prefill_tokens_per_s", "end_to_end_ms")}
  flax["flax_forward_tokens_per_s"] = _rounded(
      figs["flax"].get("forward_tokens_per_s"))
  rows = []
  for name, fig in figs.items():
    backend = args.implementation if name == "jax_flash" else None
    same, err, ok = checks[name]
    rows.append(dict(
        impl=name if backend is None else f"{name}_{backend}",
        mode="generate", case=case, dtype=args.dtype, B=args.batch,
        T=args.prompt, S=args.prompt + args.new, H=args.heads,
        H_kv=args.heads, D=head_dim, D_v=head_dim, causal=True,
        prompt=args.prompt, new=args.new, layers=args.layers,
        d_model=args.d_model, vocab=args.vocab, implementation=backend,
        **{k: _rounded(v) for k, v in fig.items()}, **flax,
        greedy_match=same, logits_max_rel_err=float(f"{err:.3g}"),
        check_ok=ok, date=date, command=command, device=device))
  return rows


def main(argv=None) -> int:
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  pkey, tkey = jax.random.split(jax.random.key(0))
  total = args.prompt + args.new
  init = DecoderLM(args.vocab, args.d_model, args.heads, args.layers, total,
                   stock=True).init
  zeros = jnp.zeros((1, total), jnp.int32)
  params = jax.jit(lambda k: init(k, zeros, zeros))(pkey)["params"]
  prompt = jax.random.randint(tkey, (args.batch, args.prompt), 0, args.vocab)
  print(f"{jax.default_backend()}: batch {args.batch}, prompt {args.prompt}, "
        f"{args.new} new tokens, {args.layers} layers, d_model "
        f"{args.d_model}, {args.heads} heads, vocab {args.vocab}, "
        f"{args.dtype}")

  # float32 runs at full matmul precision (no TF32), so that the check
  # measures the decoders rather than the matmuls.
  precise = lambda: jax.default_matmul_precision("highest")
  timed_ctx = precise() if dtype == jnp.float32 else contextlib.nullcontext()
  runs = {}
  with timed_ctx:
    ours, stock, _ = build(args, dtype)
    cast = jax.tree.map(lambda x: x.astype(dtype), params)
    for name, dec in (("jax_flash", ours), ("flax", stock)):
      first = dec.generate(cast, prompt)  # compiles
      times = [dec.generate(cast, prompt)[2:] for _ in range(args.repeats)]
      runs[name] = (first, np.median(np.array(times), 0),
                    np.median([sum(t) for t in times]))
    t_forward = time_forward(stock_forward(args, dtype), cast, prompt,
                             args.repeats)

  figs = {name: figures(args, t_pre, t_dec, t_all)
          for name, (_, (t_pre, t_dec), t_all) in runs.items()}
  figs["flax"]["forward_tokens_per_s"] = args.batch * args.prompt / t_forward
  print(f"{'':10s} {'prefill tok/s':>14s} {'decode tok/s':>13s} "
        f"{'end-to-end':>11s}")
  for name, f in figs.items():
    dec = "-" if f["tokens_per_s"] is None else f"{f['tokens_per_s']:.0f}"
    print(f"{name:10s} {f['prefill_tokens_per_s']:14.0f} {dec:>13s} "
          f"{f['end_to_end_ms']:8.1f} ms")
  print(f"flax causal forward over the prompt (no cache): "
        f"{figs['flax']['forward_tokens_per_s']:.0f} tok/s; jax_flash's "
        f"one-call prefill {figs['jax_flash']['prefill_tokens_per_s'] / figs['flax']['forward_tokens_per_s']:.2f}x it")
  print(f"end-to-end speed-up of jax_flash over flax: "
        f"{runs['flax'][2] / runs['jax_flash'][2]:.2f}x")

  ok, checks = True, {}
  with precise():
    ours32, stock32, forward = build(args, jnp.float32)
    for name, dec in (("jax_flash", ours32), ("flax", stock32)):
      if dtype == jnp.float32:
        out_tokens, out_logits = runs[name][0][:2]
      else:
        out_tokens, out_logits = dec.generate(params, prompt)[:2]
      same, err = check(forward, params, prompt, out_tokens, out_logits)
      good = same == 1.0 and err <= LOGITS_RTOL
      ok = ok and good
      checks[name] = (same, err, good)
      print(f"float32 check, {name}: greedy tokens identical to a cache-free "
            f"forward: {same:.3f} (must be 1); logits max rel err {err:.1e} "
            f"(<= {LOGITS_RTOL:.0e}) {'OK' if good else 'FAILED'}")
  if args.out is not None:  # the rows say whether the check passed
    command = " ".join(["python examples/generate.py"] + list(
        sys.argv[1:] if argv is None else argv))
    rows = result_rows(args, figs, checks, command=command,
                       device=jax.devices()[0].device_kind)
    results_module().merge_into(args.out, rows)
    print(f"results merged into {args.out}")
  if not ok:
    print("FAILED: a decoder disagrees with the cache-free forward")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
