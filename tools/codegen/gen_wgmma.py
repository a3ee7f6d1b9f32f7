#!/usr/bin/env python3
"""Generate cuda/sm90/ptx/wgmma_ops.cuh: inline-PTX wrappers of wgmma.mma_async.

One explicit specialisation of Wgmma<N, Element> per instruction width N (the
n of m64nNkK) and input type (its k per instruction in TYPES), each with
  ss<kTransB, kTransA>(d, desc_a, desc_b, scale_d): A and B from shared memory,
  rs<kTransB>(d, a, desc_b, scale_d):      A from 4 registers, B from smem.
d is the fp32 accumulator fragment float[N/2] (wgmma order, see wgmma.cuh);
scale_d = 0 makes the instruction ignore (overwrite) the old accumulator.
Inline asm needs one operand per register, hence the generator. Only widths
in N_LIST are emitted; add one here when a tile shape needs it.

Usage: python tools/codegen/gen_wgmma.py   (rewrites the header)
"""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
OUT = ROOT / "cuda" / "sm90" / "ptx" / "wgmma_ops.cuh"

N_LIST = (16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 256)
# C++ type -> (PTX type, k of one instruction). The k must equal
# ElementTraits<type>::kMmaK (cuda/sm90/ptx/element_traits.cuh; wgmma.cuh
# checks it). 8-bit types have no tnspA/tnspB forms: their ss/rs keep the
# template parameters (so callers are uniform) but accept only 0.
TYPES = {"__nv_bfloat16": ("bf16", 16), "__half": ("f16", 16),
         "__nv_fp8_e4m3": ("e4m3", 32)}
# Widths per type (the FP8 forward: N = kBlockN for S, fwd_tuning.h's 8-bit
# tiles 128, 160 and 224 keys; N = head dim for O).
N_FOR_TYPE = {"__nv_fp8_e4m3": (64, 128, 160, 224, 256)}


def d_operands(nregs: int) -> str:
  ops = [f'"+f"(d[{i}])' for i in range(nregs)]
  return ",\n          ".join(", ".join(ops[i:i + 6]) for i in range(0, nregs, 6))


def asm_list(first: int, count: int) -> str:
  names = [f"%{first + i}" for i in range(count)]
  chunks = [", ".join(names[i:i + 8]) for i in range(0, count, 8)]
  return ',"\n        "'.join(chunks)


def emit(n: int, ctype: str, ptype: str, k: int) -> str:
  nr = n // 2
  shape = f"m64n{n}k{k}.f32.{ptype}.{ptype}"
  if k == 32:
    return emit_8bit(n, ctype, shape)
  # SS operand numbering: d 0..nr-1, desc_a nr, desc_b nr+1, scale_d nr+2, tnspB nr+3,
  # tnspA nr+4 (immediates)
  ss = f"""  template <int kTransB, int kTransA = 0>
  JF_DEVICE static void ss(float (&d)[{nr}], uint64_t desc_a, uint64_t desc_b, int scale_d) {{
    asm volatile(
        "{{\\n"
        ".reg .pred p;\\n"
        "setp.ne.b32 p, %{nr + 2}, 0;\\n"
        "wgmma.mma_async.sync.aligned.{shape} "
        "{{{asm_list(0, nr)}}}, "
        "%{nr}, %{nr + 1}, p, 1, 1, %{nr + 4}, %{nr + 3};\\n"
        "}}\\n"
        : {d_operands(nr)}
        : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(kTransB), "n"(kTransA));
  }}
"""
  # RS numbering: d 0..nr-1, a nr..nr+3, desc_b nr+4, scale_d nr+5, tnspB nr+6
  rs = f"""  template <int kTransB>
  JF_DEVICE static void rs(float (&d)[{nr}], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {{
    asm volatile(
        "{{\\n"
        ".reg .pred p;\\n"
        "setp.ne.b32 p, %{nr + 5}, 0;\\n"
        "wgmma.mma_async.sync.aligned.{shape} "
        "{{{asm_list(0, nr)}}}, "
        "{{%{nr}, %{nr + 1}, %{nr + 2}, %{nr + 3}}}, %{nr + 4}, p, 1, 1, %{nr + 6};\\n"
        "}}\\n"
        : {d_operands(nr)}
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d), "n"(kTransB));
  }}
"""
  return (f"template <>\nstruct Wgmma<{n}, {ctype}> {{\n"
          f"  static constexpr int kRegs = {nr};\n"
          f"  static constexpr int kK = {k};\n{ss}{rs}}};\n")


def emit_8bit(n: int, ctype: str, shape: str) -> str:
  """8-bit inputs: both operands K-major, no transpose immediates."""
  nr = n // 2
  ss = f"""  template <int kTransB, int kTransA = 0>
  JF_DEVICE static void ss(float (&d)[{nr}], uint64_t desc_a, uint64_t desc_b, int scale_d) {{
    static_assert(kTransB == 0 && kTransA == 0, "8-bit wgmma operands are K-major only");
    asm volatile(
        "{{\\n"
        ".reg .pred p;\\n"
        "setp.ne.b32 p, %{nr + 2}, 0;\\n"
        "wgmma.mma_async.sync.aligned.{shape} "
        "{{{asm_list(0, nr)}}}, "
        "%{nr}, %{nr + 1}, p, 1, 1;\\n"
        "}}\\n"
        : {d_operands(nr)}
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }}
"""
  rs = f"""  template <int kTransB>
  JF_DEVICE static void rs(float (&d)[{nr}], const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {{
    static_assert(kTransB == 0, "8-bit wgmma operands are K-major only");
    asm volatile(
        "{{\\n"
        ".reg .pred p;\\n"
        "setp.ne.b32 p, %{nr + 5}, 0;\\n"
        "wgmma.mma_async.sync.aligned.{shape} "
        "{{{asm_list(0, nr)}}}, "
        "{{%{nr}, %{nr + 1}, %{nr + 2}, %{nr + 3}}}, %{nr + 4}, p, 1, 1;\\n"
        "}}\\n"
        : {d_operands(nr)}
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));
  }}
"""
  return (f"template <>\nstruct Wgmma<{n}, {ctype}> {{\n"
          f"  static constexpr int kRegs = {nr};\n"
          f"  static constexpr int kK = 32;\n{ss}{rs}}};\n")


def main() -> None:
  parts = [
      "// GENERATED by tools/codegen/gen_wgmma.py -- do not edit.",
      "// wgmma.mma_async m64nNkK, fp32 accumulators, bf16/fp16 inputs (k = kK = 16) and e4m3",
      "// inputs (k = 32; both operands K-major); see wgmma.cuh.",
      "// Immediates: scale-a = scale-b = 1; tnspB = kTransB (1: B is MN-major in shared",
      "// memory); tnspA = kTransA for A in shared memory (ss; 1: A is MN-major, 16-bit",
      "// types only), 0 for A in registers (rs; K-major is the only choice there).",
      "#pragma once",
      "",
      "namespace jax_flash::sm90::ptx {",
      "",
      "template <int N, typename Element>",
      "struct Wgmma;  // only the specialisations below exist",
      "",
  ]
  for ctype, (ptype, k) in TYPES.items():
    for n in N_FOR_TYPE.get(ctype, N_LIST):
      parts.append(emit(n, ctype, ptype, k))
  parts.append("}  // namespace jax_flash::sm90::ptx\n")
  OUT.write_text("\n".join(parts))
  print(f"wrote {OUT}")


if __name__ == "__main__":
  main()
