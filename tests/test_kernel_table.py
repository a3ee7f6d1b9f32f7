"""The kernel table (jax_flash/_src/backends/kernel_table.py) and what is generated
from it: the committed instantiation files, sources.cmake and kernel_table.h
must be exactly what tools/codegen/gen_instantiations.py writes, so that the
build, the dispatchers and the Python backend agree on which kernels exist."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from jax_flash._src.backends import cuda as cuda_backend, kernel_table

ROOT = pathlib.Path(__file__).resolve().parents[1]
GENERATOR = ROOT / "tools" / "codegen" / "gen_instantiations.py"


@pytest.fixture(scope="module")
def gen():
  spec = importlib.util.spec_from_file_location("gen_instantiations", GENERATOR)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_generated_files_match_the_table(gen, tmp_path):
  written = gen.write(tmp_path)
  stale = []
  for rel in written:
    committed = ROOT / rel
    if not committed.is_file() or committed.read_text() != (tmp_path / rel).read_text():
      stale.append(str(rel))
  assert not stale, (f"generated files differ from the kernel table: {stale}; run "
                     "python tools/codegen/gen_instantiations.py")
  instantiations = ROOT / gen.INSTANTIATIONS
  extra = sorted(p.name for p in instantiations.glob("*.cu")
                 if p.relative_to(ROOT) not in written)
  assert not extra, f"instantiation files not in the kernel table: {extra}"


def test_every_family_and_its_buckets(gen):
  assert set(kernel_table.HEAD_DIMS) == {l.family for l in gen.LAUNCHERS} == set(gen.MACROS)
  for family, dims in kernel_table.HEAD_DIMS.items():
    assert list(dims) == sorted(set(dims)) and dims[0] > 0, family
    assert all(d % 8 == 0 for d in dims), family  # 16-byte rows


def test_bucket_is_the_smallest_at_least_d():
  for family, dims in kernel_table.HEAD_DIMS.items():
    for d in range(1, dims[-1] + 1):
      b = kernel_table.bucket(family, d)
      assert b in dims and b >= d and not any(d <= x < b for x in dims), (family, d)
    assert kernel_table.bucket(family, dims[-1] + 1) == 0


def test_cuda_backend_rounds_with_the_table():
  assert cuda_backend.MAX_HEAD_DIM == kernel_table.HEAD_DIMS["sm80"][-1]
  for d in range(1, cuda_backend.MAX_HEAD_DIM + 1):
    assert cuda_backend.rounded_head_dim(d) == kernel_table.bucket("sm80", d)


def test_head_dim_pairs(gen):
  """Each pair: two distinct head dims of whole 16-byte rows, within the
  family's largest bucket, the value one not wider (the forward's output
  tile takes Q's shared memory), kernels for it in every launcher of its
  family and dtype, and the sm80 kernels for it too (they serve what the
  sm90 families do not: the Python backend checks the sm80 pairs)."""
  for family, pairs in kernel_table.HEAD_DIM_PAIRS.items():
    assert list(pairs) == sorted(set(pairs)), family
    for d, dv in pairs:
      assert d != dv and d % 8 == 0 and dv % 8 == 0, (family, d, dv)
      assert dv <= d <= kernel_table.max_head_dim(family), (family, d, dv)
      assert kernel_table.serves_pair(family, d, dv)
      assert not kernel_table.serves_pair(family, dv, d)
      assert kernel_table.serves_pair("sm80", d, dv), (family, d, dv)
      assert cuda_backend.dq_accum_pitch(d, dv) == d
      launchers = [l for l in gen.LAUNCHERS if l.family == family]
      assert launchers, family
      for launcher in launchers:
        for dtype in kernel_table.DTYPES:
          f = ROOT / gen.INSTANTIATIONS / launcher.file_name.format(dtype=dtype, hdim=f"{d}v{dv}")
          assert f.is_file() and f"{d}, {dv}>" in f.read_text(), f
