"""The Pallas Triton kernels' tile table, gated_attention/attention/pallas_triton/tile_table.json, generated from the
kernel matrices' ptxas results (benchmark_results/gpu_kernels/*.json, written by
kernel_matrix/pallas_triton.py).

    python -m gated_attention_tools.kernel_matrix.tile_table           # writes the table
    python -m gated_attention_tools.kernel_matrix.tile_table --check   # exit status 1 where the shipped one differs

A results row is one case (dtype, head dim, bias and mask forms, precision, the op's further
arguments or not) compiled for one target with one tile, (block_q, block_k, num_warps,
num_stages). A key of the table (pallas_tiles.table_key) is a shared-memory class (CLASSES: the
data-centre GPUs, 'large', and the 99 KiB consumer ones, 'small') and holds every case of the
matrix (pallas_triton.matrix) whose dtype kind, precision and padded head dim, further arguments
and forms map to it. A tile is clean for a key when every case of the key compiled with it for
every target of the key's class (less the key's EXEMPT ones) with 0 spill bytes in all three
kernels, shared memory within the class's limit (pallas_tiles.SHARED_MEMORY_CLASSES: the smallest
of its GPUs') and MMA instructions in every non-IEEE kernel. Per key the
table takes, among the clean tiles: for the heaviest form (both biases, a full mask) without
further arguments the largest; for any other key the one nearest that (fewest changed fields, a
halved block counting once per halving; then the largest). The further arguments' matrix compiles
the heaviest form only: every form takes its tile.

Rows record the tile they compiled with (`tiles`, pallas_triton.py); rows without one compiled with
the tiles of UNRECORDED, checked against each kernel's thread count (num_warps x 32).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gated_attention.attention.pallas_triton import tile_table as pallas_tiles
from gated_attention.core import memory
from gated_attention_tools.kernel_matrix import common, pallas_triton

RESULTS = Path(__file__).resolve().parents[2] / "benchmark_results" / "gpu_kernels"
# Per shared-memory class (pallas_tiles.SHARED_MEMORY_CLASSES) its targets: a class's tile must
# compile clean for every one, within the class's shared memory. The data-centre GPUs; an Ada
# (sm_89) and a consumer / workstation Blackwell (sm_120) GPU, 99 KiB a block both.
CLASSES = {"large": ("a100", "h100", "b200"), "small": ("rtx6000pro", "rtx4090")}
TARGETS = tuple(t for targets in CLASSES.values() for t in targets)
# Keys (class first) no compiled candidate made clean on every target of their class, with the
# targets they are let off: a key here must be clean on the others, and a tile clean on every
# target makes the entry an error. float32 'high' H128, the heaviest form: the table's (16, 16, 8,
# 1) spills 16 B in the B200's dq/dbias; none of 16 candidates near it compiled clean on the B200
# and the A100 both (benchmark_results/gpu_kernels/README.md, *_candidates.json).
# float32 'high' H128 with both biases (a full or a key mask) or one bias and a full mask, and
# 'highest' H128 in the heaviest form, in the small class: every one of the 18 candidates that fit
# 99 KiB by the plan's estimate (2-8 warps, 1-3 stages) spilled on the RTX PRO 6000 (sm_120: 4 B
# at the least; rtx6000pro_candidates.json); they keep tiles clean on the RTX 4090.
EXEMPT = {
    ("large", "float32", "high", 128, False, "both", "full"): ("b200",),
    **{
        ("small", "float32", level, 128, False, bias, mask): ("rtx6000pro",)
        for level, bias, mask in (
            ("high", "both", "full"), ("high", "shared", "full"), ("high", "per_row", "full"),
            ("high", "both", "key"), ("highest", "both", "full"),
        )
    },
}  # fmt: skip
KINDS = ("float32", "half")
LEVELS = ("default", "high", "highest")
HEAD_DIMS = (16, 32, 64, 128)  # pallas_triton.HEAD_DIMS padded (pallas_tiles._pow2_tile)
HEAVIEST = pallas_tiles.HEAVIEST_FORM

# Rows without a `tiles` field (pallas_triton recorded none when they were compiled) compiled with
# these, the hand tables attention/pallas_triton/implementation.py had: a base by (dtype kind, level, padded head dim; a key not
# listed: pallas_tiles.FALLBACK), replaced by UNRECORDED_FORMS' entry for a bias and mask form, and
# with the op's further arguments by UNRECORDED_OPTIONS' or else the base with 8 warps (IEEE
# float32: 1 stage).
UNRECORDED_BASE = {
    ("float32", "default", 16): (64, 64, 4, 2),
    ("float32", "default", 32): (32, 32, 4, 2),
    ("float32", "default", 64): (32, 32, 4, 1),
    ("float32", "default", 128): (16, 16, 4, 1),
    ("float32", "high", 16): (64, 32, 4, 2),
    ("float32", "high", 32): (32, 16, 8, 1),
    ("float32", "high", 64): (32, 16, 8, 1),
    ("float32", "high", 128): (16, 16, 8, 1),
    ("float32", "highest", 16): (32, 32, 8, 2),
    ("float32", "highest", 32): (64, 32, 8, 2),
    ("float32", "highest", 128): (16, 16, 8, 1),
    ("half", "default", 16): (64, 64, 4, 2),
    ("half", "default", 32): (64, 64, 4, 2),
    ("half", "default", 64): (64, 32, 4, 2),
    ("half", "default", 128): (32, 32, 4, 1),
}
UNRECORDED_OPTIONS = {
    ("float32", "default", 16): (32, 32, 8, 2),
    ("float32", "high", 16): (32, 32, 8, 1),
    ("float32", "highest", 64): (16, 16, 4, 1),
    ("half", "default", 32): (32, 32, 8, 1),
    ("half", "default", 128): (32, 16, 8, 1),
}
UNRECORDED_FORMS = {
    ("float32", "default", 16, "none", "key"): (64, 64, 8, 2),
    ("float32", "default", 64, "per_row", "full"): (32, 32, 8, 1),
    ("float32", "default", 64, "shared", "full"): (32, 32, 8, 1),
    ("float32", "high", 16, "both", "full"): (64, 32, 8, 1),
    ("float32", "high", 16, "both", "key"): (32, 32, 4, 2),
    ("float32", "high", 16, "none", "key"): (64, 32, 8, 2),
    ("float32", "high", 16, "per_row", "key"): (64, 16, 8, 1),
    ("float32", "high", 16, "shared", "key"): (64, 16, 8, 1),
    ("float32", "high", 32, "both", "full"): (16, 16, 8, 1),
    ("float32", "high", 32, "none", "key"): (16, 16, 8, 1),
    ("float32", "high", 32, "per_row", "full"): (16, 16, 8, 1),
    ("float32", "high", 32, "shared", "full"): (16, 16, 8, 1),
    ("float32", "high", 128, "both", "key"): (16, 16, 8, 2),
    ("float32", "high", 128, "per_row", "key"): (16, 16, 8, 2),
    ("float32", "high", 128, "shared", "key"): (16, 16, 8, 2),
    ("float32", "highest", 16, "none", "key"): (32, 32, 8, 1),
    ("float32", "highest", 16, "per_row", "full"): (32, 16, 8, 2),
    ("float32", "highest", 16, "per_row", "key"): (32, 16, 8, 2),
    ("float32", "highest", 16, "shared", "full"): (32, 16, 8, 2),
    ("float32", "highest", 16, "shared", "key"): (32, 16, 8, 2),
    ("float32", "highest", 32, "per_row", "key"): (64, 32, 8, 1),
    ("float32", "highest", 32, "per_row", "none"): (64, 32, 8, 1),
    ("float32", "highest", 32, "shared", "key"): (64, 32, 8, 1),
    ("float32", "highest", 64, "both", "key"): (16, 16, 8, 1),
    ("half", "default", 16, "both", "key"): (64, 64, 8, 2),
    ("half", "default", 32, "both", "key"): (64, 64, 8, 2),
    ("half", "default", 128, "both", "full"): (32, 32, 8, 1),
}


def case_key(case: dict[str, Any]) -> tuple:
    """The table key a matrix case belongs to."""
    kind = "float32" if case["dtype"] == "float32" else "half"
    level = case.get("precision", "default") if kind == "float32" else "default"
    head_dim = pallas_tiles._pow2_tile(case["head_dim"])
    return (kind, level, head_dim, bool(case.get("options")), case["bias"], case["mask"])


def _case_id(case: dict[str, Any]) -> tuple:
    precision = case.get("precision", "default") if case["dtype"] == "float32" else "default"
    return (case["dtype"], case["head_dim"], case["bias"], case["mask"], precision)


def unrecorded_tiles(case: dict[str, Any]) -> tuple[int, int, int, int]:
    """The tile a row without a `tiles` field compiled with (UNRECORDED)."""
    kind, level, head_dim, options, bias, mask = case_key(case)
    tile = UNRECORDED_BASE.get((kind, level, head_dim), pallas_tiles.FALLBACK)
    if not options:
        return UNRECORDED_FORMS.get((kind, level, head_dim, bias, mask), tile)
    block_q, block_k, warps, stages = tile
    tile = (block_q, block_k, max(warps, 8), 1 if level == "highest" else stages)
    return UNRECORDED_OPTIONS.get((kind, level, head_dim), tile)


def row_tiles(row: dict[str, Any]) -> tuple[int, int, int, int]:
    """The tile a row compiled with; a row's kernels' thread counts must agree with its warps."""
    tile = tuple(row["tiles"]) if "tiles" in row else unrecorded_tiles(row["case"])
    threads = {k["threads"] for k in row.get("kernels", {}).values() if "threads" in k}
    if threads - {tile[2] * 32}:
        raise ValueError(f"{row['case']}: kernels ran {sorted(threads)} threads, tiles {tile}")
    return tile


def target_class(target: str) -> str | None:
    """The CLASSES name a target's results serve, or None (a target the table does not read)."""
    return next((name for name, targets in CLASSES.items() if target in targets), None)


def fits(case: dict[str, Any], tile, limit: int) -> bool:
    """Whether the plan's shared-memory estimate (memory.gpu_shared_memory_bytes) of the case with
    `tile` is within `limit`: PallasAttention.plan refuses the tile otherwise."""
    item = 4 if case["dtype"] == "float32" else 2
    need = memory.gpu_shared_memory_bytes(
        block_q=tile[0], block_k=tile[1], stages=tile[3],
        padded_head_dim=pallas_tiles._pow2_tile(case["head_dim"]), itemsize=item,
        pair_itemsize=item * len(common.BIAS_SHAPES[case["bias"]]) + (case["mask"] != "none"),
    )  # fmt: skip
    return need <= limit


def clean(row: dict[str, Any]) -> bool:
    """All three kernels compiled, 0 spill bytes, shared memory within the limit of the row's
    target's class (ptxas's and the plan's estimate), MMA unless the case is IEEE float32."""
    case, kernels = row["case"], row.get("kernels", {})
    limit = pallas_tiles.SHARED_MEMORY_CLASSES[target_class(row["target"])]
    wants_mma = case["dtype"] != "float32" or case.get("precision") != "highest"
    return (
        not row.get("problems")
        and fits(case, row_tiles(row), limit)
        and all(
            name in kernels
            and not kernels[name]["spill_store_bytes"]
            and not kernels[name]["spill_load_bytes"]
            and kernels[name].get("shared_memory_bytes", 0) <= limit
            and (kernels[name]["mma"] or not wants_mma)
            for name in pallas_triton.KERNELS
        )
    )


def expected_cases() -> dict[tuple, set[tuple]]:
    """{table key: its matrix cases}: every form without the further arguments, the heaviest with."""
    cases = pallas_triton.matrix() + pallas_triton.matrix(
        [HEAVIEST[0]], [HEAVIEST[1]], options=True
    )
    expected = defaultdict(set)
    for case in cases:
        expected[case_key(case)].add(_case_id(case))
    return expected


def load_rows(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """Every row of the results files, each with its file's target."""
    rows = []
    for path in sorted(paths):
        result = json.loads(Path(path).read_text())
        rows += [dict(row, target=result["target"]) for row in result["rows"]]
    return rows


def _size_order(tile) -> tuple:
    block_q, block_k, warps, stages = tile
    return (-block_q * block_k, -block_q, warps, -stages)


def _distance(tile, base) -> float:
    blocks = sum(abs(math.log2(a / b)) for a, b in zip(tile[:2], base[:2], strict=True))
    return blocks + (tile[2] != base[2]) + (tile[3] != base[3])


def outcomes(rows: Iterable[dict[str, Any]]) -> dict[tuple, dict[tuple, dict[tuple, bool]]]:
    """{table key (class first): {tile: {(target, case id): clean}}} from results rows (a case
    compiled more than once with a tile is clean only if every row of it is)."""
    found = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        group = target_class(row["target"])
        if group is None:
            continue
        seen = found[(group, *case_key(row["case"]))][row_tiles(row)]
        where = (row["target"], _case_id(row["case"]))
        seen[where] = seen.get(where, True) and clean(row)
    return found


def clean_in(found, expected, key, targets) -> list[tuple[int, int, int, int]]:
    """The tiles `found` (outcomes) has clean for every case of `key` on every one of `targets`."""
    wanted = {(target, case) for target in targets for case in expected[key[1:]]}
    return [
        t
        for t, seen in found.get(key, {}).items()
        if wanted <= seen.keys() and all(v for (target, _), v in seen.items() if target in targets)
    ]


def generate(rows: Iterable[dict[str, Any]]) -> dict[tuple, tuple[int, int, int, int]]:
    """{table key (class first): tile} from results rows (the rule in the module's docstring),
    each class's from its targets' rows."""
    expected = expected_cases()
    found = outcomes(rows)

    def clean_tiles(key, targets):
        return clean_in(found, expected, key, targets)

    table, missing = {}, []
    for group, targets in CLASSES.items():
        keys = [(group, *k) for k in expected]
        heaviest = [k for k in keys if k[4:] == (False, *HEAVIEST)]
        for key in heaviest + [k for k in keys if k not in heaviest]:
            tiles = clean_tiles(key, targets)
            if key in EXEMPT:
                if tiles:
                    raise ValueError(
                        f"{key} is EXEMPT from {EXEMPT[key]} but {tiles} compiled clean"
                    )
                tiles = clean_tiles(key, tuple(t for t in targets if t not in EXEMPT[key]))
            if not tiles:
                missing.append(key)
            elif key in heaviest:
                table[key] = min(tiles, key=_size_order)
            elif (base := table.get((*key[:4], False, *HEAVIEST))) is not None:
                table[key] = min(
                    tiles, key=lambda t, base=base: (_distance(t, base), _size_order(t))
                )
    if missing:
        raise ValueError(f"no tile compiled clean for every target in every case of {missing}")
    for key in list(table):
        if key[4:] == (True, *HEAVIEST):
            for bias in pallas_triton.BIASES:
                for mask in pallas_triton.MASKS:
                    table.setdefault((*key[:5], bias, mask), table[key])
    return table


def _order(key) -> tuple:
    group, kind, level, head_dim, options, bias, mask = key
    return (
        list(CLASSES).index(group),
        KINDS.index(kind),
        LEVELS.index(level),
        head_dim,
        options,
        pallas_triton.BIASES.index(bias),
        pallas_triton.MASKS.index(mask),
    )


def render(table: dict[tuple, tuple[int, int, int, int]]) -> str:
    """The table file's text: one key and its tile a line, in a fixed order."""
    rows = [json.dumps([*key, *table[key]]) for key in sorted(table, key=_order)]
    lines = [
        "{",
        ' "generated_by": "python -m gated_attention_tools.kernel_matrix.tile_table (do not edit by hand)",',
        f' "columns": {json.dumps(list(pallas_tiles.COLUMNS))},',
        ' "tiles": [',
        ",\n".join(f"  {row}" for row in rows),
        " ]",
        "}",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="the *.json results' folder")
    parser.add_argument("--out", type=Path, default=pallas_tiles.TABLE_FILE)
    parser.add_argument("--check", action="store_true", help="compare with --out, write nothing")
    args = parser.parse_args(argv)
    table = generate(load_rows(args.results.glob("*.json")))
    text = render(table)
    if args.check:
        same = args.out.exists() and args.out.read_text() == text
        print(f"{args.out}: {'up to date' if same else 'differs from the results: regenerate'}")
        return 0 if same else 1
    args.out.write_text(text)
    print(f"{args.out}: {len(table)} keys")
    return 0


if __name__ == "__main__":
    sys.exit(main())
