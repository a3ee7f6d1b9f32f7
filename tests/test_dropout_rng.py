"""Attention dropout's generator (jax_flash/_src/core/dropout.py) and its CUDA
twin (cuda/include/jax_flash/philox.h): Philox4x32 (7 rounds, and 10) against
the published known-answer vectors, the C++ header (compiled here with a host compiler)
against the JAX code bit for bit on random positions, keys and rates, the keep
rate within a binomial bound, and the positional contract (a pure function of
key and position: different keys or positions give independent masks)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash._src.core import dropout

ROOT = pathlib.Path(__file__).resolve().parents[1]
INCLUDE = ROOT / "cuda" / "include"

# Random123's kat_vectors for philox4x32_7 (the generator's) and _10.
KAT7 = [
    ((0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2,
     (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
]
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2,
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,want", KAT7)
def test_philox_known_answers(counter, key, want):
  assert dropout.ROUNDS == 7
  got = dropout.philox4x32(counter, key)
  assert tuple(int(x) for x in got) == want


@pytest.mark.parametrize("counter,key,want", KAT)
def test_philox10_known_answers(counter, key, want):
  got = dropout.philox4x32(counter, key, rounds=10)
  assert tuple(int(x) for x in got) == want


def test_philox_vectorised_equals_scalar(rng):
  c = rng.integers(0, 2**32, (4, 64), dtype=np.uint64).astype(np.uint32)
  k = rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32)
  words = np.stack([np.asarray(w) for w in dropout.philox4x32(tuple(c), tuple(k))])
  for n in range(0, 64, 13):
    one = dropout.philox4x32(tuple(int(x) for x in c[:, n]), tuple(int(x) for x in k))
    assert tuple(int(x) for x in one) == tuple(int(x) for x in words[:, n])


PROGRAM = r"""
#include <cstdio>
#include "jax_flash/philox.h"
int main() {
  unsigned k0, k1, thr, b0, h0, r0, c0, b, h, i, j;
  while (std::scanf("%u %u %u %u %u %u %u %u %u %u %u", &k0, &k1, &thr, &b0, &h0, &r0, &c0, &b, &h,
                    &i, &j) == 11) {
    const unsigned words[6] = {k0, k1, b0, h0, r0, c0};
    jax_flash::DropoutArgs a;
    a.words = words;
    a.threshold = thr;
    const jax_flash::Dropout d(a);
    std::printf("%d\n", d.keep(b, h, i, j) ? 1 : 0);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def cpp_keep(tmp_path_factory):
  cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
  if cxx is None:
    pytest.skip("no host C++ compiler")
  d = tmp_path_factory.mktemp("philox")
  src, exe = d / "keep.cc", d / "keep"
  src.write_text(PROGRAM)
  subprocess.run([cxx, "-std=c++17", "-O1", f"-I{INCLUDE}", str(src), "-o", str(exe)],
                 check=True, capture_output=True)

  def run(rows):
    out = subprocess.run([str(exe)], input="\n".join(" ".join(map(str, r)) for r in rows),
                         capture_output=True, text=True, check=True).stdout
    return np.array([int(x) for x in out.split()], bool)
  return run


def test_cuda_header_equals_jax(cpp_keep, rng):
  n = 4000
  k0, k1 = (rng.integers(0, 2**32, n, dtype=np.uint64) for _ in range(2))
  rates = rng.choice([0.0, 0.1, 0.25, 0.5, 0.9, 0.999], n)
  b, h = rng.integers(0, 64, n), rng.integers(0, 128, n)
  # The call's origin in the request (a shard's first batch element, head;
  # a ring block's first row and column, the column on a 64-column chunk).
  b0, h0 = rng.integers(0, 64, n), rng.integers(0, 128, n)
  r0, c0 = rng.integers(0, 1 << 19, n), 64 * rng.integers(0, 1 << 13, n)
  i, j = rng.integers(0, 1 << 19, n), rng.integers(0, 1 << 19, n)
  thr = np.array([dropout.threshold(r) for r in rates])
  want = cpp_keep(zip(k0, k1, thr, b0, h0, r0, c0, b, h, i, j))
  got = np.zeros(n, bool)
  u32 = lambda x: jnp.asarray(x.astype(np.uint32))
  for r in np.unique(rates):  # one vectorised call per rate
    sel = rates == r
    got[sel] = np.asarray(dropout.keep_mask(
        (u32(k0[sel]), u32(k1[sel])), u32(b[sel] + b0[sel]),
        u32(h[sel] + h0[sel]), u32(i[sel] + r0[sel]),
        u32(j[sel] + c0[sel]), float(r)))
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_rate_within_binomial_bound(rate):
  key = dropout.seed_words(jax.random.key(7))
  m = dropout.keep_mask(key, 0, jnp.arange(4)[:, None, None],
                        jnp.arange(300)[None, :, None], jnp.arange(777)[None, None, :], rate)
  n = m.size
  p = 1.0 - dropout.effective_rate(rate)
  sd = np.sqrt(n * p * (1 - p))
  assert abs(int(m.sum()) - n * p) < 5 * sd
  assert abs(dropout.effective_rate(rate) - rate) <= 1 / 512
  assert dropout.keep_scale(rate) * p == pytest.approx(1.0)


def test_mask_is_a_function_of_key_and_position():
  pos = (0, 3, jnp.arange(200)[:, None], jnp.arange(300)[None, :])
  k1, k2 = (dropout.seed_words(jax.random.key(s)) for s in (1, 2))
  a, b = dropout.keep_mask(k1, *pos, 0.5), dropout.keep_mask(k1, *pos, 0.5)
  np.testing.assert_array_equal(a, b)
  c = dropout.keep_mask(k2, *pos, 0.5)
  assert 0.4 < float(jnp.mean(a != c)) < 0.6  # independent masks
  # Another head, batch element or row offset: another, independent mask.
  for other in ((1, 3) + pos[2:], (0, 4) + pos[2:],
                (0, 3, pos[2] + 200, pos[3])):
    assert 0.4 < float(jnp.mean(a != dropout.keep_mask(k1, *other, 0.5))) < 0.6
  # A window into the same positions is the same mask (global positions).
  sub = dropout.keep_mask(k1, 0, 3, jnp.arange(50, 90)[:, None],
                          jnp.arange(130, 260)[None, :], 0.5)
  np.testing.assert_array_equal(sub, a[50:90, 130:260])


def test_rate_checked():
  with pytest.raises(ValueError, match="dropout_rate"):
    dropout.threshold(1.0)
  with pytest.raises(ValueError, match="dropout_rate"):
    dropout.threshold(-0.1)
  assert dropout.threshold(0.0) == 0 and dropout.keep_scale(0.0) == 1.0
