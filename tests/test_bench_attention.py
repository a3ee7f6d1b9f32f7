"""benchmarks/bench_attention.py on a tiny shape: a value head dim of its own
(--dv), sinks, the FLOP count, the peers' fields, the results file's key and
the study presets (--preset)."""

import importlib
import json
import pathlib
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Shape of the tiny preset: B, T, S, H, D.
B, T, S, H, D = 1, 128, 128, 2, 64
DV = 32


@pytest.fixture(scope="module")
def bench(request):
  sys.path.insert(0, str(ROOT / "benchmarks"))
  request.addfinalizer(lambda: sys.path.remove(str(ROOT / "benchmarks")))
  return importlib.import_module("bench_attention")


@pytest.fixture
def no_leftover_xprof_stub():
  """The tokamax import may leave a stub xprof in sys.modules: removed."""
  before = set(sys.modules)
  yield
  for name in set(sys.modules) - before:
    if name == "xprof" or name.startswith("xprof."):
      del sys.modules[name]


def expected_tflops(r):
  """From the record's ms: forward 2 B H T S (D + D_v), halved when causal;
  bwd 2.5x, fwd_bwd 3.5x."""
  flops = 2 * B * H * T * S * (D + r["D_v"])
  flops *= 0.5 if r["causal"] else 1.0
  flops *= {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[r["mode"]]
  return flops / (r["ms"] * 1e-3) / 1e12


def test_value_head_dim_rows(bench, tmp_path):
  out = tmp_path / "results.json"
  records = bench.main([
      "--shapes", "tiny", "--dv", str(DV), "--impls",
      "jax_flash_xla,jax_flash_xla_sinks,xla", "--modes", "fwd,bwd,fwd_bwd",
      "--iters", "1", "--repeats", "1", "--warmup", "1", "--out", str(out)])
  rows = json.loads(out.read_text())
  assert len(rows) == len(records) == 3 * 3 * 2  # impls x modes x causal
  assert {(r["mode"], r["causal"]) for r in rows} == {
      (m, c) for m in ("fwd", "bwd", "fwd_bwd") for c in (False, True)}
  for r in rows:
    assert (r["B"], r["T"], r["S"], r["H"], r["H_kv"], r["D"], r["D_v"]) == (
        B, T, S, H, H, D, DV)
    assert r["sinks"] == (r["impl"] == "jax_flash_xla_sinks")
    assert r["device"] == jax.devices()[0].device_kind
    # cuDNN did not run: its field says so rather than being left out.
    assert r["cudnn_tflops"] is None and r["ratio_vs_cudnn"] is None
    assert "tokamax_tflops" not in r  # not among the impls
    if r["impl"] == "xla":
      # jax.nn takes no value head dim of its own: the refusal is recorded.
      assert r["ms"] is None and r["tflops"] is None
      assert "value" in r["error"], r["error"]
      continue
    assert "error" not in r, r
    assert r["ms"] > 0
    assert r["tflops"] == pytest.approx(expected_tflops(r), rel=1e-4)


def test_peer_failure_recorded(bench, no_leftover_xprof_stub):
  """A tokamax that cannot run (not installed, or no GPU for its Mosaic
  kernels) is a row with its error, and every row's tokamax_tflops is None;
  where it runs, the rows carry its TF/s and the ratio to it."""
  shape = bench.Shape(B, T, S, H, H, D, True, D_v=DV)
  rows = bench.run(["jax_flash_xla", "tokamax"], [shape], ["fwd"], "float32",
                   iters=1, repeats=1, warmup=1, command="test",
                   device=jax.devices()[0].device_kind)
  ours, peer = rows
  assert (ours["impl"], peer["impl"]) == ("jax_flash_xla", "tokamax")
  assert ours["tflops"] > 0
  for r in rows:
    assert r["tokamax_tflops"] == peer["tflops"]
  if jax.default_backend() != "gpu":
    assert peer["tflops"] is None and peer["error"]
    assert ours["ratio_vs_tokamax"] is None
  elif peer["tflops"]:
    assert ours["ratio_vs_tokamax"] == pytest.approx(
        ours["tflops"] / peer["tflops"], abs=1e-3)


def test_merge_key_has_value_head_dim(bench, tmp_path):
  """Rows that differ only in D_v do not replace each other; a row without
  D_v is the D_v = D row (and is replaced by it)."""
  out = tmp_path / "results.json"
  base = dict(impl="jax_flash_xla", mode="fwd", dtype="float32", B=B, T=T,
              S=S, H=H, H_kv=H, D=D, causal=False, device="cpu-test")
  old = dict(base, ms=2.0)  # a row from before D_v was recorded
  out.write_text(json.dumps([old]))
  bench.merge_into(out, [dict(base, D_v=DV, ms=1.0)])
  assert sorted(r["ms"] for r in json.loads(out.read_text())) == [1.0, 2.0]
  bench.merge_into(out, [dict(base, D_v=D, ms=3.0)])
  rows = json.loads(out.read_text())
  assert sorted((r.get("D_v"), r["ms"]) for r in rows) == [(DV, 1.0),
                                                           (D, 3.0)]


def test_presets(bench):
  _, args = bench.parse_args(["--preset", "mla"])
  assert args.impls.split(",") == ["jax_flash_cuda", "jax_flash_cuda_sinks",
                                   "cudnn", "tokamax"]
  assert args.modes.split(",") == ["fwd", "bwd", "fwd_bwd"]
  shapes = bench._selected_shapes(args)
  assert {(s.D, s.D_v, s.H) for s in shapes} == {(192, 128, 16)}
  assert {(s.B, s.T, s.causal) for s in shapes} == {
      (b, t, c) for b, t in ((2, 8192), (1, 16384)) for c in (False, True)}
  # Options on the command line win over the preset's.
  _, args = bench.parse_args(["--preset", "mla", "--modes", "fwd", "--dv",
                              "192", "--causal", "yes"])
  assert args.modes == "fwd"
  assert {(s.D_v, s.causal) for s in bench._selected_shapes(args)} == {
      (192, True)}

  _, args = bench.parse_args(["--preset", "sinks"])
  assert args.impls.split(",") == ["jax_flash_cuda", "jax_flash_cuda_sinks"]
  shapes = bench._selected_shapes(args)
  assert {(s.D, s.H, s.B * s.T) for s in shapes} == {(64, 32, 16384),
                                                     (128, 16, 16384)}
  assert {s.T for s in shapes} == {4096, 8192}
  assert all(s.D_v == s.D for s in shapes)
