"""Backend-agnostic correctness suite for `jax_flash.attention`.

A backend's test module subclasses `AttentionSuite` and names itself:

    from attention_suite import AttentionSuite

    class TestPallasSuite(AttentionSuite):
      implementation = "pallas"
      long_seq = 200             # > one block of this backend, but cheap

Every test is parametrised from class attributes (see `pytest_generate_tests`
below), so a subclass can change `dtypes`, `head_dims`, `cases`, `long_seq`
and `batch` and gets its own parametrisation. The criterion (DESIGN.md) is
`reference.assert_close_to_reference`:

    max|impl - ref64| <= 2 * max|dense same-dtype XLA - ref64| + 1e-5

for o, lse, dq, dk, dv, with ref64 the float64 numpy reference computed from
the same (already rounded) inputs. On top of that: shapes/dtypes of every
output, fully masked rows give o == 0 exactly and lse == -inf, every gradient
is finite.

Knobs for slow backends (Pallas interpret mode on CPU): `long_seq` (the
"longer than one block" length; keep it above the backend's block size),
`batch` (default leading batch), `cases` (a tuple of `Case`; filter it with
`select_cases`), `dtypes`, `head_dims`.

Support matrix: every suite declares what its backend serves (`support`, a
`Support`: dtypes, head dims, softcap, segment ids, windows, GQA, return_lse,
deterministic, scale sign, sinks, a distinct value head dim; XLA, PALLAS_CPU, PALLAS_GPU, CUDA_SM80, CUDA_SM90
below, as each backend's `check` decides). A request inside it must run and
match the reference; one outside it must raise `jax_flash.Unsupported` naming
the implementation. Nothing is skipped. `BackendSuite` adds probes for the
dimensions the cases do not walk (each dtype, head dims 4/16/36, softcap, a
negative scale), so every declared flag is checked both ways; each backend's
test module has one `BackendSuite`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import reference
from reference import assert_close_to_reference

LONG = "long"  # placeholder for the class's `long_seq`


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention configuration. Features are combined, not crossed."""
  name: str
  T: Any = 64                 # int, or LONG
  S: Any = None               # int, LONG, or None (= T)
  H: int = 4
  Hk: int | None = None       # None = H (MHA)
  d: str | int = "mid"        # "small" | "mid" | "large": pick from head_dims;
                              # an int: that head dim
  batch: tuple | None = None  # leading dims; None = (cls.batch,); () = rank 3
  causal: bool = False
  window: tuple | None = None
  softcap: float | None = None
  scale: float | None = None
  segments: str | None = None  # None | "packed" (one array, T == S) | "pair"
  dlse: bool = False          # backward through return_lse=True with a dLSE
  sinks: bool = False         # learnable sinks [H] (random, differentiated)
  dv: int | None = None       # value head dim; None = the q/k head dim

  def __str__(self):
    return self.name


CASES = (
    Case("base_129", T=129, H=4, d="large"),
    Case("odd_gqa_t_lt_s", T=37, S=53, H=4, Hk=2, d="small"),
    Case("odd_mqa_t_gt_s", T=53, S=37, H=4, Hk=1, d="large", dlse=True),
    Case("decode_mqa", T=1, S=LONG, H=4, Hk=1, d="mid"),
    Case("decode_causal_window", T=1, S=LONG, H=4, Hk=2, d="small",
         causal=True, window=(64, -1)),
    Case("long_t_lt_s", T=77, S=LONG, H=4, Hk=2, d="mid", dlse=True),
    Case("causal", T=96, H=4, d="large", causal=True, dlse=True),
    Case("causal_t_lt_s", T=37, S=LONG, H=4, Hk=2, d="small", causal=True),
    # T > S: the first T - S query rows see no key (bottom-right alignment).
    Case("causal_t_gt_s_empty_rows", T=53, S=37, H=4, Hk=1, d="mid",
         causal=True, dlse=True),
    Case("causal_long_gqa", T=LONG, H=4, Hk=2, d="mid", causal=True),
    Case("window_left", T=96, H=4, d="small", window=(16, -1)),
    # T > S, right window 8: the first 8 rows see no key.
    Case("window_right_empty_rows", T=53, S=37, H=4, d="mid", window=(-1, 8)),
    Case("window_both", T=37, S=53, H=4, Hk=2, d="large", window=(7, 5)),
    Case("window_both_long", T=LONG, H=2, Hk=1, d="mid", window=(40, 70),
         dlse=True),
    Case("window_causal_long", T=LONG, H=4, Hk=2, d="small", causal=True,
         window=(64, -1)),
    Case("window_causal_clipped", T=64, S=100, H=4, d="mid", causal=True,
         window=(10, 5)),
    Case("window_diagonal_only", T=40, H=2, d="small", window=(0, 0)),
    Case("segments_packed_window", T=96, H=4, d="mid", segments="packed",
         window=(8, 8)),
    Case("segments_causal_gqa_long", T=LONG, H=4, Hk=2, d="small",
         segments="packed", causal=True, dlse=True),
    # q segment ids that never occur in kv: fully masked rows.
    Case("segments_pair_empty_rows", T=37, S=53, H=4, Hk=1, d="mid",
         segments="pair", dlse=True),
    Case("softcap_scale", T=64, H=4, d="mid", softcap=5.0, scale=0.5),
    Case("softcap_causal_gqa", T=37, S=53, H=4, Hk=2, d="small", softcap=1.0,
         causal=True, dlse=True),
    # Gemma 2's attention softcap at the default scale: logits far below the
    # cap (tanh near 0, where tanh forms differ most), bounded-logit kernels.
    Case("softcap_gemma_causal_gqa", T=LONG, H=4, Hk=2, d="mid", softcap=50.0,
         causal=True, dlse=True),
    Case("scale_peaky", T=64, S=80, H=4, Hk=2, d="large", scale=0.9),
    Case("batch_dims_causal", T=33, S=47, H=4, Hk=2, d="small",
         batch=(2, 3), causal=True),
    Case("batch_dims_segments", T=40, S=56, H=2, d="mid", batch=(2, 2),
         segments="pair"),
    Case("rank3_segments_window", T=45, H=4, Hk=2, d="mid", batch=(),
         segments="packed", window=(5, -1)),
    # T > S causal: rows that see no key give o = 0, lse = the sink.
    Case("sinks_causal_gqa_empty_rows", T=53, S=37, H=4, Hk=2, d="mid",
         causal=True, sinks=True, dlse=True),
    Case("sinks_segments_window_long", T=LONG, H=4, Hk=1, d="small",
         segments="pair", window=(40, 8), sinks=True, dlse=True),
    Case("value_dim_smaller_causal_gqa", T=37, S=LONG, H=4, Hk=2, d="large",
         dv=40, causal=True, dlse=True),
    Case("value_dim_larger_sinks_segments", T=45, S=61, H=4, Hk=2, d="small",
         dv=72, segments="pair", sinks=True, softcap=3.0),
    # DeepSeek MLA's head dims (the CUDA kernels' head-dim pair); T > S:
    # the first T - S rows see no key.
    Case("value_dim_mla_causal_gqa_empty_rows", T=LONG, S=53, H=4, Hk=2,
         d=192, dv=128, causal=True, dlse=True),
)


@dataclasses.dataclass(frozen=True)
class Support:
  """What one backend serves when asked for explicitly (`implementation=`).

  Declared here from the backend's `check` (jax_flash/_src/backends/xla.py,
  pallas/backend.py, cuda_backend.py); the probes of `BackendSuite` fail
  when the declaration and the backend disagree, either way.
  """
  dtypes: tuple = ("bfloat16", "float16", "float32", "float64")
  head_dim_range: tuple = (1, 256)  # what jax_flash.attention accepts
  head_dim_multiple: int = 1
  supports_softcap: bool = True
  supports_segment_ids: bool = True
  supports_window: bool = True  # sliding windows and causal
  supports_gqa: bool = True  # H_kv < H (GQA/MQA)
  supports_return_lse: bool = True
  supports_deterministic: bool = True
  supports_nonpositive_scale: bool = True
  supports_sinks: bool = True
  supports_value_head_dim: bool = True  # v's head dim other than q/k's
  # The (head_dim, value head_dim) pairs with a distinct value head dim that
  # are served; None: every pair of supported head dims.
  value_head_dims: tuple | None = None

  def supports_dtype(self, dtype) -> bool:
    return jnp.dtype(dtype).name in self.dtypes

  def supports_head_dim(self, d: int) -> bool:
    lo, hi = self.head_dim_range
    return lo <= d <= hi and d % self.head_dim_multiple == 0

  def refusal(self, case: Case, dtype, head_dim: int, *,
              deterministic: bool = False) -> str | None:
    """Why the backend refuses this request, or None when it serves it."""
    reasons = [
        (not self.supports_dtype(dtype), f"dtype {jnp.dtype(dtype).name}"),
        (not self.supports_head_dim(head_dim), f"head_dim {head_dim}"),
        (case.dv is not None and not (
            self.supports_value_head_dim and self.supports_head_dim(case.dv)
            and (self.value_head_dims is None or
                 (head_dim, case.dv) in self.value_head_dims)),
         f"value head_dim {case.dv}"),
        (case.sinks and not self.supports_sinks, "sinks"),
        (case.softcap is not None and not self.supports_softcap, "softcap"),
        (case.segments is not None and not self.supports_segment_ids,
         "segment_ids"),
        ((case.causal or case.window is not None) and
         not self.supports_window, "window/causal"),
        ((case.Hk or case.H) < case.H and not self.supports_gqa, "GQA"),
        (not self.supports_return_lse, "return_lse"),  # the suite asks lse
        (deterministic and not self.supports_deterministic, "deterministic"),
        (case.scale is not None and case.scale <= 0 and
         not self.supports_nonpositive_scale, "scale <= 0"),
    ]
    refused = [why for bad, why in reasons if bad]
    return ", ".join(refused) if refused else None


# The backends as they behave (each one's `check`).
XLA = Support()
PALLAS_CPU = Support(head_dim_range=(32, 256))  # interpret mode: float64 too
PALLAS_GPU = Support(dtypes=("bfloat16", "float16", "float32"),
                     head_dim_range=(32, 256))
# 16-byte row loads: head_dim % 8 == 0. A distinct value head dim: the
# head-dim pairs the sm80 kernels instantiate (DeepSeek MLA's; the sm90
# forward has kernels for it too). The sm90 family hands what its own kernels
# do not serve to the sm80 kernels, so from Python both look alike.
CUDA_SM80 = Support(dtypes=("bfloat16", "float16"), head_dim_range=(8, 256),
                    head_dim_multiple=8, supports_nonpositive_scale=False,
                    value_head_dims=((192, 128),))
CUDA_SM90 = CUDA_SM80


def select_cases(*names, exclude=()):
  """A subset of CASES by name (all when no names are given)."""
  known = {c.name for c in CASES}
  unknown = (set(names) | set(exclude)) - known
  if unknown:
    raise ValueError(f"unknown case names {sorted(unknown)}")
  return tuple(c for c in CASES
               if (not names or c.name in names) and c.name not in exclude)


@dataclasses.dataclass
class Problem:
  """Inputs of one test, in user layout and canonical [B, T, H, D] layout."""
  q: Any
  k: Any
  v: Any
  kwargs: dict          # attention kwargs except implementation/return_lse
  segs: tuple           # jnp segment ids passed as jit args ((), (a,), (a, b))
  ref_kwargs: dict      # for reference.* and dense_attention_jax (canonical)
  q64: np.ndarray
  k64: np.ndarray
  v64: np.ndarray
  batch_shape: tuple

  def canon(self, x, trailing: int):
    """[*batch, ...trailing dims] -> numpy [B, ...trailing] (bf16/f16 as
    float32, everything else unchanged)."""
    x = np.asarray(x.astype(jnp.float32) if jnp.asarray(x).dtype in (
        jnp.bfloat16, jnp.float16) else x)
    return x.reshape((-1,) + x.shape[x.ndim - trailing:])


def _segment_ids(rng, kind, batch_shape, T, S):
  """Segment ids. "packed": sorted ids (a packed batch), one array, T == S.
  "pair": unsorted ids in {0,1,2} for kv and {0,1,2,3} for q; id 3 never
  occurs in kv, so those query rows see no key (at least two per row)."""
  if kind == "packed":
    assert T == S, "packed segment ids need T == S"
    starts = rng.random(batch_shape + (T,)) < 4.0 / T
    ids = np.cumsum(starts, axis=-1).astype(np.int32)
    return (ids,)
  q = rng.integers(0, 4, batch_shape + (T,)).astype(np.int32)
  q[..., :2] = 3
  kv = rng.integers(0, 3, batch_shape + (S,)).astype(np.int32)
  return (q, kv)


class AttentionSuite:
  """Subclass with `implementation = "<name>"` (None = default dispatch)."""

  implementation: str | None = None
  dtypes: tuple = ("float32", "bfloat16")
  head_dims: tuple = (32, 64, 128)
  cases: tuple = CASES
  long_seq: int = 300     # a length above one block of the backend
  batch: int = 2          # leading batch of cases that do not fix one
  factor: float = 2.0     # err <= factor * err(dense XLA) + atol
  atol: float = 1e-5
  support: Support = XLA  # what `implementation` serves (see Support)
  # float32 tests (implementation and baseline) run under
  # jax.default_matmul_precision(this). On GPU, XLA's default float32 matmul
  # is TF32 for some shapes and IEEE for others (its algorithm choice), so at
  # default precision the "same-dtype XLA" baseline is ill-defined for
  # float32: it can be exact where the blockwise backend uses TF32 (seen on
  # the H200: T=1 decoding, err 3e-4 vs 1e-7). None = leave the default.
  float32_matmul_precision: str | None = "highest"

  # -- parametrisation from class attributes (works in subclasses) ----------

  def pytest_generate_tests(self, metafunc):
    if "case" in metafunc.fixturenames:
      metafunc.parametrize("case", self.cases, ids=[c.name for c in
                                                    self.cases])
    if "dtype" in metafunc.fixturenames:
      metafunc.parametrize("dtype", self.dtypes)
    if "head_dim" in metafunc.fixturenames:
      metafunc.parametrize("head_dim", self.head_dims)

  @pytest.fixture(autouse=True)
  def _require_implementation(self):
    impl = self.implementation
    if impl is not None and impl not in jax_flash.available_implementations():
      pytest.fail(f"implementation {impl!r} is not registered (available: "
                  f"{jax_flash.available_implementations()})")

  @pytest.fixture(autouse=True)
  def _float32_precision(self, request):
    callspec = getattr(request.node, "callspec", None)
    dtype = (callspec.params.get("dtype", self.dtypes[0]) if callspec else
             self.dtypes[0])
    if (self.float32_matmul_precision is None or
        jnp.dtype(dtype) != jnp.float32):
      yield
      return
    with jax.default_matmul_precision(self.float32_matmul_precision):
      yield

  # -- helpers ---------------------------------------------------------------

  def _len(self, n):
    return self.long_seq if n == LONG else n

  def head_dim_of(self, case):
    if isinstance(case.d, int):
      return case.d
    dims = self.head_dims
    return {"small": dims[0], "mid": dims[len(dims) // 2],
            "large": dims[-1]}[case.d]

  def make_problem(self, case: Case, dtype, rng, head_dim=None) -> Problem:
    T = self._len(case.T)
    S = T if case.S is None else self._len(case.S)
    H = case.H
    Hk = case.Hk or H
    D = head_dim or self.head_dim_of(case)
    bs = (self.batch,) if case.batch is None else tuple(case.batch)
    q = jnp.asarray(rng.standard_normal(bs + (T, H, D), np.float32), dtype)
    k = jnp.asarray(rng.standard_normal(bs + (S, Hk, D), np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(bs + (S, Hk, case.dv or D),
                                        np.float32), dtype)
    kwargs = dict(causal=case.causal, window=case.window,
                  softcap=case.softcap, scale=case.scale)
    if case.sinks:  # spread around the scores' range, so the sink matters
      acc = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
      kwargs["sinks"] = jnp.asarray(rng.normal(0.5, 1.5, H), acc)
    ref_kwargs = dict(kwargs)
    segs = ()
    if case.segments is not None:
      ids = _segment_ids(rng, case.segments, bs, T, S)
      segs = tuple(jnp.asarray(x) for x in ids)
      q_ids, kv_ids = (ids * 2)[:2]
      ref_kwargs["segment_ids"] = (q_ids.reshape(-1, T), kv_ids.reshape(-1, S))
    f64 = lambda x: np.asarray(x.astype(jnp.float32), np.float64).reshape(
        (-1,) + x.shape[-3:]) if x.dtype != jnp.float64 else np.asarray(
            x).reshape((-1,) + x.shape[-3:])
    return Problem(q=q, k=k, v=v, kwargs=kwargs, segs=segs,
                   ref_kwargs=ref_kwargs, q64=f64(q), k64=f64(k), v64=f64(v),
                   batch_shape=bs)

  def attention(self, q, k, v, *segs, **kwargs):
    """jax_flash.attention with this suite's implementation."""
    if segs:
      kwargs["segment_ids"] = segs[0] if len(segs) == 1 else tuple(segs)
    return jax_flash.attention(q, k, v, implementation=self.implementation,
                               **kwargs)

  def refused(self, fn, *args, case: Case, dtype, head_dim: int,
              deterministic: bool = False) -> bool:
    """True (after checking that fn(*args) raises Unsupported) when the
    declared support matrix excludes this request; False when it must run."""
    why = self.support.refusal(case, dtype, head_dim,
                               deterministic=deterministic)
    if why is None:
      return False
    assert self.implementation is not None, (
        "default dispatch serves every request (xla is always there)")
    with pytest.raises(jax_flash.Unsupported,
                       match=f"implementation='{self.implementation}'"):
      fn(*args)
    return True

  def check(self, name, actual, ref64, baseline):
    assert_close_to_reference(name, actual, ref64, baseline,
                              factor=self.factor, atol=self.atol)

  # -- tests -----------------------------------------------------------------

  def test_attention(self, case, dtype, rng):
    """o, lse, dq, dk, dv vs the reference (or the declared refusal).

    Forward and backward share one compiled function (jax.vjp), which halves
    the compile time that dominates this suite on CPU.
    """
    p = self.make_problem(case, dtype, rng)
    self.check_problem(p, rng, with_dlse=case.dlse, case=case)

  def test_head_dims(self, head_dim, dtype, rng):
    """Every head dim in head_dims (odd T, T < S over several blocks, GQA,
    causal, a dLSE cotangent)."""
    case = Case("head_dim", T=37, S=LONG, H=4, Hk=2, causal=True, dlse=True)
    p = self.make_problem(case, dtype, rng, head_dim=head_dim)
    self.check_problem(p, rng, with_dlse=True, case=case)

  def test_return_lse_false(self, rng):
    """return_lse=False: same o; grad of sum(o * do) equals the vjp with a
    zero lse cotangent (the symbolic-zero path of the custom_vjp)."""
    case = Case("x", T=37, S=53, H=4, Hk=2, d="small", causal=True)
    p = self.make_problem(case, self.dtypes[0], rng)
    do = jnp.asarray(rng.standard_normal(p.q.shape, np.float32), p.q.dtype)

    def without_lse(q, k, v):
      loss = lambda q, k, v: jnp.sum(
          self.attention(q, k, v, **p.kwargs).astype(jnp.float32) *
          do.astype(jnp.float32))
      o = self.attention(q, k, v, **p.kwargs)
      return o, jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    def with_lse(q, k, v):
      f = lambda q, k, v: self.attention(q, k, v, return_lse=True, **p.kwargs)
      (o, lse), vjp = jax.vjp(f, q, k, v)
      return o, vjp((do, jnp.zeros_like(lse)))

    if self.refused(jax.jit(without_lse), p.q, p.k, p.v, case=case,
                    dtype=p.q.dtype, head_dim=p.q.shape[-1]):
      return
    o1, g1 = jax.jit(without_lse)(p.q, p.k, p.v)
    o2, g2 = jax.jit(with_lse)(p.q, p.k, p.v)
    assert not isinstance(o1, tuple) and o1.shape == p.q.shape
    np.testing.assert_array_equal(np.asarray(o1, np.float32),
                                  np.asarray(o2, np.float32))
    for a, b in zip(g1, g2):  # two programs: equal up to reassociation
      np.testing.assert_allclose(np.asarray(a, np.float32),
                                 np.asarray(b, np.float32), rtol=1e-5,
                                 atol=1e-5)

  def test_deterministic_backward_is_reproducible(self, rng):
    case = Case("x", T=LONG, H=4, Hk=2, d="small", causal=True)
    p = self.make_problem(case, self.dtypes[0], rng)
    do = jnp.asarray(rng.standard_normal(p.q.shape, np.float32), p.q.dtype)

    def loss(q, k, v):
      o = self.attention(q, k, v, deterministic=True, **p.kwargs)
      return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    if self.refused(grad, p.q, p.k, p.v, case=case, dtype=p.q.dtype,
                    head_dim=p.q.shape[-1], deterministic=True):
      return
    g1 = grad(p.q, p.k, p.v)
    g2 = grad(p.q, p.k, p.v)
    for a, b in zip(g1, g2):
      np.testing.assert_array_equal(np.asarray(a, np.float32),
                                    np.asarray(b, np.float32))

  # -- the check shared by the tests -----------------------------------------

  def check_problem(self, p: Problem, rng, *, with_dlse: bool, case: Case):
    """Forward and backward vs the reference, or the refusal the support
    matrix declares."""
    H, T = p.q.shape[-2], p.q.shape[-3]
    o_shape = p.q.shape[:-1] + p.v.shape[-1:]
    do = jnp.asarray(rng.standard_normal(o_shape, np.float32), p.q.dtype)
    lse_dtype = jnp.float64 if p.q.dtype == jnp.float64 else jnp.float32
    dlse = jnp.zeros(p.batch_shape + (H, T), lse_dtype)
    if with_dlse:
      # A cotangent for lse too (also on fully masked rows: must not NaN).
      dlse = jnp.asarray(rng.standard_normal(dlse.shape, np.float32),
                         lse_dtype)
    # Sinks are differentiated like q, k and v.
    kwargs = {n: x for n, x in p.kwargs.items() if n != "sinks"}
    diff = (p.q, p.k, p.v) + ((p.kwargs["sinks"],) if "sinks" in p.kwargs
                              else ())

    def run(*args):
      segs = args[len(diff):]
      f = lambda q, k, v, *sinks: self.attention(
          q, k, v, *segs, return_lse=True, **kwargs,
          **({"sinks": sinks[0]} if sinks else {}))
      out, vjp = jax.vjp(f, *args[:len(diff)])
      return out, vjp((do, dlse))

    if self.refused(jax.jit(run), *diff, *p.segs, case=case,
                    dtype=p.q.dtype, head_dim=p.q.shape[-1],
                    deterministic=p.kwargs.get("deterministic", False)):
      return
    (o, lse), grads = jax.jit(run)(*diff, *p.segs)

    # Shapes and dtypes.
    assert o.shape == o_shape and o.dtype == p.q.dtype, (o.shape, o.dtype)
    assert lse.shape == p.batch_shape + (H, T), lse.shape
    assert lse.dtype == jnp.float32 or (p.q.dtype == jnp.float64 and
                                        lse.dtype == jnp.float64), lse.dtype
    for name, g, x in zip(("dq", "dk", "dv", "dsinks"), grads, diff):
      assert g.shape == x.shape and g.dtype == x.dtype, (name, g.shape,
                                                         g.dtype)

    # The same-dtype dense XLA baseline, forward and backward in one jit.
    canon = lambda x: x.reshape((-1,) + x.shape[-3:])
    ref_kwargs = {n: x for n, x in p.ref_kwargs.items() if n != "sinks"}

    def dense(do, dlse, *args):
      f = lambda q, k, v, *sinks: reference.dense_attention_jax(
          q, k, v, **ref_kwargs, **({"sinks": sinks[0]} if sinks else {}))
      out, vjp = jax.vjp(f, *args)
      return out, vjp((do, dlse))

    (base_o, base_lse), base_grads = jax.jit(dense)(
        canon(do), dlse.reshape((-1,) + dlse.shape[-2:]),
        *(canon(x) for x in diff[:3]), *diff[3:])

    # Forward.
    ref_o, ref_lse = reference.attention(p.q64, p.k64, p.v64, **p.ref_kwargs)
    o_c, lse_c = p.canon(o, 3), p.canon(lse, 2)
    self.check("o", o_c, ref_o, p.canon(base_o, 3))
    self.check("lse", lse_c, ref_lse, p.canon(base_lse, 2))
    seen = reference.attention(p.q64, p.k64, np.ones_like(p.v64[..., :1]),
                               **ref_kwargs)[0][..., 0]  # [B, T, H]: 0 or 1
    empty = seen.transpose(0, 2, 1) == 0                 # [B, H, T]
    if empty.any():  # rows that see no key: exactly zero output, and lse
      rows = o_c.transpose(0, 2, 1, 3)[empty]            # [n, D_v]
      assert np.all(rows == 0), "fully masked rows must give o == 0 exactly"
      # -inf, or with sinks the sink's logit (to rounding: base-2 kernels
      # carry it as sink * log2(e))
      np.testing.assert_allclose(lse_c[empty], ref_lse[empty], rtol=1e-6,
                                 atol=0)

    # Backward (assert_close_to_reference also demands finite gradients).
    do64 = p.canon(do, 3)
    dlse64 = p.canon(dlse, 2) if with_dlse else None
    ref = reference.attention_vjp(p.q64, p.k64, p.v64, do64, dlse=dlse64,
                                  **p.ref_kwargs)
    for name, g, r, b in zip(("dq", "dk", "dv"), grads, ref, base_grads):
      self.check(name, p.canon(g, 3), r, p.canon(b, 3))
    if len(diff) > 3:
      # The sinks' gradient, -sum_t p_sink delta_t, sums delta over every
      # row, and a flash backward forms delta from the stored output: for
      # 16-bit outputs that rounding (which the dense baseline, never
      # rounding o inside autodiff, does not have) is the error floor. The
      # baseline is the worse of the dense one and the float64 math with
      # only that rounding.
      rounded = reference.attention_vjp(
          p.q64, p.k64, p.v64, do64, dlse=dlse64, **p.ref_kwargs,
          output_dtype=jnp.dtype(p.q.dtype))[3]
      base = max((np.asarray(base_grads[3]), rounded),
                 key=lambda b: reference.max_abs_err(b, ref[3]))
      self.check("dsinks", np.asarray(grads[3]), ref[3], base)


# One dimension of the support matrix at a time, from a small base request
# (MHA, no mask, the suite's first dtype and smallest head dim): the
# dimensions the suite's own cases do not walk. Windows, causal, segment ids
# and GQA are in every suite's cases (CPU subsets included), and
# `deterministic` has its own test; those consult the same matrix.
PROBE_BASE = Case("probe", T=13, S=21, H=2, Hk=2, d="small")
PROBES = (
    tuple(("dtype", d, {}) for d in ("bfloat16", "float16", "float32",
                                     "float64")) +
    tuple(("head_dim", d, {}) for d in (4, 16, 36)) + (
        ("softcap", None, dict(softcap=2.0)),
        ("scale_negative", None, dict(scale=-0.3)),
        ("sinks", None, dict(sinks=True)),
        ("value_head_dim", None, dict(dv=40)),
        ("value_head_dim_mla", None, dict(d=192, dv=128)),
    ))


class BackendSuite(AttentionSuite):
  """The suite plus its support-matrix probes (one such class per backend)."""

  def pytest_generate_tests(self, metafunc):
    super().pytest_generate_tests(metafunc)
    if "probe" in metafunc.fixturenames:
      # The suite's own dtypes are probed by its cases already.
      probes = [p for p in PROBES
                if not (p[0] == "dtype" and p[1] in self.dtypes)]
      metafunc.parametrize(
          "probe", probes,
          ids=[n if v is None else f"{n}_{v}" for n, v, _ in probes])

  def test_support_matrix(self, probe, rng):
    """Served: matches the reference; declared unsupported: raises."""
    name, value, changes = probe
    case = dataclasses.replace(PROBE_BASE, **changes)
    dtype = value if name == "dtype" else self.dtypes[0]
    head_dim = (value if name == "head_dim" else case.d if isinstance(
        case.d, int) else self.head_dims[0])
    with contextlib.ExitStack() as stack:
      if jnp.dtype(dtype) == jnp.float64:
        stack.enter_context(reference.enable_x64())
      if (jnp.dtype(dtype) == jnp.float32 and
          self.float32_matmul_precision is not None):
        stack.enter_context(
            jax.default_matmul_precision(self.float32_matmul_precision))
      p = self.make_problem(case, dtype, rng, head_dim=head_dim)
      self.check_problem(p, rng, with_dlse=True, case=case)
