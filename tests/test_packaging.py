"""What a user sees of the packaging: license, typing marker, metadata, the
too-old-Python message, what was built, which implementations can run here,
and the public name of `Unsupported`.

The metadata tests read the installed distribution (`.ci/run` installs it);
from a source tree that was never installed they skip, saying so.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
import pathlib
import subprocess
import sys
import traceback
import zipfile

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash._src.backends import registry as backends

ROOT = pathlib.Path(__file__).resolve().parents[1]
BACKEND_DIR = ROOT / "build_backend"


def _distribution():
  try:
    return importlib.metadata.distribution("jax_flash")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("jax_flash is not installed (tests import the source tree)")


# --------------------------------------------------------------- files


def test_license_is_the_full_apache_text():
  text = (ROOT / "LICENSE").read_text()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text
  assert len(text.splitlines()) > 150  # the full text, not a pointer to it


def test_py_typed_ships_with_the_package():
  assert importlib.resources.files("jax_flash").joinpath("py.typed").is_file()


def test_installed_metadata():
  dist = _distribution()
  meta = dist.metadata
  assert meta["License"] == "Apache-2.0"
  assert meta["Requires-Python"] == ">=3.12"
  classifiers = meta.get_all("Classifier")
  assert "Typing :: Typed" in classifiers
  assert "License :: OSI Approved :: Apache Software License" in classifiers
  urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
  assert {"Repository", "Issues", "Changelog"} <= set(urls)
  files = {str(f) for f in dist.files}
  assert any(f.endswith("LICENSE") and ".dist-info" in f for f in files), files
  assert "jax_flash/py.typed" in files


# --------------------------------------------------------------- build backend


@pytest.fixture
def checks(monkeypatch):
  monkeypatch.syspath_prepend(str(BACKEND_DIR))
  import jax_flash_build_checks
  return jax_flash_build_checks


def test_old_python_message(checks):
  msg = checks.python_too_old_message((3, 11, 7, "final", 0), "/usr/bin/python3")
  assert "needs Python >= 3.12" in msg and "3.11.7" in msg
  assert "/usr/bin/python3" in msg
  for way in ("uv venv --python 3.12", "pyenv install 3.12", "deadsnakes"):
    assert way in msg
  assert checks.python_too_old_message((3, 12, 0), "x") is None
  assert checks.python_too_old_message((3, 13, 1), "x") is None


def test_backend_refuses_old_python_before_importing_scikit_build_core():
  """The backend module itself exits with the message on Python 3.11 (faked
  here), before it imports scikit-build-core or asks for jax."""
  code = (
      "import sys\n"
      f"sys.path.insert(0, {str(BACKEND_DIR)!r})\n"
      "sys.version_info = (3, 11, 7, 'final', 0)\n"
      "sys.modules['scikit_build_core'] = None  # importing it would fail\n"
      "import jax_flash_build_backend\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 1
  assert "error: jax_flash needs Python >= 3.12" in r.stderr
  assert "Traceback" not in r.stderr


def test_pyproject_asks_for_jax_only_through_the_backend():
  import tomllib
  build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
  assert build["build-backend"] == "jax_flash_build_backend"
  assert build["backend-path"] == ["build_backend"]
  assert not any(r.startswith("jax") for r in build["requires"])


def _wheel(path, files):
  with zipfile.ZipFile(path, "w") as z:
    for name, data in files.items():
      z.writestr(name, data)
  return str(path)


def test_build_summary_says_why_cuda_is_missing(checks, tmp_path):
  record = dict(cuda_kernels=False, cuda_compiler=None,
                cuda_architectures=None, sm90=False,
                reason="no CUDA compiler found at build time")
  pure = _wheel(tmp_path / "pure.whl",
                {"jax_flash/__init__.py": "",
                 "jax_flash/_build.json": json.dumps(record)})
  line = checks.cuda_summary(pure)
  assert "NOT built" in line and "no CUDA compiler found" in line

  record.update(cuda_kernels=True, cuda_compiler="/usr/bin/nvcc",
                cuda_architectures="80;90", sm90=True, reason=None)
  built = _wheel(tmp_path / "cuda.whl",
                 {"jax_flash/_jax_flash_cuda.cpython-312-x86_64-linux-gnu.so":
                  "", "jax_flash/_build.json": json.dumps(record)})
  line = checks.cuda_summary(built)
  assert "CUDA kernels built" in line and "80;90" in line
  assert "sm90 family: yes" in line


def test_cmake_records_the_cuda_decision():
  """CMakeLists.txt writes jax_flash/_build.json on both branches, with the
  keys build_info() reads (a cmake run is the real check: .ci/run's install
  and test_build_info_matches_the_installation)."""
  text = (ROOT / "CMakeLists.txt").read_text()
  assert text.count('string(CONCAT _json') == 2
  for key in ("cuda_kernels", "cuda_compiler", "cuda_architectures", "sm90",
              "reason"):
    assert text.count(f'\\"{key}\\"') == 2, key
  assert "install(FILES" in text and "DESTINATION jax_flash" in text


# --------------------------------------------------------------- runtime


def test_build_info_matches_the_installation():
  info = jax_flash.build_info()
  assert info["implementations"] == jax_flash.available_implementations()
  loaded = info["cuda_extension"] == "loaded"
  if info["cuda_kernels"] is None:  # source tree, never built
    assert "source tree" in info["reason"]
  elif info["cuda_kernels"]:
    assert info["reason"] is None and info["cuda_architectures"]
  else:
    assert info["reason"] and not loaded
  if _installed():
    assert info["cuda_kernels"] is not None, "the wheel has no _build.json"


def _installed():
  try:
    importlib.metadata.distribution("jax_flash")
    return True
  except importlib.metadata.PackageNotFoundError:
    return False


def test_available_implementations_lists_what_runs_here():
  here = jax_flash.available_implementations()
  assert "xla" in here
  assert set(here) <= set(backends.names())
  for name in backends.names():
    assert (name in here) == (name in backends.runnable(
        backends.default_platform()))
  if jax.default_backend() != "gpu":
    assert "cuda" not in here
    assert "cuda" in backends.runnable("gpu") or not _cuda_loaded()
  assert "pallas" not in backends.runnable("tpu")


def _cuda_loaded():
  from jax_flash._src.backends import ffi
  return ffi.available()


def test_available_implementations_leaves_out_backends_that_refuse(
    monkeypatch):
  class Refuses:
    name = "refuses"

    def check(self, spec, platform):
      raise backends.Unsupported("never")

  class Serves:
    name = "serves"

    def check(self, spec, platform):
      if spec.dtype != "float32":
        raise backends.Unsupported("float32 only")

  monkeypatch.setitem(backends._REGISTRY, "refuses", Refuses)
  monkeypatch.setitem(backends._REGISTRY, "serves", Serves)
  here = jax_flash.available_implementations()
  assert "serves" in here and "refuses" not in here


def test_unsupported_has_its_public_name():
  assert jax_flash.Unsupported.__module__ == "jax_flash"
  assert jax_flash.Unsupported is backends.Unsupported
  if jax.default_backend() == "gpu" and _cuda_loaded():
    pytest.skip("cuda runs here; the refusal below needs a non-GPU platform")
  q = jnp.ones((1, 4, 1, 8), jnp.float32) * jnp.arange(8) / 8
  with pytest.raises(jax_flash.Unsupported) as info:
    jax_flash.attention(q, q, q, implementation="cuda")
  line = traceback.format_exception_only(info.value)[0]
  assert line.startswith("jax_flash.Unsupported: "), line


def test_ci_runs_the_readmes_test_command():
  """.ci/run runs the README's test command (the second block of the README's
  opening) verbatim, with only CI's extra arguments appended."""
  import re
  readme = (ROOT / "README.md").read_text()
  blocks = re.findall(r"^```bash\n(.*?)^```", readme, re.S | re.M)
  command = blocks[1].strip()
  assert "PYTHONSAFEPATH=1" in command and "pytest" in command
  ci = (ROOT / ".ci" / "run").read_text()
  assert f'\n{command} "$@"\n' in ci
