"""What the build backend tells the person installing jax_flash.

Pure Python and no imports beyond the standard library, so that it runs on
any interpreter (the version check has to) and the tests can import it
without scikit-build-core.
"""

from __future__ import annotations

import json
import zipfile

REQUIRED_PYTHON = (3, 12)


def python_too_old_message(version_info, executable: str) -> str | None:
  """The error for an interpreter older than REQUIRED_PYTHON, else None."""
  if tuple(version_info[:2]) >= REQUIRED_PYTHON:
    return None
  need = ".".join(map(str, REQUIRED_PYTHON))
  have = ".".join(map(str, version_info[:3]))
  return (
      f"jax_flash needs Python >= {need} (as jax >= 0.11.2 does); this pip runs "
      f"on Python {have} ({executable}).\n"
      f"Install Python {need} or newer and run pip with it, for example:\n"
      f"  uv venv --python {need} .venv && . .venv/bin/activate && "
      f"uv pip install .   (https://docs.astral.sh/uv/)\n"
      f"  pyenv install {need} && pyenv local {need}   "
      f"(https://github.com/pyenv/pyenv)\n"
      f"  sudo add-apt-repository ppa:deadsnakes/ppa && sudo apt install "
      f"python{need} python{need}-venv   (Ubuntu)\n"
      f"then create a virtualenv with that interpreter "
      f"(python{need} -m venv .venv) and install from inside it.")


def cuda_summary(wheel_path: str) -> str:
  """One line: were the CUDA kernels built into this wheel, and if not why."""
  with zipfile.ZipFile(wheel_path) as whl:
    names = whl.namelist()
    info = (json.loads(whl.read("jax_flash/_build.json"))
            if "jax_flash/_build.json" in names else {})
  if any(n.startswith("jax_flash/_jax_flash_cuda") for n in names):
    return (f"jax_flash: CUDA kernels built (sm80 family for "
            f"{info.get('cuda_architectures', '?')}, sm90 family: "
            f"{'yes' if info.get('sm90') else 'no'}; "
            f"{info.get('cuda_compiler', 'nvcc')})")
  why = info.get("reason") or "no record of the CMake configure step"
  return (f"jax_flash: CUDA kernels NOT built ({why}); pure-Python package: "
          f"backends 'pallas' and 'xla'")
