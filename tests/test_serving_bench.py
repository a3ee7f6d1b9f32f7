"""The serving benchmarks' results rows on the CPU: examples/generate.py
--out (generation against Flax) and benchmarks/bench_decode.py
--prefill-sweep (the decoding kernels against the dense path over T_new,
the kernels replaced by their contract, decode_contract.py)."""

import importlib
import importlib.util
import json
import pathlib
import sys

import jax
import pytest

from decode_contract import use_contract
from jax_flash._src.decode import cuda as decode_cuda

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEVICE = jax.devices()[0].device_kind


@pytest.fixture
def generate(monkeypatch):
  # Where the example finds bench_attention (restored after the test).
  monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
  path = ROOT / "examples" / "generate.py"
  spec = importlib.util.spec_from_file_location("example_generate", path)
  mod = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(sys.modules, "example_generate", mod)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture
def bench_decode(monkeypatch):
  monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
  return importlib.import_module("bench_decode")


def test_generate_out_rows(generate, tmp_path):
  """--small --out: one row per decoder, merged with the file's rows of this
  device (an older row of the same key replaced, others kept); the figures
  agree with the times they come from, and the Flax figures of the run are
  on every row."""
  small = generate.CONFIGS["small"]
  B, P, N = small["batch"], small["prompt"], small["new"]
  case = (f"generate_b{B}_p{P}_n{N}_l{small['layers']}_d{small['d_model']}"
          f"_v{small['vocab']}")
  head_dim = small["d_model"] // small["heads"]
  key = dict(mode="generate", case=case, dtype=small["dtype"], B=B, T=P,
             S=P + N, H=small["heads"], H_kv=small["heads"], D=head_dim,
             D_v=head_dim, causal=True)
  other = dict(key, impl="flax", case="other", device=DEVICE, us=1.0)
  stale = dict(key, impl="flax", device=DEVICE, end_to_end_ms=-1.0)
  out = tmp_path / "results.json"
  out.write_text(json.dumps([other, stale]))
  assert generate.main(["--small", "--repeats", "1", "--implementation",
                        "xla", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())
  assert other in rows and stale not in rows
  rows = {r["impl"]: r for r in rows if r["case"] == case}
  assert set(rows) == {"jax_flash_xla", "flax"}
  flax = rows["flax"]
  for impl, r in rows.items():
    assert {k: r[k] for k in key} == key
    assert (r["prompt"], r["new"], r["layers"], r["d_model"], r["vocab"]) == (
        P, N, small["layers"], small["d_model"], small["vocab"])
    assert r["implementation"] == ("xla" if impl == "jax_flash_xla" else None)
    assert r["device"] == DEVICE and r["date"]
    assert "--out" in r["command"] and "--small" in r["command"]
    assert r["check_ok"] is True and r["greedy_match"] == 1.0
    assert 0 <= r["logits_max_rel_err"] <= generate.LOGITS_RTOL
    assert min(r["prefill_ms"], r["decode_ms"]) > 0
    # 5 significant digits are kept: the figures follow from the times.
    assert r["prefill_tokens_per_s"] == pytest.approx(
        B * P / (r["prefill_ms"] * 1e-3), rel=1e-3)
    assert r["tokens_per_s"] == pytest.approx(
        B * (N - 1) / (r["decode_ms"] * 1e-3), rel=1e-3)
    # One repeat: end to end is its prefill plus its decode.
    assert r["end_to_end_ms"] == pytest.approx(
        r["prefill_ms"] + r["decode_ms"], rel=1e-3)
    for field in ("tokens_per_s", "prefill_tokens_per_s", "end_to_end_ms"):
      assert r[f"flax_{field}"] == flax[field]


def test_generate_out_refuses_other_device(generate, tmp_path):
  """A results file of another device is refused before anything runs, and
  left as it was."""
  out = tmp_path / "h200.json"
  text = json.dumps([dict(impl="flax", mode="generate", device="NVIDIA H200")])
  out.write_text(text)
  with pytest.raises(SystemExit) as e:
    generate.main(["--small", "--out", str(out)])
  assert e.value.code == 2
  assert out.read_text() == text


def test_prefill_sweep_rows(bench_decode, tmp_path, monkeypatch, capsys):
  """Both routes at every T_new, each forced: the decoding kernels (here
  their contract) even past PREFILL_MIN_TOKENS, the dense path even at one
  token; the threshold itself is left as it was."""
  calls = use_contract(monkeypatch)
  threshold = decode_cuda.PREFILL_MIN_TOKENS
  t_news = [1, 3, threshold + 5]
  out = tmp_path / "results.json"
  records = bench_decode.main([
      "--prefill-sweep", "--prefill-shapes", "2x200", "--t-new",
      ",".join(map(str, t_news)), "--iters", "1", "--repeats", "1",
      "--warmup", "1", "--out", str(out)])
  assert decode_cuda.PREFILL_MIN_TOKENS == threshold
  assert len(calls) == len(t_news)  # one trace per T_new on the kernels
  rows = json.loads(out.read_text())
  assert sorted(map(json.dumps, rows)) == sorted(map(json.dumps, records))
  assert {(r["T_new"], r["route"]) for r in rows} == {
      (t, route) for t in t_news for route in ("decode_kernels", "dense")}
  for r in rows:
    assert r["case"] == (f"prefill_route_b2_s200_t{r['T_new']}_"
                         f"{r['route']}")
    assert (r["mode"], r["B"], r["S"], r["T"], r["H"], r["H_kv"], r["D"],
            r["dtype"], r["causal"]) == (
                "prefill_route", 2, 200, r["T_new"], 32, 8, 128, "bfloat16",
                True)
    assert "error" not in r and r["us"] > 0
    assert r["us"] == r[f"{r['route']}_us"]
    both = {"decode_kernels": r["decode_kernels_us"], "dense": r["dense_us"]}
    assert r["faster"] == min(both, key=both.get)
    assert r["prefill_min_tokens"] == threshold and r["device"] == DEVICE
  assert "PREFILL_MIN_TOKENS from this sweep" in capsys.readouterr().out


@pytest.mark.parametrize("dense_wins_at, want", [
    ({}, 512), ({(0, 64)}, 32), ({(1, 8)}, 4), ({(0, 1)}, 0),
    ({(0, 256), (1, 16)}, 8)], ids=["never", "64", "8-one-shape", "1",
                                    "two-crossings"])
def test_suggested_prefill_threshold(bench_decode, dense_wins_at, want):
  """The largest T_new up to which the kernels win at every shape (ties go
  to the kernels); the first loss at any shape ends it."""
  rows = []
  for shape in (0, 1):
    for T in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
      dense = 10.0 * T
      kernels = dense + (1.0 if (shape, T) in dense_wins_at else 0.0)
      rows.append(dict(T_new=T, decode_kernels_us=kernels, dense_us=dense))
  assert bench_decode.suggested_prefill_threshold(rows) == want


def test_fp8_cache_accuracy_rows(monkeypatch, tmp_path):
  """benchmarks/fp8_cache_accuracy.py on the CPU (xla path): its rows, the
  bf16 cache near bf16 rounding, the FP8 cache's error in e4m3's range on
  normal data, and NaN / Inf in unread slots never reaching an output (the
  script raises then)."""
  monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
  acc = importlib.import_module("fp8_cache_accuracy")
  out = tmp_path / "rows.json"
  acc.main(["--dists", "normal,outlier_channels", "--fills", "300",
            "--t-new", "1,3", "--implementation", "xla", "--out", str(out)])
  rows = json.loads(out.read_text())
  assert len(rows) == 2 * 2 * 3
  by = {(r["case"], r["cache"]): r for r in rows}
  for t in (1, 3):
    bf16 = by[(f"fp8_cache_accuracy_normal_s300_t{t}", "bf16")]["rel_rms"]
    fp8 = by[(f"fp8_cache_accuracy_normal_s300_t{t}", "fp8")]["rel_rms"]
    assert bf16 < 6e-3, bf16  # bf16 rounding of P and O
    assert 1e-2 < fp8 < 8e-2, fp8  # e4m3: 3 mantissa bits
  assert all(r["device"] == DEVICE and r["impl"] == "jax_flash_xla"
             for r in rows)
