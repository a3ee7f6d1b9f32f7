"""The serving benchmarks' results rows on the CPU: examples/generate.py
--out (generation against Flax)."""

import importlib.util
import json
import pathlib
import sys

import jax
import pytest


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
