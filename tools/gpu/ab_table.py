"""The A/B table of tools/gpu/ab_check.sh: build A (reference) against build B
(candidate), from the benchmark rows of each turn.

    python3 tools/gpu/ab_table.py DIR [--tol PERCENT] [--json FILE]

DIR holds one folder per turn, named N_A or N_B (N the turn's place in the
order), each with the JSON lists of the benchmarks (attention.json,
packing.json, decode.json, fp8.json). Compared are jax_flash's rows (impl
jax_flash*): per build the median over its turns of the rate (TF/s, or GB/s
for decoding). Where a row carries cuDNN's rate from the same process
(cudnn_tflops, cudnn_gbps), the figure compared is the ratio to cuDNN, which
cancels the clock and power state of that process; the raw B/A is shown
beside it. A row is "yes" when the compared B/A is within +-PERCENT (1.5) and
every turn of both builds measured it. Prints one line per row, then a count;
--json writes the rows.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys

PEERS = ("cudnn_tflops", "cudnn_gbps")
TURN = re.compile(r"^(\d+)_([AB])$")


def rate(r):
  for key in ("tflops", "gbps"):
    if r.get(key) is not None:
      return float(r[key])
  return None


def peer(r):
  for key in PEERS:
    if r.get(key):
      return float(r[key])
  return None


def case_of(bench: str, r) -> str:
  """A short name of the row: benchmark, shape or named case, mode, impl."""
  if r.get("case"):
    shape = r["case"]
  else:
    shape = (f"B{r['B']} T{r['T']} H{r['H']} D{r['D']}"
             f"{' causal' if r.get('causal') else ''}")
  impl = r["impl"].removeprefix("jax_flash_")
  mode = "" if r.get("mode") in (None, "decode") else f" {r['mode']}"
  return f"{bench} {shape}{mode} {impl}"


def load(root: pathlib.Path):
  """{case: {"A": [(rate, peer) or None per turn], "B": [...]}}, turns."""
  turns = {"A": [], "B": []}
  for d in sorted(root.iterdir()):
    m = TURN.match(d.name)
    if d.is_dir() and m:
      turns[m.group(2)].append(d)
  cases: dict[str, dict[str, list]] = {}
  for build, dirs in turns.items():
    for i, d in enumerate(dirs):
      for f in sorted(d.glob("*.json")):
        try:
          rows = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
          print(f"warning: {f}: {e}", file=sys.stderr)
          continue
        for r in rows:
          if not str(r.get("impl", "")).startswith("jax_flash"):
            continue
          by = cases.setdefault(case_of(f.stem, r),
                                {"A": [None] * len(turns["A"]),
                                 "B": [None] * len(turns["B"])})
          x = rate(r)
          by[build][i] = None if x is None else (x, peer(r))
  return cases, {b: len(v) for b, v in turns.items()}


def compare(by, tol: float):
  """One table row: medians, B/A raw and against the peer, verdict."""
  row = {}
  for build in "AB":
    got = [x for x in by[build] if x is not None]
    row[build] = statistics.median(x[0] for x in got) if got else None
    with_peer = [x[0] / x[1] for x in got if x[1]]
    row[build + "_vs_peer"] = (statistics.median(with_peer)
                               if got and len(with_peer) == len(got) else None)
    row[build + "_turns"] = f"{len(got)}/{len(by[build])}"
  row["b_over_a"] = (row["B"] / row["A"] if row["A"] and row["B"] is not None
                     else None)
  row["b_over_a_vs_peer"] = (row["B_vs_peer"] / row["A_vs_peer"]
                             if row["A_vs_peer"] and row["B_vs_peer"]
                             else None)
  judged = (row["b_over_a_vs_peer"] if row["b_over_a_vs_peer"] is not None
            else row["b_over_a"])
  row["complete"] = all(x is not None for x in by["A"] + by["B"])
  row["within"] = bool(judged is not None and row["complete"]
                       and abs(judged - 1) <= tol)
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("dir", type=pathlib.Path)
  p.add_argument("--tol", type=float, default=1.5, help="percent")
  p.add_argument("--json", type=pathlib.Path)
  a = p.parse_args(argv)
  if not a.dir.is_dir():
    raise SystemExit(f"{a.dir}: no such directory")
  cases, turns = load(a.dir)
  tol = a.tol / 100
  rows = [dict(case=c, **compare(by, tol)) for c, by in sorted(cases.items())]
  def fmt(x, width, digits):
    return format(x, f"{width}.{digits}f") if x is not None else "-".rjust(width)

  width = max([len(r["case"]) for r in rows] + [4])
  print(f"A/B: {turns['A']} turns of A, {turns['B']} of B; medians of TF/s "
        f"(decode: GB/s); 'vs cuDNN': B/A of the ratios to cuDNN in the same "
        f"process, judged where present")
  print(f"{'case':{width}s} {'A':>8s} {'B':>8s} {'B/A':>6s} "
        f"{'vs cuDNN':>8s} {'within ' + format(a.tol, 'g') + '%':>11s}")
  for r in rows:
    verdict = "yes" if r["within"] else "no"
    if not r["complete"]:
      verdict += f" (turns measured: A {r['A_turns']}, B {r['B_turns']})"
    print(f"{r['case']:{width}s} {fmt(r['A'], 8, 1)} {fmt(r['B'], 8, 1)} "
          f"{fmt(r['b_over_a'], 6, 3)} {fmt(r['b_over_a_vs_peer'], 8, 3)} "
          f"{verdict:>11s}")
  n_yes = sum(r["within"] for r in rows)
  print(f"{n_yes} of {len(rows)} rows within +-{a.tol:g}%")
  if a.json:
    a.json.write_text(json.dumps(dict(tolerance_percent=a.tol, turns=turns,
                                      rows=rows), indent=1) + "\n")
  return 0 if rows and n_yes == len(rows) else 1


if __name__ == "__main__":
  sys.exit(main())
