"""The machine code of every kernel the registry's catalogue lists, for comparing two trees.

Compiles each catalogue spec on each architecture CI compiles for (``jit.ARCHS``; a spec built
for its own architecture, e.g. sm_90a, on that one), disassembles the cubin with ``nvdisasm``
(code sections only, no line info) and writes ``{"<arch> | <spec>": sha256 of the SASS}`` as
JSON; ``--dump DIR`` also writes each disassembly. Needs NVRTC (CuPy) and an ``nvdisasm`` (the
``nvidia-cuda-nvdisasm`` wheel has one), no GPU. The tree compared is the ``nvfp4_mla`` on the
path::

    PYTHONPATH=src python benchmarks/sass.py --nvdisasm PATH --out new.json
    PYTHONPATH=/old/tree/src python benchmarks/sass.py --nvdisasm PATH --out old.json
    python benchmarks/sass.py --compare old.json new.json

A refactoring that only moves code leaves every hash as it was; ``--compare`` lists the specs
whose SASS changed, appeared or went away, and exits 1 if any did.

``--lines TEXT`` reports where one spec's machine code comes from (the spec whose description holds
TEXT, on sm_90): its instructions and reconvergence points (``BSSY``), then the source lines that
produce the most instructions (``nvdisasm -g``; the kernels are built with line info). Code that a
block runs once, cold, costs instruction fetch (docs/performance.md#against-flashmla)::

    PYTHONPATH=src python benchmarks/sass.py --nvdisasm PATH --lines "16 heads a block"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def disassemble(nvdisasm: str, cubin: bytes, *options: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", *options, f.name], check=True, capture_output=True, text=True).stdout


INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/")  # an instruction's line: its address in a comment
SOURCE_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')


def line_report(nvdisasm: str, text: str, top: int = 25) -> str:
    """The sm_90 spec whose description holds ``text``: its instructions and ``BSSY`` count, then
    the ``top`` source lines by the instructions they produce."""
    from nvfp4_mla import jit
    from nvfp4_mla.ops import registry

    spec = next((s for s in registry.catalogue("sm_90") if text in s.describe()), None)
    if spec is None:
        raise SystemExit(f"no sm_90 spec's description holds {text!r}")
    sass = disassemble(nvdisasm, jit.compile_kernel(spec, jit.target_arch(spec, "sm_90")).cubin, "-g")
    source, counts = "?", Counter[str]()
    for line in sass.splitlines():
        found = SOURCE_LINE.search(line)
        if found:
            source = f"{Path(found[1]).name}:{found[2]}"
        elif INSTRUCTION.match(line):
            counts[source] += 1
    total, reconvergences = sum(counts.values()), sass.count(" BSSY ")
    rows = [f"{spec.describe()}: {total} instructions, {reconvergences} BSSY"]
    rows += [f"{n:6d}  {where}" for where, n in counts.most_common(top)]
    return "\n".join(rows)


def collect(nvdisasm: str, dump: Path | None, only: str) -> dict[str, str]:
    from nvfp4_mla import jit
    from nvfp4_mla.ops import registry

    jobs = [(arch, spec) for arch in jit.ARCHS for spec in registry.catalogue(arch) if only in spec.describe()]

    def one(job):
        arch, spec = job
        target = jit.target_arch(spec, arch)
        sass = disassemble(nvdisasm, jit.compile_kernel(spec, target).cubin)
        return f"{arch} | {spec.describe()}", sass

    hashes = {}
    with ThreadPoolExecutor(os.cpu_count()) as pool:  # NVRTC releases the GIL
        for name, sass in pool.map(one, jobs):
            hashes[name] = hashlib.sha256(sass.encode()).hexdigest()
            if dump is not None:
                (dump / (hashlib.sha1(name.encode()).hexdigest()[:16] + ".sass")).write_text(f"// {name}\n{sass}")
    return hashes


def compare(old: dict[str, str], new: dict[str, str]) -> int:
    if len(new) < len(old):  # a filtered run (--only): compare what it covers
        old = {k: v for k, v in old.items() if k in new}
    changed = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    gone, added = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
    for title, names in (("changed", changed), ("only in the first", gone), ("only in the second", added)):
        for name in names:
            print(f"{title}: {name}")
    same = len(old.keys() & new.keys()) - len(changed)
    print(f"{same} identical, {len(changed)} changed, {len(gone)} only in the first, {len(added)} only in the second")
    return 1 if changed or gone or added else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvdisasm", default="nvdisasm")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dump", type=Path, help="write each disassembly into this directory")
    parser.add_argument("--only", default="", help="only the specs whose description holds this text")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"))
    parser.add_argument("--lines", metavar="TEXT", help="one sm_90 spec's instructions by source line")
    args = parser.parse_args()
    if args.lines:
        print(line_report(args.nvdisasm, args.lines))
        return 0
    if args.compare:
        return compare(*(json.loads(p.read_text()) for p in args.compare))
    if args.dump:
        args.dump.mkdir(parents=True, exist_ok=True)
    hashes = collect(args.nvdisasm, args.dump, args.only)
    text = json.dumps(hashes, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
