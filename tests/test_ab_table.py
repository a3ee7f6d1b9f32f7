"""tools/gpu/ab_table.py (the A/B check's table) on made-up benchmark rows."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "ab_table", ROOT / "tools" / "gpu" / "ab_table.py")
ab_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab_table)


def _attention(ours, cudnn, causal=False):
  shape = dict(mode="fwd", B=2, T=8192, S=8192, H=16, H_kv=16, D=128,
               causal=causal)
  return [dict(impl="jax_flash_cuda", tflops=ours, cudnn_tflops=cudnn,
               **shape),
          dict(impl="cudnn", tflops=cudnn, cudnn_tflops=cudnn, **shape)]


def _decode(gbps):
  return [dict(impl="jax_flash_cuda", mode="decode", case="decode_b8_paged64",
               B=8, T=1, S=32768, H=32, H_kv=8, D=128, gbps=gbps,
               cudnn_gbps=None)]


def _write(root, turns):
  for name, files in turns.items():
    d = root / name
    d.mkdir(parents=True)
    for bench, rows in files.items():
      (d / f"{bench}.json").write_text(json.dumps(rows))


def test_ratios_judged_against_cudnn(tmp_path, capsys):
  # Both clocks move together in B's turns: the raw rate is 3% up, the ratio
  # to cuDNN unchanged. The decode row has no peer: its raw B/A is judged.
  _write(tmp_path, {
      "1_A": {"attention": _attention(600, 500), "decode": _decode(4000)},
      "2_B": {"attention": _attention(618, 515), "decode": _decode(4100)},
      "3_B": {"attention": _attention(618, 515), "decode": _decode(4100)},
      "4_A": {"attention": _attention(600, 500), "decode": _decode(4000)},
  })
  out = tmp_path / "ab.json"
  assert ab_table.main([str(tmp_path), "--json", str(out)]) == 1
  rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
  assert set(rows) == {"attention B2 T8192 H16 D128 fwd cuda",
                       "decode decode_b8_paged64 cuda"}
  att = rows["attention B2 T8192 H16 D128 fwd cuda"]
  assert abs(att["b_over_a"] - 1.03) < 1e-9
  assert abs(att["b_over_a_vs_peer"] - 1.0) < 1e-9
  assert att["within"]
  dec = rows["decode decode_b8_paged64 cuda"]
  assert dec["b_over_a_vs_peer"] is None and not dec["within"]
  assert "1 of 2 rows within +-1.5%" in capsys.readouterr().out


def test_a_missing_turn_is_not_within(tmp_path):
  _write(tmp_path, {
      "1_A": {"attention": _attention(600, 500)},
      "2_B": {"attention": _attention(600, 500)},
      "3_B": {},
      "4_A": {"attention": _attention(600, 500)},
  })
  out = tmp_path / "ab.json"
  ab_table.main([str(tmp_path), "--json", str(out)])
  (row,) = json.loads(out.read_text())["rows"]
  assert row["B_turns"] == "1/2" and not row["complete"]
  assert not row["within"]
