"""One build's turn of the A/B check (tools/gpu/ab_check.sh): several
benchmarks in one process, so that JAX starts once per turn.

    python3 tools/gpu/ab_benches.py OUTDIR NAME:ARGS [NAME:ARGS ...]

NAME is one of benchmarks/bench_NAME.py (attention, packing, decode, fp8);
its main() runs with ARGS (split as a shell would) and `--out
OUTDIR/NAME.json`, so two specs of one NAME merge into one file. A benchmark
that fails is reported and the next one runs; the exit status counts the
failures.
"""

import importlib
import pathlib
import shlex
import sys
import time
import traceback

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
NAMES = ("attention", "packing", "decode", "fp8")


def parse(spec: str):
  name, _, args = spec.partition(":")
  if name not in NAMES:
    raise SystemExit(f"unknown benchmark {name!r} in {spec!r}; known: "
                     f"{', '.join(NAMES)}")
  return name, shlex.split(args)


def main(argv):
  if len(argv) < 2:
    raise SystemExit(__doc__)
  out = pathlib.Path(argv[0])
  out.mkdir(parents=True, exist_ok=True)
  specs = [parse(s) for s in argv[1:]]
  sys.path.insert(0, str(BENCHMARKS))
  failures = 0
  for name, args in specs:
    t0 = time.monotonic()
    print(f"== bench_{name}.py {shlex.join(args)}", flush=True)
    try:
      module = importlib.import_module(f"bench_{name}")
      module.main(args + ["--out", str(out / f"{name}.json")])
      status = "ok"
    except BaseException as e:  # noqa: BLE001 - SystemExit from argparse too
      if isinstance(e, KeyboardInterrupt):
        raise
      traceback.print_exc()
      failures += 1
      status = f"FAILED ({type(e).__name__}: {str(e)[:200]})"
    print(f"== bench_{name}.py {status} ({time.monotonic() - t0:.0f} s)",
          flush=True)
  return failures


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
