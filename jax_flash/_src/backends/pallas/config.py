"""Tile sizes and Triton launch knobs for the Pallas kernels.

Three kernels (forward, backward dQ, backward dK/dV), each with its own
`KernelConfig`. On GPU the defaults follow jax's own Triton attention kernel
(`jax/experimental/pallas/ops/gpu/attention.py`: 128x128 tiles, 4 warps for
head_dim <= 64 else 8, 2 pipeline stages) and the Triton fused-attention
tutorial for the backward; they are starting points, not tuned values. On CPU
(interpret mode) small tiles keep the tests fast while still covering several
blocks per sequence.

Override at trace time, e.g. for tuning on the GPU, with
  JAX_FLASH_PALLAS_FWD=128,64,8,2      (block_q,block_k,num_warps,num_stages)
  JAX_FLASH_PALLAS_BWD_DQ=...          JAX_FLASH_PALLAS_BWD_DKDV=...
(values already traced and cached by jit are not re-read). On GPU the tiles
are then shrunk, if needed, until the estimated shared memory of the
software-pipelined loop fits (`_fit_shared_memory`): float32 tiles take twice
the bytes of bf16 ones, and Triton fails to compile ("out of resource") when
they do not fit.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  block_q: int  # query rows per tile
  block_k: int  # key rows per tile
  num_warps: int = 4
  num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class Config:
  forward: KernelConfig
  backward_dq: KernelConfig
  backward_dkdv: KernelConfig


_ENV = {"forward": "JAX_FLASH_PALLAS_FWD",
        "backward_dq": "JAX_FLASH_PALLAS_BWD_DQ",
        "backward_dkdv": "JAX_FLASH_PALLAS_BWD_DKDV"}

CPU_BLOCK = 32  # interpret mode: small tiles, several blocks even at T=37


def _gpu_defaults(head_dim_padded: int) -> Config:
  if head_dim_padded <= 64:
    return Config(forward=KernelConfig(128, 128, 4, 2),
                  backward_dq=KernelConfig(128, 64, 4, 2),
                  backward_dkdv=KernelConfig(64, 128, 4, 2))
  if head_dim_padded <= 128:
    return Config(forward=KernelConfig(128, 128, 8, 2),
                  backward_dq=KernelConfig(128, 64, 8, 2),
                  backward_dkdv=KernelConfig(64, 128, 8, 2))
  # head_dim 256: fp32 accumulators [rows, 256] need smaller tiles to stay in
  # registers and shared memory.
  return Config(forward=KernelConfig(64, 64, 4, 2),
                backward_dq=KernelConfig(64, 32, 4, 2),
                backward_dkdv=KernelConfig(32, 64, 8, 2))


# Bytes of shared memory we let the tiles take: H100/H200 allow 227 KiB per
# block; Triton needs some on top for layout conversions and reductions.
SHARED_MEMORY_BUDGET = 160 * 1024
MIN_TILE = 16


def shared_memory_bytes(kind: str, cfg: KernelConfig, head_dim: int,
                        itemsize: int) -> int:
  """Rough size of the tiles a kernel holds in shared memory.

  Resident tiles (loaded once per program) count once; the two tiles loaded
  per loop iteration count `num_stages` times (Triton's pipeline buffers).
  """
  resident, streamed = {
      "forward": (cfg.block_q, 2 * cfg.block_k),             # q | k, v
      "backward_dq": (2 * cfg.block_q, 2 * cfg.block_k),     # q, do | k, v
      "backward_dkdv": (2 * cfg.block_k, 2 * cfg.block_q),   # k, v | q, do
  }[kind]
  return itemsize * head_dim * (resident + cfg.num_stages * streamed)


def _fit_shared_memory(kind: str, cfg: KernelConfig, head_dim: int,
                       itemsize: int) -> KernelConfig:
  """Halve the streamed tile, then the resident one, then drop a pipeline
  stage, until the tiles fit the budget."""
  streamed = "block_q" if kind == "backward_dkdv" else "block_k"
  resident = "block_k" if kind == "backward_dkdv" else "block_q"
  while shared_memory_bytes(kind, cfg, head_dim,
                            itemsize) > SHARED_MEMORY_BUDGET:
    if getattr(cfg, streamed) > MIN_TILE:
      cfg = dataclasses.replace(cfg, **{streamed: getattr(cfg, streamed) // 2})
    elif getattr(cfg, resident) > MIN_TILE:
      cfg = dataclasses.replace(cfg, **{resident: getattr(cfg, resident) // 2})
    elif cfg.num_stages > 1:
      cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    else:
      break
  return cfg


def _parse(text: str, name: str) -> KernelConfig:
  try:
    vals = [int(x) for x in text.split(",")]
    return KernelConfig(*vals)
  except (ValueError, TypeError):
    raise ValueError(
        f"{name}={text!r}: expected 'block_q,block_k[,num_warps[,num_stages]]'"
        " (integers)") from None


def config_for(platform: str, head_dim_padded: int,
               itemsize: int = 2) -> Config:
  """Tiles for a head dim (already padded to a power of two) and an input
  element size in bytes."""
  if platform == "cpu":
    k = KernelConfig(CPU_BLOCK, CPU_BLOCK)
    cfg = Config(k, k, k)
  else:
    cfg = _gpu_defaults(head_dim_padded)
  overrides = {f: _parse(os.environ[e], e) for f, e in _ENV.items()
               if os.environ.get(e)}
  cfg = dataclasses.replace(cfg, **overrides)
  if platform == "cpu":
    return cfg
  return Config(**{
      f.name: _fit_shared_memory(f.name, getattr(cfg, f.name),
                                 head_dim_padded, itemsize)
      for f in dataclasses.fields(Config)})
