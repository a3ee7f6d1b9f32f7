"""Small calls through the CUDA kernels, for compute-sanitizer.

    python3 tools/gpu/sanitize_case.py [CASE ...]     (default: dense)

Cases (odd sizes, GQA, so that the masked and predicated paths run):
  dense     forward + backward, D = 64 and 128, causal and window + segment
            ids + softcap
  sm90_fwd  the forward alone: D=128 causal, D=64 window + segments + softcap
  sm90_bwd  the same two calls with their backward
  sm80      sm90_bwd's calls with JAX_FLASH_CUDA_FAMILY=sm80 (set here before
            tracing; run it in a process of its own, as a family chosen at
            trace time is not meant to change within one)
  varlen    varlen_attention forward + backward: four sequences (one empty),
            causal, through the packing pre-pass
  varlen_kernel  the per-sequence sm90 varlen forward and backward (both knobs on,
            set here around tracing): D = 64, 128, 256 and the 192 / 128
            pair, causal GQA and window + softcap + sinks, docs of 1, 7,
            129, 1000 tokens, an empty one, tokens outside every sequence
            (the zeroing launches), forward + backward (the per-sequence
            backward for the buckets, the packed one for the pair)
  decode    attention_with_kvcache, one new token: a contiguous cache with
            ragged lengths split in three (with and without sinks), and a
            paged one (shuffled pages)
  dropout   forward + backward with attention dropout (rate 0.1): D = 64 and
            128 causal, D = 64 window + segment ids, and D = 256 causal (the
            sm90 kernels; the column split's backward at D = 256)
  fp8       fp8_attention (the quantisation pre-pass and the FP8 forward, its
            V transpose in shared memory), T=200 S=333, D = 64 and 128
            causal, D = 256 not; the pre-pass alone at T=545 S=203 (launch
            1's clusters with idle CTAs), rotated and not
  fp8_prepass  the CUDA pre-pass alone (no forward) at fp8's shapes, rotated
            and not: launch 1's clusters and launch 2, nothing else
  fp8_fwd   the FP8 forward alone: fp8_attention on Fp8Tensors quantised by
            quantize_fp8 (plain JAX, no pre-pass kernel), fp8's calls
  sinks     forward + backward with learnable sinks: D = 64 and 128 causal
            (T > S: rows without keys) and window + segment ids
  packed    segment ids at T = 333 and a varlen call of five short
            sequences (200 tokens): few query blocks, the packed tile order
  mla       forward + backward with the value head dim of DeepSeek MLA
            (q/k 192, v 128; the sm80 kernels' head-dim pair), causal GQA
            with T > S (rows without keys) and learnable sinks
  ring_dropout  ring attention with dropout on a one-device mesh (zigzag:
            kernel calls at nonzero row and column origins), fwd + bwd
Each case prints "== case NAME" before it and "== case NAME: ok|FAILED ..."
after its results are ready (a pause then lets compute-sanitizer print that
case's reports before the next marker). Exits non-zero if a result is not
finite or a case raises.
"""

import os
import sys
import time
import traceback

import numpy as np

import jax
import jax.numpy as jnp

import jax_flash

RNG = np.random.default_rng(7)


def normal(*shape):
  return jnp.asarray(RNG.standard_normal(shape), jnp.bfloat16)


def finite(*xs) -> bool:
  return all(bool(jnp.all(jnp.isfinite(jnp.asarray(x, jnp.float32))))
             for x in jax.tree_util.tree_leaves(xs))


def dense_calls(dims, masks_of, grad: bool, **common):
  """(name, ok) for every D in dims and masking of masks_of(T, S)."""
  B, T, S, H, Hk = 1, 77, 131, 4, 2
  results = []
  for D in dims:
    q, k, v = normal(B, T, H, D), normal(B, S, Hk, D), normal(B, S, Hk, D)
    for kw in masks_of(T, S):
      def f(q, k, v, kw=kw):
        return jax_flash.attention(q, k, v, implementation="cuda", **common,
                                   **kw)
      if grad:
        loss = lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32))
        out = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
      else:
        out = jax.jit(f)(q, k, v)
      results.append((f"D={D} {sorted(kw)}", finite(out)))
  return results


def both_masks(T, S):
  seg = (jnp.asarray(RNG.integers(0, 2, (1, T)), jnp.int32),
         jnp.asarray(RNG.integers(0, 2, (1, S)), jnp.int32))
  return (dict(causal=True),
          dict(window=(17, 5), segment_ids=seg, softcap=20.0))


def causal_only(T, S):
  return (dict(causal=True),)


def window_only(T, S):
  return both_masks(T, S)[1:]


def dense():
  return dense_calls((64, 128), both_masks, grad=True)


def sm90_fwd():
  return (dense_calls((128,), causal_only, grad=False)
          + dense_calls((64,), window_only, grad=False))


def sm90_bwd():
  return (dense_calls((128,), causal_only, grad=True)
          + dense_calls((64,), window_only, grad=True))


def sm80():
  os.environ["JAX_FLASH_CUDA_FAMILY"] = "sm80"
  return sm90_bwd()


def dropout():
  drop = dict(dropout_rate=0.1, dropout_rng=jax.random.key(3))
  window_segments = lambda T, S: (dict(both_masks(T, S)[1], softcap=None),)
  return (dense_calls((64, 128), causal_only, grad=True, **drop)
          + dense_calls((64,), window_segments, grad=True, **drop)
          + dense_calls((256,), causal_only, grad=True, **drop))


def sinks():
  s = dict(sinks=jnp.asarray(RNG.normal(0.5, 1.5, 4), jnp.float32))
  return (dense_calls((64, 128), causal_only, grad=True, **s)
          + dense_calls((64,), window_only, grad=True, **s))


def packed():
  T, H, Hk, D = 333, 4, 2, 128
  q, k, v = normal(1, T, H, D), normal(1, T, Hk, D), normal(1, T, Hk, D)
  ids = jnp.asarray(np.repeat(np.arange(5), [70, 1, 120, 64, 78])[None],
                    jnp.int32)
  o = jax_flash.attention(q, k, v, causal=True, segment_ids=ids,
                          implementation="cuda")
  results = [(f"segment ids T={T}", finite(o))]
  lens = [40, 40, 40, 40, 40]
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  qv, kv_, vv = normal(200, H, D), normal(200, Hk, D), normal(200, Hk, D)
  o = jax_flash.varlen_attention(qv, kv_, vv, cu, cu, max_seqlen_q=40,
                                 max_seqlen_k=40, causal=True,
                                 implementation="cuda")
  results.append((f"varlen {lens}", finite(o)))
  return results


def mla():
  T, S, H, Hk = 157, 131, 4, 2
  q, k, v = normal(1, T, H, 192), normal(1, S, Hk, 192), normal(1, S, Hk, 128)
  sinks = jnp.asarray(RNG.normal(0.5, 1.5, H), jnp.float32)

  def loss(q, k, v, sinks):
    o = jax_flash.attention(q, k, v, causal=True, sinks=sinks,
                            implementation="cuda")
    return jnp.sum(o.astype(jnp.float32))
  out = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
  return [(f"D=192 D_v=128 T={T} S={S} causal sinks", finite(out))]


def ring_dropout():
  from jax.sharding import Mesh
  mesh = Mesh(np.array(jax.devices()[:1]), ("s",))
  q, k, v = normal(1, 256, 4, 64), normal(1, 256, 2, 64), normal(1, 256, 2, 64)

  def loss(q, k, v):
    o = jax_flash.ring_attention(q, k, v, mesh=mesh, seq_axis="s",
                                 causal=True, dropout_rate=0.1,
                                 dropout_rng=jax.random.key(5),
                                 implementation="cuda")
    return jnp.sum(o.astype(jnp.float32))
  out = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  return [("one-device zigzag ring, chunks of 128", finite(out))]


def varlen():
  lens = [37, 0, 113, 61]
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  total, H, Hk, D = sum(lens), 4, 2, 128
  q, k, v = normal(total, H, D), normal(total, Hk, D), normal(total, Hk, D)

  def loss(q, k, v):
    o = jax_flash.varlen_attention(q, k, v, cu, cu, max_seqlen_q=max(lens),
                                   max_seqlen_k=max(lens), causal=True,
                                   implementation="cuda")
    return jnp.sum(o.astype(jnp.float32))
  out = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
  return [(f"lengths {lens} causal", finite(out))]


def varlen_kernel():
  lens = [1, 7, 0, 129, 1000, 3]
  lead, tail = 5, 3
  cu = jnp.asarray(lead + np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  total, H, Hk = lead + sum(lens) + tail, 4, 2
  sinks = jnp.asarray(RNG.normal(0.5, 1.5, H), jnp.float32)
  knobs = ("JAX_FLASH_VARLEN_KERNEL", "JAX_FLASH_VARLEN_BWD_KERNEL")
  old = {n: os.environ.get(n) for n in knobs}
  os.environ.update({n: "1" for n in knobs})
  results = []
  try:
    for D, Dv in ((64, 64), (128, 128), (256, 256), (192, 128)):
      q, k, v = normal(total, H, D), normal(total, Hk, D), normal(total, Hk, Dv)
      for kw in (dict(causal=True), dict(window=(100, 20), softcap=5.0,
                                         sinks=sinks)):
        def loss(q, k, v, kw=kw):
          o = jax_flash.varlen_attention(
              q, k, v, cu, cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
              implementation="cuda", **kw)
          return jnp.sum(o.astype(jnp.float32))
        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        assert "jax_flash_fwd_varlen" in grad.lower(q, k, v).as_text()
        out = grad(q, k, v)
        results.append((f"D={D} D_v={Dv} {sorted(kw)} lengths {lens}",
                        finite(out)))
  finally:
    for n, value in old.items():
      if value is None:
        os.environ.pop(n, None)
      else:
        os.environ[n] = value
  return results


def decode():
  B, S, H, Hk, D, page = 3, 320, 8, 2, 128, 64
  q = normal(B, 1, H, D)
  lengths = jnp.asarray([5, 190, 320], jnp.int32)
  k, v = normal(B, S, Hk, D), normal(B, S, Hk, D)
  o = jax_flash.attention_with_kvcache(q, k, v, lengths, num_splits=3,
                                       implementation="cuda")
  results = [("contiguous, 3 splits", finite(o))]
  sinks = jnp.asarray(RNG.normal(0.5, 1.5, H), jnp.float32)
  o = jax_flash.attention_with_kvcache(q, k, v, lengths, num_splits=3,
                                       sinks=sinks, implementation="cuda")
  results.append(("contiguous, 3 splits, sinks", finite(o)))
  n = S // page
  table = jnp.asarray(RNG.permutation(B * n).reshape(B, n), jnp.int32)
  k_pages, v_pages = normal(B * n, page, Hk, D), normal(B * n, page, Hk, D)
  o = jax_flash.attention_with_kvcache(q, k_pages, v_pages, lengths,
                                       page_table=table,
                                       implementation="cuda")
  results.append((f"paged ({page})", finite(o)))
  return results


FP8_CALLS = ((64, True), (128, True), (256, False))  # (D, causal), T=200 S=333


def fp8():
  B, T, S, H = 1, 200, 333, 2
  results = []
  for D, causal in FP8_CALLS:
    q, k, v = normal(B, T, H, D), normal(B, S, H, D), normal(B, S, H, D)
    out = jax_flash.fp8_attention(q, k, v, causal=causal, return_lse=True,
                                  implementation="cuda")
    results.append((f"B={B} T={T} S={S} H={H} D={D} causal={causal}",
                    finite(out)))
  return results + fp8_prepass_calls(((1, 545, 203, 1, 1),))


def fp8_prepass_calls(shapes):
  """The CUDA pre-pass alone at each (B, T, S, H, Hk), D = 64, 128, 256,
  rotated and not."""
  from jax_flash._src.fp8 import cuda as fp8_cuda
  results = []
  for B, T, S, H, Hk in shapes:
    for D in (64, 128, 256):
      q, k, v = normal(B, T, H, D), normal(B, S, Hk, D), normal(B, S, Hk, D)
      for seed in (None, 3):
        out = jax.jit(lambda q, k, v, seed=seed: fp8_cuda.quantize(
            q, k, v, seed=seed))(q, k, v)
        results.append((f"pre-pass B={B} T={T} S={S} H={H} D={D} "
                        f"seed={seed}", finite(out)))
  return results


def fp8_prepass():
  # fp8_attention's shapes, then one that leaves CTAs of launch 1's clusters
  # without a block (9 Q blocks, 2 K blocks, 1 chunk of V's keys per head).
  return fp8_prepass_calls(((1, 200, 333, 2, 2), (1, 545, 203, 1, 1)))


def fp8_fwd():
  B, T, S, H = 1, 200, 333, 2
  results = []
  for D, causal in FP8_CALLS:
    q, k, v = normal(B, T, H, D), normal(B, S, H, D), normal(B, S, H, D)
    q8 = jax_flash.quantize_fp8(q, kind="query")
    k8 = jax_flash.quantize_fp8(k, kind="key")
    v8 = jax_flash.quantize_fp8(v, kind="value")
    out = jax_flash.fp8_attention(q8, k8, v8, causal=causal, return_lse=True,
                                  implementation="cuda")
    results.append((f"Fp8Tensors B={B} T={T} S={S} H={H} D={D} "
                    f"causal={causal}", finite(out)))
  return results


CASES = dict(dense=dense, sm90_fwd=sm90_fwd, sm90_bwd=sm90_bwd, sm80=sm80,
             dropout=dropout, varlen=varlen, varlen_kernel=varlen_kernel,
             decode=decode, fp8=fp8,
             fp8_prepass=fp8_prepass, fp8_fwd=fp8_fwd,
             sinks=sinks, packed=packed, ring_dropout=ring_dropout,
             mla=mla)


def main(names):
  unknown = [n for n in names if n not in CASES]
  if unknown:
    raise SystemExit(f"unknown cases {unknown}; known: {', '.join(CASES)}")
  failed = 0
  for name in names or ["dense"]:
    print(f"== case {name}", flush=True)
    try:
      results = CASES[name]()
      bad = [what for what, ok in results if not ok]
      for what, ok in results:
        print(f"{name} {what} finite={ok}", flush=True)
      status = f"FAILED (not finite: {bad})" if bad else "ok"
    except Exception as e:  # noqa: BLE001 - report and go on
      traceback.print_exc()
      bad, status = [name], f"FAILED ({type(e).__name__}: {str(e)[:200]})"
    failed += bool(bad)
    time.sleep(1)
    print(f"== case {name}: {status}", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
