"""What runs around the attention kernel in a family module compiled for a GPU without one: the
row loops (XLA while loops) and the copy passes (transposes, slices, copies and
dynamic-update-slices of activation-sized tensors, and fusions of nothing else; a fill of a
constant, which reads no data, is not one), read from the
optimized HLO of a deviceless compile (targets.py). Nothing runs: no time is measured.

  python -m gated_attention_tools.module_passes                      # model_1's cells, H100
  python -m gated_attention_tools.module_passes --target=b200 --what=triangle_end --n_res=1024

A pass is counted where an instruction of the compiled program (outside fused computations and
kernels) moves data only and its result holds at least half the elements of one [X, Y, h, c]
projection of the module: smaller ones are a row tile's, and a loop of tiles is counted as a
loop.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from typing import Any

# HLO opcodes that only move data; a fusion of nothing else is a copy pass too.
MOVES = frozenset({
    "transpose", "copy", "copy-start", "copy-done", "slice", "dynamic-slice",
    "dynamic-update-slice", "concatenate", "pad", "bitcast", "reshape", "broadcast",
    "parameter", "constant", "tuple", "get-tuple-element",
})  # fmt: skip
# Opcodes that are never a pass by themselves (no data moves, or it is the loop's own).
FREE = frozenset({"bitcast", "parameter", "constant", "tuple", "get-tuple-element", "while"})
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+)\s*=\s*(.+?)\s+([a-z][a-z0-9-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(\S+)\s.*\{\s*$")
_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([\d,]*)\]")


def _elements(shape: str) -> int:
    """Elements of an HLO result type's largest array ('bf16[512,384,256]{2,1,0}'; a tuple's)."""
    found = [math.prod(int(d) for d in dims.split(",") if d) for _, dims in _SHAPE.findall(shape)]
    return max(found, default=0)


def computations(hlo: str) -> dict[str, list[tuple[str, str, str, str]]]:
    """{computation: [(name, result type, opcode, rest of the line)]} of an HLO module's text."""
    found, current = {}, None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head and "=" not in line.split("{")[0].split("(")[0]:
            current = found.setdefault(head.group(1), [])
            continue
        if current is None:
            continue
        match = _INSTRUCTION.match(line)
        if match:
            current.append(match.groups())
    return found


def count(hlo: str, min_elements: int) -> dict[str, Any]:
    """{'loops': while loops, 'passes': [(opcode or 'fusion', result type)]} of a compiled module."""
    comps = computations(hlo)
    fused = set()
    for instructions in comps.values():
        for _, _, op, rest in instructions:
            if op == "fusion":
                fused.update(re.findall(r"calls=%([\w.-]+)", rest))
    loops, passes = 0, []
    for name, instructions in comps.items():
        if name in fused:
            continue  # inside a fusion: judged with it
        for _, shape, op, rest in instructions:
            loops += op == "while"
            if op in FREE or op.endswith("-done") or _elements(shape) < min_elements:
                continue
            if op == "fusion":
                called = re.findall(r"calls=%([\w.-]+)", rest)
                ops = {o for c in called for _, _, o, _ in comps.get(c, ())}
                if ops and ops <= MOVES and ops - FREE != {"broadcast"}:  # a fill copies nothing
                    passes.append((f"fusion({'+'.join(sorted(ops - FREE))})", shape.split("{")[0]))
            elif op in MOVES:
                passes.append((op, shape.split("{")[0]))
    return dict(loops=loops, passes=passes)


MODEL_1 = {  # what: (heads, head dim) of model_1's configs
    "msa_row": (8, 32),
    "msa_column": (8, 32),
    "triangle_start": (4, 32),
    "triangle_end": (4, 32),
}


def compile_cell(
    what: str, mode: str, n_seq: int, n_res: int, target: str, dtype: str = "bfloat16"
) -> dict[str, Any]:
    """The child (targets.in_child): our module's cell compiled for the target, its counts."""
    from gated_attention_tools import family_benchmark, targets

    fn, specs = family_benchmark.memory_problem(what, "ours", n_seq, n_res, dtype, mode)
    compiled = targets.compile(fn, *specs, target=target)
    heads, head_dim = MODEL_1[what]
    rows = n_res if what.startswith("triangle") else n_seq
    found = count(compiled.as_text(), rows * n_res * heads * head_dim // 2)
    peak = targets.memory(compiled)["peak"]
    return dict(what=what, mode=mode, n_seq=n_seq, n_res=n_res, target=target, dtype=dtype,
                peak_gib=peak / 2**30, **found)  # fmt: skip


def compile_cells(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """compile_cell for each of cells (kwargs) in one child: the compilers start once."""
    return [compile_cell(**cell) for cell in cells]


def cells(n_seq: int, n_res: tuple[int, ...], what=tuple(MODEL_1), modes=("inference", "training")):
    """The cells: each module and mode; the MSA modules at n_seq x each n_res, the triangles at
    each n_res."""
    for w in what:
        for n in n_res:
            for mode in modes:
                yield dict(what=w, mode=mode, n_seq=n_seq, n_res=n)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="h100", help="a targets.TARGETS GPU (h100, a100, b200)")
    parser.add_argument("--what", nargs="*", default=list(MODEL_1), choices=list(MODEL_1))
    parser.add_argument("--n_seq", type=int, default=512, help="MSA rows (model_1's crop: 512)")
    parser.add_argument("--n_res", type=int, nargs="*", default=[384, 1024])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    from gated_attention_tools import targets

    rows = []
    print("| module | mode | N_seq x N_res | row loops | copy passes | peak GiB |")
    print("| --- | --- | --- | ---: | --- | ---: |")
    for cell in cells(args.n_seq, tuple(args.n_res), tuple(args.what)):
        row = targets.in_child(
            "gated_attention_tools.module_passes:compile_cell", dict(cell, target=args.target)
        )
        rows.append(row)
        passes = ", ".join(f"{op} {shape}" for op, shape in row["passes"]) or "0"
        size = f"{row['n_seq']} x {row['n_res']}" if "msa" in row["what"] else f"{row['n_res']}"
        print(
            f"| {row['what']} | {row['mode']} | {size} | {row['loops']} | {passes} | "
            f"{row['peak_gib']:.2f} |",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
