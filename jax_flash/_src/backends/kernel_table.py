"""Which CUDA kernels exist: the head-dim buckets and element types each
kernel family instantiates.

Pure data (no jax import), read by:
- tools/codegen/gen_instantiations.py, which writes one instantiation file per
  kernel (cuda/instantiations/), their CMake source lists and build options
  (cuda/instantiations/sources.cmake) and the C++ view of this table
  (cuda/include/jax_flash/kernel_table.h) that the dispatchers expand;
- cuda_backend.py, which rounds head dims the way the kernels do and
  serves the value head dims the kernels instantiate.

A head dim d runs in the kernel of the smallest bucket of its family >= d,
zero-padded (the kernels' loads fill the padding columns with zeros). Adding a
bucket is one entry here plus its tile in the family's tile policy
(cuda/sm80/kernel_traits.cuh FwdConfigFor / BwdConfigFor,
cuda/sm90/fwd/fwd_tuning.h fwd_default_tuning, cuda/sm90/bwd/bwd_config.cuh
BwdConfigFor), then `python tools/codegen/gen_instantiations.py`.

A value head dim other than the query/key one (v and o [.., D_v]) runs in
kernels of their own, one per (D_qk, D_v) pair of HEAD_DIM_PAIRS, served
exactly (no padding); adding a pair is one entry there plus its tiles
(sm80: FwdConfigFor / BwdConfigFor / DqConfigFor<D_qk, D_v>; sm90 forward:
fwd_default_tuning(D_qk, D_v, ...); sm90 backward: BwdPairConfigFor<D_qk, D_v>).
"""

from __future__ import annotations

# The 16-bit element types (file-name tag -> C++ type). The FP8 family reads
# e4m3 and writes these.
DTYPES = {"bf16": "__nv_bfloat16", "fp16": "__half"}

# Kernel family -> its head-dim buckets, ascending.
HEAD_DIMS = {
    # The sm80 forward and backward. Also the row pitch of the dq_accum
    # workspace of both backward families (rounded_head_dim) and the buckets
    # of the decoding kernels (cuda/decode).
    "sm80": (64, 96, 128, 256),
    # sm90 (sm_90a only): TMA boxes and wgmma tiles come in 64-column blocks,
    # so 65..128 run in the 128 kernel.
    "sm90_fwd": (64, 128, 256),
    "sm90_bwd": (64, 128, 256),
    # The sm90 backward with attention dropout (every bucket; softcap with
    # dropout takes the sm80 backward).
    "sm90_bwd_dropout": (64, 128, 256),
    # The sm90 variable-length (cu_seqlens) backward, per-sequence tiles
    # (no dropout, no head-dim pair: the packed backward serves those).
    "sm90_bwd_varlen": (64, 128, 256),
    # The sm90 FP8 forward (e4m3 inputs), served exactly: whole 128-byte
    # swizzle rows of e4m3, or one 64-byte row (the 64B swizzle).
    "sm90_fp8": (64, 128, 256),
}


# Kernel family -> its (query/key head dim, value head dim) pairs with
# D_v != D_qk, ascending. The backward's dq_accum pitch of a pair is its D_qk.
HEAD_DIM_PAIRS = {
    # DeepSeek MLA prefill (V2 / V3): 192 / 128.
    "sm80": ((192, 128),),
    # The sm90 forward (and its dropout kernels) for the same pair; the sm80
    # family serves the pairs the sm90 families lack.
    "sm90_fwd": ((192, 128),),
    # The sm90 backward for the same pair (no dropout kernels: the sm80
    # backward serves the pair's dropout).
    "sm90_bwd": ((192, 128),),
}


def bucket(family: str, d: int) -> int:
  """The smallest bucket of `family` >= d; 0 past the largest."""
  return next((b for b in HEAD_DIMS[family] if d <= b), 0)


def max_head_dim(family: str) -> int:
  return HEAD_DIMS[family][-1]


def serves_pair(family: str, d: int, dv: int) -> bool:
  """Whether `family` has kernels for query/key head dim d with value head
  dim dv != d."""
  return (d, dv) in HEAD_DIM_PAIRS.get(family, ())
