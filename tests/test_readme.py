"""Every ```python block of README.md runs as written.

Each block runs alone, in a fresh namespace, as a user would paste it. A block
whose first line is a `# requires: ...` comment is skipped only when this
machine lacks that:
  # requires: gpu           jax's default backend is a GPU
  # requires: N devices     jax sees at least N devices (the tests' conftest
                            gives the CPU 8)
Any other `# requires:` is an error, so a typo cannot skip a block silently.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import jax
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_REQUIRES = re.compile(r"#\s*requires:\s*(.+)")


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(line number, code) of each ```python block."""
  return [(text.count("\n", 0, m.start()) + 2, m.group(1))
          for m in _BLOCK.finditer(text)]


def missing_requirement(code: str) -> str | None:
  """Why this machine cannot run the block, or None."""
  first = code.lstrip().splitlines()[0] if code.strip() else ""
  m = _REQUIRES.fullmatch(first.strip())
  if m is None:
    return None
  need = m.group(1).strip()
  if need == "gpu":
    return None if jax.default_backend() == "gpu" else "needs a GPU"
  n = re.fullmatch(r"(\d+) devices", need)
  if n:
    have = jax.device_count()
    return None if have >= int(n.group(1)) else f"needs {need}, has {have}"
  raise ValueError(f"unknown README requirement {need!r}")


BLOCKS = python_blocks(README.read_text())


def test_readme_has_python_blocks():
  assert len(BLOCKS) >= 5


@pytest.mark.parametrize("line,code", BLOCKS,
                         ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code):
  why = missing_requirement(code)
  if why:
    pytest.skip(f"README.md:{line}: {why}")
  with contextlib.redirect_stdout(io.StringIO()):
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})


def test_requirement_comments():
  assert missing_requirement("x = 1\n") is None
  assert missing_requirement("# requires: 1 devices\nx = 1\n") is None
  assert "needs" in (missing_requirement("# requires: 100000 devices\n") or "")
  with pytest.raises(ValueError, match="unknown README requirement"):
    missing_requirement("# requires: a tpu\n")
