#!/usr/bin/env python3
"""Checks in SASS that the sm90 forward's Q fragments survive their mainloop.

With Q in registers (kFlagQInRegs, cuda/sm90/mainloop.cuh) each consumer loads
its Q fragments once per tile with ldmatrix (LDSM) and every QK^T wgmma (HGMMA
with a register A operand) reads them. ptxas 13.0 was seen to give those
registers to P inside the serial schedule's loop (PTX correct, SASS wrong:
wrong results on the H200). This lint fails if, in an sm90 forward kernel that
has LDSM, a register an LDSM wrote is written by anything else afterwards, or
if no HGMMA reads an LDSM-written register as A (the check would be vacuous).

  tools/check_wgmma_a_regs.py FILE...   (cubin, executable or .so; needs cuobjdump)

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
DEST = re.compile(r"^(?:@!?U?P\w+\s+)?(\S+)\s+(R\d+)")
# Instructions whose first register operand is not a destination.
NO_DEST = ("ST", "STS", "STG", "STL", "HGMMA", "BAR", "SYNCS", "RED", "ATOM", "BRA", "EXIT",
           "WARPGROUP", "ISETP", "FSETP")
KERNEL = "sm9010fwd_kernel"


def kernels(sass):
  """(mangled name, [instruction text]) per function of a cuobjdump -sass listing."""
  for chunk in re.split(r"\n\s*Function : ", sass)[1:]:
    name = chunk.split("\n", 1)[0].strip()
    yield name, [m.group(2) for m in INSTR.finditer(chunk)]


def check(ins):
  """None without LDSM; else (HGMMAs reading LDSM registers as A, [other writes to them])."""
  loads = [i for i, s in enumerate(ins) if s.split()[0].startswith("LDSM")]
  if not loads:
    return None
  regs = set()
  for i in loads:
    op = ins[i].split()[0]
    base = int(re.search(r"LDSM\S*\s+R(\d+)", ins[i]).group(1))
    regs.update(range(base, base + (4 if ".4" in op else 2 if ".2" in op else 1)))
  used = sum(1 for s in ins
             if (m := re.match(r"HGMMA\S*\s+R\d+,\s+R(\d+),", s)) and int(m.group(1)) in regs)
  bad = []
  for s in ins[loads[0]:]:
    m = DEST.match(s)
    if not m or m.group(1).split(".")[0] in NO_DEST or m.group(1).startswith("LDSM"):
      continue
    if int(m.group(2)[1:]) in regs:
      bad.append(s)
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
      print(f"{'ok  ' if ok else 'FAIL'} {name[:110]}: {used} HGMMA read LDSM registers as A, "
            f"{len(bad)} other writes" + (f" (first: {bad[0]})" if bad else ""))
  print(f"{checked} kernels with LDSM checked, {failed} failed")
  return 1 if failed or not checked else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
