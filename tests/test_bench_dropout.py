"""benchmarks/bench_dropout.py --quick: its rows, their fields and the merge
into --out (off a GPU the xla backend stands in for the CUDA kernels and
the cuDNN implementations are left out)."""

import importlib.util
import json
import pathlib
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

FIELDS = ("impl", "dropout_rate", "mode", "causal", "D", "T", "B", "H",
          "tflops", "cudnn_tflops", "no_dropout_tflops", "ms", "device",
          "date", "speedup_vs_cudnn", "dropout_cost")


@pytest.fixture(scope="module")
def bench(request):
  sys.path.insert(0, str(ROOT / "benchmarks"))
  request.addfinalizer(lambda: sys.path.remove(str(ROOT / "benchmarks")))
  spec = importlib.util.spec_from_file_location(
      "bench_dropout", ROOT / "benchmarks" / "bench_dropout.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_quick_rows(bench, tmp_path, capsys):
  out = tmp_path / "dropout.json"
  args = ["--quick", "--out", str(out), "--dims", "64", "--rate", "0.25",
          "--impls", "jax_flash_cuda,jax_flash_cuda_no_dropout,"
          "cudnn_dropout,jax_flash_xla"]
  records = bench.main(args)
  rows = json.loads(out.read_text())
  assert len(rows) == len(records)
  on_gpu = jax.default_backend() == "gpu"
  impls = {"jax_flash_cuda", "jax_flash_cuda_no_dropout", "jax_flash_xla"}
  if on_gpu:
    impls.add("cudnn_dropout")
  assert {r["impl"] for r in rows} == impls
  # D=64, T=128, causal and not, fwd and fwd_bwd: one row per impl each.
  assert len(rows) == 4 * len(impls)
  assert {(r["mode"], r["causal"]) for r in rows} == {
      (m, c) for m in ("fwd", "fwd_bwd") for c in (False, True)}
  for r in rows:
    missing = [f for f in FIELDS if f not in r]
    assert not missing, (r["impl"], missing)
    assert (r["D"], r["T"], r["S"], r["B"], r["H"]) == (64, 128, 128, 1, 2)
    assert r["case"] == "dropout_rate=0.25"
    assert r["device"] == jax.devices()[0].device_kind
    want_rate = 0.0 if r["impl"] == "jax_flash_cuda_no_dropout" else 0.25
    assert r["dropout_rate"] == want_rate
    if not on_gpu:
      assert "error" not in r, r
      assert r["stand_in"] == r["impl"].startswith("jax_flash_cuda")
      assert r["implementation"] == "xla"
      assert r["cudnn_tflops"] is None and r["speedup_vs_cudnn"] is None
    if r.get("error"):
      continue
    assert r["tflops"] > 0 and r["ms"] > 0
    # tflops from ms and the FLOP count: 4 B H T S D, halved when causal,
    # x3.5 with the backward
    flops = 4 * 1 * 2 * 128 * 128 * 64 * (0.5 if r["causal"] else 1) * (
        3.5 if r["mode"] == "fwd_bwd" else 1)
    assert abs(r["tflops"] - flops / (r["ms"] * 1e-3) / 1e12) <= (
        1e-4 * r["tflops"])
  # Peers from the same (shape, mode): every row of a group carries the
  # no-dropout figure; dropout_cost only where the row has a counterpart.
  groups = {}
  for r in rows:
    groups.setdefault((r["mode"], r["causal"]), {})[r["impl"]] = r
  for g in groups.values():
    ours, base = g["jax_flash_cuda"], g["jax_flash_cuda_no_dropout"]
    if ours.get("error") or base.get("error"):
      continue
    for r in g.values():
      assert r["no_dropout_tflops"] == base["tflops"]
    assert ours["dropout_cost"] == pytest.approx(
        1 - ours["tflops"] / base["tflops"], abs=1e-4)
    assert g["jax_flash_xla"]["dropout_cost"] is None
    assert base["dropout_cost"] is None
    if "cudnn_dropout" in g and g["cudnn_dropout"].get("tflops"):
      assert ours["speedup_vs_cudnn"] == pytest.approx(
          ours["tflops"] / g["cudnn_dropout"]["tflops"], abs=1e-3)
  # In fwd mode dropout moved the outputs (~sqrt(r / (1 - r)) = 0.58 here).
  for (mode, _), g in groups.items():
    if mode == "fwd" and not g["jax_flash_cuda"].get("error"):
      assert 0.3 < g["jax_flash_cuda"]["rel_diff_vs_no_dropout"] < 1.0
      assert "rel_diff_vs_no_dropout" not in g["jax_flash_cuda_no_dropout"]
  printed = capsys.readouterr().out
  assert "ours/cuDNN" in printed.split("TFLOP/s (")[-1]  # the table, last
  # A second run at another rate adds its rows; the same rate replaces.
  bench.main(args[:6] + ["0.5"] + args[7:])
  assert len(json.loads(out.read_text())) == 2 * len(rows)
  bench.main(args)
  assert len(json.loads(out.read_text())) == 2 * len(rows)


def test_refuses_another_devices_file(bench, tmp_path):
  out = tmp_path / "h200_dropout.json"
  out.write_text(json.dumps([{"impl": "jax_flash_cuda", "device": "NVIDIA "
                              "H200-not-this-one"}]))
  with pytest.raises(SystemExit):
    bench.main(["--quick", "--out", str(out), "--dims", "64"])
  assert len(json.loads(out.read_text())) == 1


def test_a_failing_implementation_is_recorded(bench, tmp_path, monkeypatch):
  """A set-up that raises: its rows carry the error, the others are timed."""
  def broken(impl, rate, platform):
    if impl == "jax_flash_cuda":
      raise RuntimeError("no kernel today")
    return real(impl, rate, platform)
  real = bench.build_fn
  monkeypatch.setattr(bench, "build_fn", broken)
  out = tmp_path / "dropout.json"
  bench.main(["--quick", "--out", str(out), "--dims", "64", "--causal", "no",
              "--modes", "fwd", "--impls",
              "jax_flash_cuda,jax_flash_cuda_no_dropout"])
  rows = {r["impl"]: r for r in json.loads(out.read_text())}
  assert rows["jax_flash_cuda"]["error"] == "RuntimeError: no kernel today"
  assert rows["jax_flash_cuda"]["tflops"] is None
  assert rows["jax_flash_cuda"]["dropout_cost"] is None
  assert rows["jax_flash_cuda_no_dropout"]["tflops"] > 0
