"""Candidate tiles, compiled deviceless, for the tile table's keys that have none clean on every
target of their shared-memory class (kernel_matrix/tile_table.py: CLASSES, the rule).

    JAX_PLATFORMS=cpu python -m gated_attention_tools.kernel_matrix.tile_search --group small

For each key of the class with no tile clean on all its targets (the heaviest form's keys first,
then the others, the op's further arguments last), compiles tiles of CANDIDATES whose shared
memory estimate (memory.gpu_shared_memory_bytes, the plan's check) fits the class, in the rule's
order: nearest first (tile_table._distance; then the largest) to the class's heaviest form's
tile for another form, else (the heaviest form, or a form whose heaviest has none) to the large
class's tile for the key (ptxas's spills grow with the tiles: the largest first spilled hundreds
of bytes). It goes in rounds (the heaviest form's keys, then the
others): each round compiles every unresolved key's next candidate for the key's cases on the
class's first target, then those clean there on the next (`compile_tiles`, 24 cases a child
process), and appends every row to benchmark_results/gpu_kernels/{target}_candidates.json; a key's
search ends at its first tile clean on every target. `python -m
gated_attention_tools.kernel_matrix.tile_table` then makes the table. One key's round on one
target compiles what this command does:

    JAX_PLATFORMS=cpu python -m gated_attention_tools.kernel_matrix.pallas_triton --target T --out benchmark_results/gpu_kernels/T_candidates.json --append --dtypes D --head-dims H --precisions P --biases B --masks M [--options] --tiles BQ,BK,W,S
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

from gated_attention.attention.pallas_triton import tile_table as pallas_tiles
from gated_attention_tools.kernel_matrix import common, pallas_triton, tile_table

# (block_q, block_k, num_warps, num_stages): the tables' tiles are within these; 2 warps and 3
# stages too (float32 'high' and 'highest' at head dim 128 spilled on sm_120 with every other).
CANDIDATES = tuple(itertools.product((64, 32, 16), (64, 32, 16), (4, 8), (2, 1))) + tuple(
    t
    for t in itertools.product((64, 32, 16), (64, 32, 16), (2, 4, 8), (3, 2, 1))
    if t[2] == 2 or t[3] == 3
)


def fits(key: tuple, tile: tuple[int, int, int, int]) -> bool:
    """Whether every case of the key fits its class's shared memory with `tile` by the plan's
    estimate (tile_table.fits)."""
    limit = pallas_tiles.SHARED_MEMORY_CLASSES[key[0]]
    return all(tile_table.fits(case, tile, limit) for case in key_cases(key))


def key_cases(key: tuple) -> list[dict[str, Any]]:
    """The matrix cases of a table key (class first)."""
    options = key[4]
    cases = pallas_triton.matrix(options=True, biases=[key[5]], masks=[key[6]]) if options else []
    cases = cases or pallas_triton.matrix()
    return [c for c in cases if tile_table.case_key(c) == key[1:]]


def append(target: str, rows: list[dict[str, Any]], results: Path) -> None:
    """Adds rows to the target's candidates file (pallas_triton's format and --append)."""
    import jax

    out = results / f"{target}_candidates.json"
    earlier = json.loads(out.read_text())["rows"] if out.exists() else []
    result = dict(
        target=target, jax=jax.__version__, ptxas=pallas_triton._ptxas_version(),
        rows=earlier + rows,
    )  # fmt: skip
    common.write(out, result, pallas_triton.markdown)


def compile_tiles(target: str, pairs: list[tuple[dict, list[int]]]) -> list[dict[str, Any]]:
    """pallas_triton.kernel_stats of each (case, tile) pair, in this process (a child's function);
    a pair whose compile raises is {error, tiles}."""
    results = []
    for case, tile in pairs:
        tuning = dict(zip(pallas_triton.TILE_FIELDS, tile, strict=True))
        results += pallas_triton.compile_cases(target, [case], tuning)
    return results


def _compile(target: str, pairs, per_child: int, log) -> list[dict[str, Any]]:
    """Rows (pallas_triton's) of the (case, tile) pairs compiled for the target, `per_child` a
    child process."""
    from gated_attention_tools import targets as targets_

    rows = []
    for start in range(0, len(pairs), per_child):
        batch = pairs[start : start + per_child]
        results = targets_.in_child(
            "gated_attention_tools.kernel_matrix.tile_search:compile_tiles",
            dict(target=target, pairs=[(c, list(t)) for c, t in batch]),
        )
        for (case, tile), stats in zip(batch, results, strict=True):
            if "error" in stats:
                row = dict(
                    case=case, tiles=list(tile), problems=[f"compile failed: {stats['error']}"]
                )
            else:
                problems = pallas_triton.verdict(target, case, stats)
                row = dict(case=case, **stats, problems=problems)
            rows.append(row)
            log(
                f"{target} {common.case_name(case)} {tuple(tile)}: {'; '.join(row['problems']) or 'ok'}"
            )
    return rows


def search(
    group: str,
    results: Path = tile_table.RESULTS,
    log=print,
    per_child: int = 24,
    options: tuple[bool, ...] = (False, True),
) -> list[tuple]:
    """Compiles candidates for the class's keys without a clean tile (the module's docstring), in
    rounds: each round the next candidate of every unresolved key, on the class's first target,
    then those clean there on the next; returns the keys none of CANDIDATES made clean. `options`:
    the keys searched, without the op's further arguments (False), with (True)."""
    targets = tile_table.CLASSES[group]
    expected = tile_table.expected_cases()
    keys = [(group, *k) for k in expected if k[3] in options]
    heaviest = [k for k in keys if k[4:] == (False, *tile_table.HEAVIEST)]
    others = [k for k in keys if k not in heaviest]
    failed = []
    for phase in (heaviest, others):
        found = tile_table.outcomes(tile_table.load_rows(results.glob("*.json")))
        bases = {
            k[:4]: min(clean, key=tile_table._size_order)
            for k in heaviest
            if (clean := tile_table.clean_in(found, expected, k, targets))
        }
        large = tile_table.CLASSES["large"]
        queues = {}
        for key in phase:
            if tile_table.clean_in(found, expected, key, targets):
                continue
            base = None if key in heaviest else bases.get(key[:4])
            if base is None:  # the large class's tile: ptxas's spills grow with the tiles
                clean = tile_table.clean_in(found, expected, ("large", *key[1:]), large)
                base = min(clean, key=tile_table._size_order) if clean else None
            order = (
                (lambda t: tile_table._size_order(t))
                if base is None
                else (lambda t, b=base: (tile_table._distance(t, b), tile_table._size_order(t)))
            )
            tried = found.get(key, {})
            queues[key] = [
                t for t in sorted(CANDIDATES, key=order) if fits(key, t) and t not in tried
            ]
        while queues:
            trial = {key: queue.pop(0) for key, queue in queues.items() if queue}
            failed += [key for key, queue in queues.items() if key not in trial]
            passing = dict(trial)
            for target in targets:
                pairs = [(c, t) for key, t in passing.items() for c in key_cases(key)]
                if not pairs:
                    break
                rows = _compile(target, pairs, per_child, log)
                append(target, rows, results)
                bad = {tile_table.case_key(r["case"]) for r in rows if r["problems"]}
                passing = {k: t for k, t in passing.items() if k[1:] not in bad}
            for key, tile in trial.items():
                log(f"{key} {tile}: {'clean' if key in passing else 'not clean'}")
            queues = {k: q for k, q in queues.items() if k in trial and k not in passing}
    for key in failed:
        log(f"{key}: no candidate compiled clean on {targets}")
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", choices=list(tile_table.CLASSES), default="small")
    parser.add_argument("--results", type=Path, default=tile_table.RESULTS)
    parser.add_argument(
        "--options", choices=("without", "with", "all"), default="all",
        help="the keys without the op's further arguments, with them, or all",
    )  # fmt: skip
    args = parser.parse_args()
    log = lambda line: print(line, flush=True)  # noqa: E731
    options = dict(without=(False,), all=(False, True)).get(args.options, (True,))
    failed = search(args.group, args.results, log=log, options=options)
    print(f"keys with no clean candidate: {failed}")


if __name__ == "__main__":
    main()
