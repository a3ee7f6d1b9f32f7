"""pytest setup shared by every test module.

* 8 host (CPU) devices for the sharding tests: XLA_FLAGS must be set before jax
  is imported, so this runs at conftest import time.
* tests/ on sys.path (so `from attention_suite import AttentionSuite` and
  `import reference` work from any rootdir), and the repo root when jax_flash
  is not installed.
* `gpu` marker: skipped unless jax's default backend is a GPU.
* `rng` fixture: numpy Generator seeded from the test's node id, so a failure
  reproduces exactly while every test (and every parametrisation) gets
  different inputs.
* `x64` fixture (reference.enable_x64): float64 only where a test asks.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
import zlib

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " +
                             _FLAG).strip()

_TESTS = pathlib.Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:
  sys.path.insert(0, str(_TESTS))
if importlib.util.find_spec("jax_flash") is None:  # not installed: use source
  sys.path.insert(0, str(_TESTS.parent))

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from reference import enable_x64  # noqa: E402


def pytest_configure(config):
  # Also declared in pyproject.toml; repeated so a bare checkout works.
  config.addinivalue_line("markers",
                          "gpu: needs a CUDA GPU (skipped elsewhere)")
  config.addinivalue_line("markers", "slow: long-running CPU test")


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU (jax.default_backend() is "
                          f"{jax.default_backend()!r})")
  for item in items:
    if item.get_closest_marker("gpu") is not None:
      item.add_marker(skip)


def seed_for(name: str) -> int:
  return zlib.crc32(name.encode())


@pytest.fixture
def rng(request):
  """Fresh inputs per test, reproducible from the test id."""
  return np.random.default_rng(seed_for(request.node.nodeid))


@pytest.fixture
def x64():
  with enable_x64():
    yield
