"""What a decoding step of a real generation loop compiles to, on the CPU:
examples/generate.py's decode (a lax.scan of greedy steps over a
jax_flash.flax.SelfAttention(decode=True) model, the cache donated).

On the kernel path (the decoding kernels made to look available; their
calls are compiled against a no-op CPU handler, cuda/tests/ffi_noop_cpu.cc,
and never run), each layer of each step appends the new token's key and
value with one call of the append kernel whose results alias the caches, and
the decoding kernel reads the lengths it writes: no scatter, no index
arithmetic, no copy of a cache-sized buffer (nor of the cache index: the
append call writes the lengths over the ones it reads). On the default path (xla here)
the step has no copy of a cache-sized buffer either (XLA's scatter writes
in place).
"""

from __future__ import annotations

import ctypes
import importlib.util
import pathlib
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest

from jax_flash._src.backends import ffi
from jax_flash._src.decode import cuda as decode_cuda

# The CPU backend's compiled HLO (a GPU's wraps the body in command
# buffers; tools/gpu/decode_step_profile.py --hlo writes it for reading).
pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="reads the CPU backend's compiled HLO")

ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH, PROMPT, NEW, LAYERS, D_MODEL, HEADS, VOCAB = 2, 24, 4, 2, 64, 2, 64
# One layer's key (or value) cache: [batch, prompt + new, heads, head_dim].
CACHE_BYTES = BATCH * (PROMPT + NEW) * D_MODEL * 2  # bf16


@pytest.fixture(scope="module")
def noop_handler(tmp_path_factory):
  """Registers the no-op CPU handler for the decoding targets."""
  src = ROOT / "cuda" / "tests" / "ffi_noop_cpu.cc"
  if not src.exists():
    pytest.skip("CUDA sources not in this checkout")
  cxx = next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)
  if cxx is None:
    pytest.skip("no C++ compiler (g++, c++ or clang++) on PATH")
  lib = tmp_path_factory.mktemp("ffi") / "libffi_noop_cpu.so"
  subprocess.run([cxx, "-std=c++17", "-O1", "-shared", "-fPIC",
                  f"-I{jax.ffi.include_dir()}", str(src), "-o", str(lib)],
                 check=True, capture_output=True, timeout=300)
  handle = ctypes.cdll.LoadLibrary(str(lib))
  for target in (ffi.DECODE, ffi.DECODE_APPEND):
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handle.JaxFlashNoop),
                                platform="cpu")
  return handle


@pytest.fixture
def kernel_path(monkeypatch, noop_handler):
  """The decoding kernels as if on a GPU (traced and compiled, not run)."""
  monkeypatch.setattr(decode_cuda, "unsupported_reason", lambda *a: None)
  monkeypatch.setattr(decode_cuda, "num_splits_for", lambda *a, **k: 2)


@pytest.fixture
def generate(monkeypatch):
  path = ROOT / "examples" / "generate.py"
  spec = importlib.util.spec_from_file_location("example_generate_hlo", path)
  mod = importlib.util.module_from_spec(spec)
  monkeypatch.setitem(__import__("sys").modules, "example_generate_hlo", mod)
  spec.loader.exec_module(mod)
  return mod


def _decode_step(generate):
  """(lowered, compiled) text of examples/generate.py's decode, bf16."""
  args = generate.parse_args([
      "--batch", str(BATCH), "--prompt", str(PROMPT), "--new", str(NEW),
      "--layers", str(LAYERS), "--d-model", str(D_MODEL), "--heads",
      str(HEADS), "--vocab", str(VOCAB), "--dtype", "bfloat16"])
  ours, _, _ = generate.build(args, jnp.bfloat16)
  total = PROMPT + NEW
  init = generate.DecoderLM(VOCAB, D_MODEL, HEADS, LAYERS, total,
                            stock=True).init
  zeros = jnp.zeros((1, total), jnp.int32)
  params = jax.eval_shape(lambda k: init(k, zeros, zeros),
                          jax.random.key(0))["params"]
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16),
                        params)
  cache = jax.eval_shape(ours.empty_cache)
  token = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
  lowered = ours.decode.lower(params, cache, token)
  return lowered.as_text(), lowered.compile().as_text()


def _while_body(hlo: str) -> str:
  """The compiled HLO of the scan's loop body."""
  body = re.search(r"while\(.*?body=%([\w.\-]+)", hlo).group(1)
  start = hlo.index(f"\n%{body} ")
  return hlo[start:hlo.index("\n}\n", start)]


_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "pred": 1}


def _large_copies(body: str):
  """The body's copy instructions (copies, and fusions XLA named after a
  copy) whose result holds a cache's bytes or more."""
  found = []
  for line in body.splitlines():
    m = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = (\S+) (copy|fusion)\(", line)
    if not m or (m.group(3) == "fusion" and "copy" not in m.group(1)):
      continue
    dt, dims = re.match(r"\(?(\w+)\[([\d,]*)\]", m.group(2)).groups()
    n = _DTYPE_BYTES.get(dt, 4)
    for d in filter(None, dims.split(",")):
      n *= int(d)
    if n >= CACHE_BYTES:
      found.append(line.strip()[:200])
  return found


def test_kernel_path_appends_in_place(kernel_path, generate):
  lowered, compiled = _decode_step(generate)
  # Per layer: one append call aliasing both caches and, over the lengths
  # it reads, the lengths after; no scatter.
  appends = re.findall(r"custom_call @jax_flash_decode_append\(.*", lowered)
  assert len(appends) == LAYERS
  for call in appends:
    aliases = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d)\]"
                         r", operand_index = (\d)", call)
    assert sorted(aliases) == [("0", "0"), ("1", "1"), ("2", "5")], call[:300]
  assert "stablehlo.scatter" not in lowered
  body = _while_body(compiled)
  assert body.count('custom_call_target="jax_flash_decode_append"') == LAYERS
  assert body.count('custom_call_target="jax_flash_decode"') == LAYERS
  assert "scatter" not in body
  assert _large_copies(body) == []
  # The cache index is updated in place too: no copy of it.
  assert not re.search(rf"= s32\[{BATCH}\]\S* copy\(", body)
  # The decoding call's page table (row b = sequence b) is a constant.
  for call in re.findall(r'custom-call\((.*?)\), custom_call_target="jax_flash_decode"',
                         body):
    table = [x.strip() for x in call.split(",")][5]
    assert re.sub(r"/\*.*?\*/", "", table).strip().startswith("%constant"), call


def test_default_path_has_no_cache_copy(generate):
  _, compiled = _decode_step(generate)
  body = _while_body(compiled)
  assert "jax_flash_decode" not in body  # the xla backend on the CPU
  assert _large_copies(body) == []


def test_large_copies_are_found():
  """The copy finder sees a copy of a cache-sized buffer (so that the tests
  above can fail)."""
  x = jnp.zeros((BATCH, PROMPT + NEW, HEADS, D_MODEL // HEADS), jnp.bfloat16)
  fn = jax.jit(lambda c: jax.lax.fori_loop(
      0, 3, lambda i, c: (c[0] + 1, c[0]), (c, c)))
  hlo = fn.lower(x).compile().as_text()
  assert _large_copies(_while_body(hlo))
