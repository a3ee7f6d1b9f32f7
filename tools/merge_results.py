"""Merge benchmark records fetched from the GPU machine into the repo's results.

    python tools/merge_results.py FETCHED.json [benchmarks/results/h200.json]

Records with the same key (impl, mode, dtype, shape, causal) are replaced.
"""
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_attention  # noqa: E402

src = pathlib.Path(sys.argv[1])
dst = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else bench_attention.DEFAULT_OUT
records = json.loads(src.read_text())
bench_attention.merge_into(dst, records)
print(f"merged {len(records)} records into {dst}")
