"""Merge new benchmark records (e.g. a GPU script's $OUT/h200.json) into a results file.

    python benchmarks/merge_results.py NEW.json benchmarks/results/h200.json

Records with the same key (impl, mode, dtype, shape, causal) are replaced;
records of another device than the destination's are refused.
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention  # noqa: E402

if len(sys.argv) != 3:
  raise SystemExit(__doc__)
src, dst = map(pathlib.Path, sys.argv[1:])
records = json.loads(src.read_text())
try:
  bench_attention.merge_into(dst, records)
except bench_attention.OtherDeviceError as e:
  raise SystemExit(f"error: {e}")
print(f"merged {len(records)} records into {dst}")
