"""jax_flash's build backend: scikit-build-core behind a Python version check.

pip installs a project's static build requirements before it reads the
project's `requires-python`, so with `jax` among them an interpreter that jax
does not support fails with "No matching distribution found for jax" and never
learns why. Here the static requirements (pyproject.toml) are only
scikit-build-core and nanobind, which install on older Pythons; this module
then refuses an interpreter older than 3.12 with a message that says what to
do, and only after that asks for jax (the CUDA build reads the XLA FFI headers
from `jax.ffi.include_dir()`).

After building a wheel it prints whether the CUDA kernels are in it and, if
not, why (from the `jax_flash/_build.json` that CMakeLists.txt writes). pip
shows a build's output only with `-v`; `jax_flash.build_info()` says the same
after installation.
"""

from __future__ import annotations

import sys

from jax_flash_build_checks import cuda_summary, python_too_old_message

_message = python_too_old_message(sys.version_info, sys.executable)
if _message is not None:
  raise SystemExit("error: " + _message)

from scikit_build_core import build as _skbuild  # noqa: E402
from scikit_build_core.build import *  # noqa: E402,F401,F403

JAX_REQUIREMENT = "jax>=0.11.2"


def get_requires_for_build_wheel(config_settings=None):
  return [*_skbuild.get_requires_for_build_wheel(config_settings),
          JAX_REQUIREMENT]


def get_requires_for_build_editable(config_settings=None):
  return [*_skbuild.get_requires_for_build_editable(config_settings),
          JAX_REQUIREMENT]


def build_wheel(wheel_directory, config_settings=None,
                metadata_directory=None):
  name = _skbuild.build_wheel(wheel_directory, config_settings,
                              metadata_directory)
  try:
    summary = cuda_summary(f"{wheel_directory}/{name}")
  except (OSError, ValueError, KeyError) as e:  # a report must not fail a build
    summary = f"jax_flash: could not read the build record ({e})"
  print(summary, file=sys.stderr, flush=True)
  return name
