#!/usr/bin/env python3
"""Checks in SASS that the sm90 forward's Q fragments survive their mainloop.

With Q in registers (kFlagQInRegs, cuda/sm90/fwd/mainloop.cuh) each consumer loads
its Q fragments once per tile with ldmatrix (LDSM) and every QK^T wgmma (HGMMA
with a register A operand) reads them. ptxas 13.0 was seen to give those
registers to P inside the serial schedule's loop (PTX correct, SASS wrong:
wrong results on the H200). This lint fails if, in an sm90 forward kernel that
has LDSM, some QK^T HGMMA may read, as its A operand, a register value that
did not come from an LDSM (reaching definitions over the SASS control flow; a
register reused between tiles, after the last QK^T, is fine), or if no QK^T
HGMMA reads registers at all (the check would be vacuous).

  tools/lint/check_wgmma_a_regs.py FILE...   (cubin, executable or .so; needs cuobjdump)

Only non-transposed LDSM count as Q loads: the FP8 forward's V transposer
(cuda/sm90/fwd/v_transpose.cuh) uses LDSM.16.MT88 (ldmatrix .trans) in the
producer warpgroup, and an FP8 kernel has no Q in registers.

Only the sm90 forward cubins (fwd_*_sm90.*) are disassembled when the file
names its embedded cubins that way (the extension, the test binaries), and
only kernels whose mangled name contains "sm9010fwd_kernel" are checked (the
sm80 kernels use LDSM for ordinary mma operands rewritten every block).
Prints one line per kernel checked; exit status 1 on a violation or when no
kernel was checked.
"""
import pathlib
import re
import subprocess
import sys
import tempfile

INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
PRED = re.compile(r"^@!?U?P\w+\s+")
KERNEL = "sm9010fwd_kernel"
# Instructions whose first register operand is not a destination.
NO_DEST = ("ST", "STS", "STG", "STL", "BAR", "SYNCS", "RED", "BRA", "EXIT", "WARPGROUP",
           "ISETP", "FSETP", "UISETP", "DEPBAR", "NOP", "MEMBAR", "FENCE", "CCTL", "CALL", "RET",
           "WARPSYNC", "ERRBAR", "UTMA")
LDSM, OTHER, ENTRY = 1, 2, 4  # which definitions of a register may reach a point


def kernels(sass):
  """(mangled name, [(address, instruction text)]) per function of a cuobjdump -sass listing."""
  for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
    name = chunk.split("\n", 1)[0].strip()
    yield name, [(int(m.group(1), 16), m.group(2)) for m in INSTR.finditer(chunk)]


def dest_regs(text):
  """Registers an instruction writes (first operand, widened by the opcode)."""
  body = PRED.sub("", text)
  parts = body.split(None, 1)
  op = parts[0]
  if op.split(".")[0] in NO_DEST or len(parts) < 2:
    return []
  m = re.match(r"(R\d+)\b", parts[1])
  if not m or m.group(1) == "RZ":
    return []
  base = int(m.group(1)[1:])
  if op.startswith("HGMMA"):  # accumulators: M64 x N fp32 = N / 2 registers
    n = re.match(r"HGMMA\.64x(\d+)x", op)
    width = int(n.group(1)) // 2 if n else 1
  elif op.startswith("LDSM"):
    width = 4 if ".4" in op else 2 if ".2" in op else 1
  elif ".128" in op:
    width = 4
  elif ".64" in op or ".WIDE" in op:
    width = 2
  else:
    width = 1
  return list(range(base, base + width))


def successors(i, ins, index):
  body = PRED.sub("", ins[i][1])
  op = body.split()[0]
  conditional = body != ins[i][1] or ".ANY" in op or ".DIV" in op
  nxt = [i + 1] if i + 1 < len(ins) else []
  if op.startswith("BRA"):
    t = re.search(r"0x([0-9a-f]+)", body)
    tgt = [index[int(t.group(1), 16)]] if t and int(t.group(1), 16) in index else []
    return tgt + (nxt if conditional else [])
  if op.startswith("EXIT") or op.startswith("RET"):
    return nxt if conditional else []
  return nxt


def check(ins):
  """None without (non-transposed) LDSM. Else (QK^T HGMMAs reading registers as A, [problems]): a
  reaching-definitions pass over the kernel's control flow; every register
  that a QK^T HGMMA (register A, K-major B: no .tnspB, unlike O += P V) reads
  as A must be reached by LDSM definitions only, on every path. Registers
  reused for something else between two tiles are fine; a write on a path
  from the ldmatrix to a QK^T read of it is the miscompile."""
  texts = [t for _, t in ins]
  is_ldsm = [PRED.sub("", t).startswith("LDSM") and ".MT88" not in t for t in texts]
  if not any(is_ldsm):
    return None
  index = {a: i for i, (a, _) in enumerate(ins)}
  regs = sorted({r for t, ld in zip(texts, is_ldsm) if ld for r in dest_regs(t)})
  slot = {r: k for k, r in enumerate(regs)}
  writes = [([slot[r] for r in dest_regs(t) if r in slot], LDSM if ld else OTHER,
             PRED.match(t) is not None) for t, ld in zip(texts, is_ldsm)]
  state = [None] * len(ins)
  state[0] = (ENTRY,) * len(regs)
  work = [0]
  while work:
    i = work.pop()
    cur = list(state[i])
    w, kind, predicated = writes[i]
    for k in w:
      cur[k] = cur[k] | kind if predicated else kind
    out = tuple(cur)
    for j in successors(i, ins, index):
      if state[j] is None:
        state[j] = out
        work.append(j)
      else:
        merged = tuple(a | b for a, b in zip(state[j], out))
        if merged != state[j]:
          state[j] = merged
          work.append(j)
  used, bad = 0, []
  for i, t in enumerate(texts):
    m = re.match(r"HGMMA\S*\s+R\d+,\s+R(\d+),", PRED.sub("", t))
    if not m or "tnspB" in t or state[i] is None:
      continue
    used += 1
    for r in range(int(m.group(1)), int(m.group(1)) + 4):
      if r not in slot:
        bad.append(f"{t} reads R{r}, which no LDSM writes")
      elif state[i][slot[r]] != LDSM:
        bad.append(f"{t} may read R{r} from a non-LDSM write")
  return used, bad


def disassemble(path):
  """SASS of the sm90 forward cubins embedded in path (all of it if none is named so)."""
  listing = subprocess.run(["cuobjdump", "-lelf", path], capture_output=True, text=True).stdout
  names = re.findall(r"ELF file\s+\d+:\s+(fwd_\S+_sm90\.\S+\.cubin)", listing)
  if not names:
    return subprocess.run(["cuobjdump", "-sass", path], check=True, capture_output=True,
                          text=True).stdout
  out = []
  with tempfile.TemporaryDirectory() as tmp:
    for name in names:
      subprocess.run(["cuobjdump", "-xelf", name, str(pathlib.Path(path).resolve())], cwd=tmp,
                     check=True, capture_output=True)
      out.append(subprocess.run(["cuobjdump", "-sass", name], cwd=tmp, check=True,
                                capture_output=True, text=True).stdout)
  return "\n".join(out)


def main(paths):
  failed = checked = 0
  for path in paths:
    for name, ins in kernels(disassemble(path)):
      if KERNEL not in name or (r := check(ins)) is None:
        continue
      checked += 1
      used, bad = r
      ok = used > 0 and not bad
      failed += not ok
      print(f"{'ok  ' if ok else 'FAIL'} {name[:110]}: {used} QK^T HGMMA with register A, "
            f"{len(bad)} problems" + (f" (first: {bad[0]})" if bad else ""))
  print(f"{checked} kernels with LDSM checked, {failed} failed")
  return 1 if failed or not checked else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
