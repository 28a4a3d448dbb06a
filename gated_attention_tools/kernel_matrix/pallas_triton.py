"""What ptxas makes of the Pallas Triton kernels (PallasAttention) for a GPU target, deviceless.

For one case (common.FIELDS: dtype, head dim, bias and mask forms, lengths, precision)
`kernel_stats` compiles the op's forward and its gradient with PallasAttention for the target,
dumps the PTX, runs `ptxas -v` on each kernel and reads back per kernel (`ptx_kernels`,
`launches`): registers per thread, spill stores and loads, the launch's dynamic shared memory, and
whether its dots are tensor-core MMA instructions (`mma.sync` / `wgmma` / `tcgen05.mma`), with the
tiles it compiled with (`tiles`: block_q, block_k, num_warps, num_stages). Nothing runs on a GPU:
these say what compiles and how, never how fast.

  python -m gated_attention_tools.kernel_matrix.pallas_triton --target h100 --out benchmark_results/gpu_kernels/h100.json

compiles the whole case matrix (each case in a child process) and writes the figures with a
markdown summary beside them; `--tiles 32,32,8,1` compiles every case with those tiles instead of
the table's (candidates for kernel_matrix/tile_table.py, which makes the table from these
results), `--fused-backward` the one-pass backward (PallasAttention.fused_backward); `--dtypes`,
`--head-dims`, `--precisions`, `--biases` and `--masks` narrow the matrix (to one table key's
cases, say) and `--append` adds the rows to --out's instead of replacing them.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from gated_attention_tools import targets
from gated_attention_tools.kernel_matrix import common

KERNELS = ("gated_attention_forward", "gated_attention_dkdv", "gated_attention_dq_dbias")
# With PallasAttention.fused_backward: the forward and the one backward kernel.
FUSED_KERNELS = ("gated_attention_forward", "gated_attention_fused_backward")
_ALL_KERNELS = (*KERNELS, *FUSED_KERNELS[1:])  # every kernel ptxas is asked about
DTYPES = common.DTYPES
HEAD_DIMS = (8, 16, 32, 64, 128)
BIASES = common.BIASES
MASKS = common.MASKS
PRECISIONS = common.PRECISIONS
# Tensor-core MMA in the PTX: mma.sync (sm_80 on), wgmma (Hopper), tcgen05.mma (Blackwell, sm_100a:
# Triton's dots there take the fifth-generation tensor cores and their tensor memory).
_MMA = re.compile(r"\b(mma\.sync|wgmma\.mma_async|tcgen05\.mma)\b")
TILE_FIELDS = ("block_q", "block_k", "num_warps", "num_stages")


def kernel_stats(
    target: str,
    dtype: str,
    head_dim: int,
    bias: str,
    mask: str,
    precision: str = "default",
    batch: int = 2,
    q_len: int = 200,
    k_len: int = 136,
    heads: int = 2,
    tuning: dict | None = None,
    options: bool = False,
    positions_first: bool = False,
) -> dict[str, Any]:
    """Compiles the case for the target and returns {kernel name: figures} (a child's function).
    With `options`, the op's further arguments too: one key/value head under the query heads,
    causal, a window, both sequence lengths (traced), a soft cap and the residual; with
    `positions_first`, q, k and v [T|S, B, N, head_dim], read in place."""
    import jax.numpy as jnp

    import gated_attention as ga
    from gated_attention.attention import gpu_common

    dt = jnp.dtype(dtype)
    impl = ga.PallasAttention(**(tuning or {}))
    lax_precision = dict(default=None, high="high", highest="highest")[precision]
    dots = gpu_common.dot_precision(lax_precision, dt, impl.interpret)
    with targets.abstract_gpu(target):  # the table's tiles for this GPU, as the compile reads them
        tiles = impl.tiles(dt, dots, head_dim, options, (bias, mask))
    step, args = common.case_program(
        impl, dtype, head_dim, bias, mask, lax_precision, options, batch, q_len, k_len, heads,
        positions_first,
    )  # fmt: skip
    spec = targets.target(target)
    with tempfile.TemporaryDirectory() as dump:
        start = time.perf_counter()
        targets.compile(step, *args, target=target, dump_to=dump)
        compile_s = time.perf_counter() - start
        kernels = ptx_kernels(dump, spec.arch)
        found = launches(dump)
        ptx_files = len(glob.glob(os.path.join(dump, "*.ptx")))
    for name, launch in found.items():
        if name in kernels:
            kernels[name].update(launch)
    # jax 0.12.0.1's deviceless compile dumps no .ptx files (why not is unexamined): no kernels
    # to read, which ptx_files = 0 says.
    return dict(
        kernels=kernels, tiles=list(tiles), compile_s=round(compile_s, 1), ptx_files=ptx_files
    )


def compile_cases(
    target: str, cases: list[dict[str, Any]], tuning: dict | None = None
) -> list[dict[str, Any]]:
    """kernel_stats for each case, in this process (a child's function: common.run); a case
    whose compile raises is {error, tiles} and the others still compile."""
    results = []
    for case in cases:
        try:
            results.append(kernel_stats(target, tuning=tuning, **case))
        except Exception as e:  # shared memory over the target's, a refused plan: the case's row
            results.append(
                dict(
                    error=f"{type(e).__name__}: {_last_line(e)}", tiles=_tiles(target, case, tuning)
                )
            )
    return results


def _last_line(error: Exception) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else "")[:200]


def _tiles(target: str, case: dict[str, Any], tuning: dict | None) -> list[int]:
    """The tiles a case asks for on the target (a failed compile's row records them)."""
    import jax.numpy as jnp

    import gated_attention as ga
    from gated_attention.attention import gpu_common

    dt = jnp.dtype(case["dtype"])
    impl = ga.PallasAttention(**(tuning or {}))
    precision = dict(default=None, high="high", highest="highest")[case.get("precision", "default")]
    dots = gpu_common.dot_precision(precision, dt, impl.interpret)
    with targets.abstract_gpu(target):
        form = (case["bias"], case["mask"])
        return list(impl.tiles(dt, dots, case["head_dim"], bool(case.get("options")), form))


def ptx_kernels(dump: str, arch: str) -> dict[str, dict[str, Any]]:
    """{kernel: registers, spill bytes, MMA} from ptxas -v on every dumped .ptx of ours."""
    kernels = {}
    for path in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
        text = Path(path).read_text()
        names = [k for k in _ALL_KERNELS if f".entry {k}" in text or f".entry {k}(" in text]
        if not names:
            continue
        run = subprocess.run(
            [targets.ptxas(), f"-arch={arch}", "-v", path, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
        info = run.stderr
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
        registers = re.search(r"Used (\d+) registers", info)
        kernels[names[0]] = dict(
            registers=int(registers.group(1)),
            spill_store_bytes=int(spills.group(1)) if spills else 0,
            spill_load_bytes=int(spills.group(2)) if spills else 0,
            mma=bool(_MMA.search(text)),
            scalar_fma=text.count("fma.rn.f32"),
        )
    return kernels


def launches(dump: str) -> dict[str, dict[str, Any]]:
    """{kernel: dynamic shared memory, threads} from XLA's thunk sequence."""
    found = {}
    for path in glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt")):
        for line in Path(path).read_text().splitlines():
            m = re.search(
                r"(gated_attention_\w+) grid: .* threads: \[(\d+).*shared_memory: (\d+)", line
            )
            if m:
                found[m.group(1)] = dict(
                    threads=int(m.group(2)), shared_memory_bytes=int(m.group(3))
                )
    return found


def matrix(
    biases=BIASES,
    masks=MASKS,
    options: bool = False,
    dtypes=DTYPES,
    head_dims=HEAD_DIMS,
    precisions=PRECISIONS,
) -> list[dict[str, Any]]:
    """Every case PallasAttention.check accepts, by dtype x head dim x bias x mask (float32 at
    each precision; half precision ignores `precisions`), at lengths that are not multiples of
    the tiles (with `options`: the op's further arguments too, kernel_stats)."""
    return common.matrix(dtypes, head_dims, biases, masks, tuple(precisions), options)


def verdict(
    target: str, case: dict[str, Any], stats: dict[str, Any], fused: bool = False
) -> list[str]:
    """What is wrong with a case's kernels (empty: nothing): spills, shared memory over the
    target's limit, a missing kernel (`fused`: the fused backward's), no MMA where the precision
    asks for the tensor cores."""
    limit = targets.target(target).shared_memory_bytes
    wants_mma = case["dtype"] != "float32" or case["precision"] != "highest"
    problems = []
    for name in FUSED_KERNELS if fused else KERNELS:
        k = stats["kernels"].get(name)
        if k is None:
            problems.append(f"{name}: not found")
            continue
        if k["spill_store_bytes"] or k["spill_load_bytes"]:
            problems.append(f"{name}: spills {k['spill_store_bytes']} B")
        if k.get("shared_memory_bytes", 0) > limit:
            problems.append(f"{name}: shared memory {k['shared_memory_bytes']} > {limit}")
        if wants_mma and not k["mma"]:
            problems.append(f"{name}: no MMA")
    return problems


def run(
    target: str, cases, tuning: dict | None = None, log=print, per_child: int = 1
) -> list[dict[str, Any]]:
    """Rows {case, kernels, tiles, compile_s, ptx_files, problems} for the cases, compiled in
    children of `per_child` cases each; a case whose compile fails is a row of that problem
    (with the tiles it was given), as is each case of a child that dies."""

    def row(case, stats):
        if "error" in stats:  # this case's compile raised in a child that went on
            return dict(
                case=case, tiles=stats["tiles"], problems=[f"compile failed: {stats['error']}"]
            )
        fused = bool((tuning or {}).get("fused_backward"))
        return dict(case=case, **stats, problems=verdict(target, case, stats, fused))

    def failed(case, error):
        tiles = [tuning[f] for f in TILE_FIELDS if f in (tuning or {})]
        stats = dict(tiles=tiles) if tiles else {}  # a failed candidate's
        return dict(case=case, **stats, problems=[common.failure(error)])

    return common.run(
        "gated_attention_tools.kernel_matrix.pallas_triton:compile_cases",
        target, cases, row, failed, per_child=per_child, log=log, tuning=tuning,
    )  # fmt: skip


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument(
        "--target",
        default="h100",
        choices=[t for t, s in targets.TARGETS.items() if s.kind == "gpu"],
    )
    parser.add_argument("--biases", default=",".join(BIASES), help="bias forms, comma-separated")
    parser.add_argument("--masks", default=",".join(MASKS), help="mask forms, comma-separated")
    parser.add_argument(
        "--options", action="store_true", help="with GQA, causal, window, lengths, soft cap"
    )
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="dtypes, comma-separated")
    parser.add_argument(
        "--head-dims", default=",".join(map(str, HEAD_DIMS)), help="head dims, comma-separated"
    )
    parser.add_argument(
        "--precisions", default=",".join(PRECISIONS), help="float32 precisions, comma-separated"
    )
    parser.add_argument(
        "--tiles", default="", help="block_q,block_k,num_warps,num_stages for every case"
    )
    parser.add_argument(
        "--fused-backward", action="store_true", help="PallasAttention(fused_backward=True)"
    )
    parser.add_argument(
        "--append", action="store_true", help="add the rows to --out's (the same target's)"
    )
    parser.add_argument(
        "--per-child",
        type=int,
        default=1,
        help="cases per child process (the compilers start once)",
    )
    args = parser.parse_args()
    tuning = None
    if args.tiles:
        tuning = dict(zip(TILE_FIELDS, map(int, args.tiles.split(",")), strict=True))
    if args.fused_backward:
        tuning = (tuning or {}) | dict(fused_backward=True)
    cases = matrix(
        args.biases.split(","),
        args.masks.split(","),
        args.options,
        args.dtypes.split(","),
        [int(h) for h in args.head_dims.split(",")],
        args.precisions.split(","),
    )
    out = Path(args.out)
    earlier = []
    if args.append and out.exists():
        previous = json.loads(out.read_text())
        if previous["target"] != args.target:
            parser.error(f"{out} holds {previous['target']}'s rows, not {args.target}'s")
        earlier = previous["rows"]
    cases = cases[: args.limit or None]
    log = lambda line: print(line, flush=True)  # noqa: E731
    rows = run(args.target, cases, tuning, log=log, per_child=args.per_child)
    import jax

    result = dict(
        target=args.target, jax=jax.__version__, ptxas=_ptxas_version(), rows=earlier + rows
    )
    common.write(out, result, markdown)


def _ptxas_version() -> str:
    run = subprocess.run([targets.ptxas(), "--version"], capture_output=True, text=True)
    return run.stdout.strip().splitlines()[-1]


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    bad = [r for r in rows if r["problems"]]
    lines = [
        f"# Pallas kernels compiled for {result['target']} (jax {result['jax']}, {result['ptxas']})",
        "",
        f"{len(rows)} cases, {len(rows) - len(bad)} with no problem (0 spills, shared memory in "
        "the limit, MMA in every non-IEEE kernel).",
        "",
    ]
    columns = ("case", "tiles", "kernel", "registers", "spill stores (B)", "shared memory (B)")
    fused = any(FUSED_KERNELS[1] in r.get("kernels", {}) for r in rows)
    kernels = FUSED_KERNELS if fused else KERNELS
    lines += common.table(
        (*columns, "MMA", "problems"), _table_rows(rows, kernels), right=columns[3:]
    )
    return "\n".join(lines) + "\n"


def _table_rows(rows, kernels=KERNELS):
    for r in rows:
        name = common.case_name(r["case"])
        tiles = ", ".join(map(str, r.get("tiles", [])))
        for kernel in kernels:
            k = r.get("kernels", {}).get(kernel, {})
            problems = [p for p in r["problems"] if p.startswith(kernel) or "compile" in p]
            yield (
                name, tiles, kernel, k.get("registers", ""), k.get("spill_store_bytes", ""),
                k.get("shared_memory_bytes", ""), k.get("mma", ""), "; ".join(problems),
            )  # fmt: skip


if __name__ == "__main__":
    main()
