"""What ptxas makes of the Mosaic GPU kernels (gated_attention/attention/pallas_mosaic_gpu/) for an H100, deviceless.

For one case (common.FIELDS: dtype, head dim, bias and mask forms, the op's further arguments)
`compile_cases` compiles the op's forward and gradient with MosaicAttention for the H100 target
(targets.py) with Mosaic GPU's own dumps on (MOSAIC_GPU_DUMP_PTXAS, MOSAIC_GPU_DUMP_PTX: XLA's
dump does not hold Mosaic kernels), and reads per kernel (`parse`): registers, spill stores and
loads, the wgmma instructions of its PTX, and the shared memory the kernel allocates
(kernels_sm90.shared_memory_bytes, the largest of the three). Nothing runs on a GPU: what
compiles and how, never how fast.

  python -m gated_attention_tools.kernel_matrix.pallas_mosaic_gpu --out benchmark_results/mosaic_kernels/h100.json

compiles every case MosaicAttention.check accepts (the Triton matrix's dtypes, head dims, bias
and mask forms, float32 at JAX's default precision only, with and without the further arguments),
several cases per child process.
"""

from __future__ import annotations

import re
from typing import Any

from gated_attention_tools import child, targets
from gated_attention_tools.kernel_matrix import common

KERNELS = (
    "gated_attention_mosaic_forward",
    "gated_attention_mosaic_dkdv",
    "gated_attention_mosaic_dq_dbias",
)
HEAD_DIMS = (8, 16, 32, 64, 128)  # the Triton matrix's
DUMPS = {"MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_PTX": "1"}
_ENTRY = re.compile(r"Compiling entry function '(\w+?)_mosaic_gpu_kernel' for '(\w+)'")
_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTX_ENTRY = re.compile(r"\.entry (\w+?)_mosaic_gpu_kernel\b")
_WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+(?:\.\w+)+)")


def matrix(options: bool) -> list[dict[str, Any]]:
    """The cases MosaicAttention takes: every dtype, head dim, bias and mask form (float32 at
    the default precision, the one it computes at)."""
    return common.matrix(common.DTYPES, HEAD_DIMS, precisions=("default",), options=options)


def parse(text: str) -> dict[str, dict[str, Any]]:
    """{kernel: figures} from Mosaic GPU's ptxas and PTX dumps of one compile."""
    kernels: dict[str, dict[str, Any]] = {}
    current = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = kernels.setdefault(m.group(1), dict(arch=m.group(2), wgmma=[]))
        elif current is not None and (m := _REGISTERS.search(line)):
            current["registers"] = int(m.group(1))
        elif current is not None and (m := _SPILLS.search(line)):
            current["spill_store_bytes"], current["spill_load_bytes"] = map(int, m.groups())
    parts = _PTX_ENTRY.split(text)
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        shapes = sorted(set(_WGMMA.findall(body.split(".entry")[0])))
        kernels.setdefault(name, dict(wgmma=[]))["wgmma"] = shapes
    return kernels


def compile_cases(target: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Compiles each case for the target in this process (a child's function, DUMPS set before
    jax starts: common.run) and returns per case {kernels, shared_memory_bytes} or {error}."""
    results = []
    for case in cases:
        refused = None
        with child.printed() as out:
            try:
                error, (smem, forward) = None, _compile(target, **case)
            except NotImplementedError as e:  # check() refuses it: 'auto' takes another kernel
                error, smem, forward, refused = None, 0, 0, str(e)
            except Exception as e:  # a case that fails is reported, the others still run
                error = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}"
                smem = forward = 0
        row = dict(kernels=parse(out[0]), shared_memory_bytes=smem)
        if forward:
            row["forward_shared_memory_bytes"] = forward
        if error:
            row["error"] = error
        if refused:
            row["refused"] = refused
        results.append(row)
    return results


def _compile(
    target, dtype, head_dim, bias, mask, precision="default", options=False, batch=2, q_len=200,
    k_len=136, heads=2, positions_first=False, rows_per_program=None, consumer_warpgroups=1,
    block_k=None, persistent=False,
):  # fmt: skip
    """Compiles one case's forward and vjp (`rows_per_program`, `consumer_warpgroups`, `block_k`,
    `persistent`: MosaicAttention's); returns the kernels' shared memory (bytes: the largest of the three,
    the forward's)."""
    import jax.numpy as jnp

    from gated_attention.attention import base
    from gated_attention.attention.pallas_mosaic_gpu import implementation as mosaic
    from gated_attention.attention.pallas_mosaic_gpu import kernels_sm90 as mosaic_kernels
    from gated_attention.core import masking

    del precision  # float32 at the default precision only: the one MosaicAttention takes
    dt = jnp.dtype(dtype)
    impl = mosaic.MosaicAttention(
        rows_per_program=rows_per_program, consumer_warpgroups=consumer_warpgroups, block_k=block_k,
        persistent=persistent,
    )  # fmt: skip
    step, args = common.case_program(
        impl, dtype, head_dim, bias, mask, None, options, batch, q_len, k_len, heads,
        positions_first,
    )  # fmt: skip
    qkv, kv, _, biases, mask_spec, lengths, _ = args
    if positions_first:  # the shapes check() and the plan see: batch first
        qkv, kv = base.batch_first(qkv), base.batch_first(kv)
    structure, further = masking.NONE, {}
    if options:
        structure = masking.StructuredMask(True, (96, 0), q_lengths=lengths, kv_lengths=lengths)
        further = dict(logits_soft_cap=30.0, return_residual=True)
    settings = base.Options(structure=structure, positions_first=positions_first, **further)
    with targets.abstract_gpu(target):  # check() as the op's GPU branch runs it: its own reason
        impl.check(
            qkv, kv, kv, biases, mask_spec, compute_dtype=dt, options=settings, platform="gpu"
        )
    targets.compile(step, *args, target=target)
    plan = impl._make(qkv, kv, kv, biases, mask_spec, 1.0, dt, settings)  # __call__'s (live rows)
    return mosaic_kernels.shared_memory_bytes(plan), mosaic_kernels.forward_bytes(plan)


def verdict(case: dict[str, Any], stats: dict[str, Any]) -> list[str]:
    """What is wrong (empty: nothing): a compile error, a missing kernel, spills, no wgmma,
    shared memory over the H100's."""
    from gated_attention.attention.pallas_mosaic_gpu import implementation as mosaic

    if "error" in stats:
        return [f"compile failed: {stats['error']}"]
    if "refused" in stats:
        return []
    problems = []
    for name in KERNELS:
        k = stats["kernels"].get(name)
        if k is None or "registers" not in k:
            problems.append(f"{name}: not found")
            continue
        if k["spill_store_bytes"] or k["spill_load_bytes"]:
            problems.append(f"{name}: spills {k['spill_store_bytes']} B")
        if not k["wgmma"]:
            problems.append(f"{name}: no wgmma")
    if stats["shared_memory_bytes"] > mosaic.SHARED_MEMORY_LIMIT:
        problems.append(
            f"shared memory {stats['shared_memory_bytes']} > {mosaic.SHARED_MEMORY_LIMIT}"
        )
    return problems


def run(cases, target: str = "h100", per_child: int = 8, log=print) -> list[dict[str, Any]]:
    """Rows {case, kernels, shared_memory_bytes, problems} for the cases, compiled in children of
    `per_child` cases (DUMPS set in their environment); a child that dies fails each of its
    cases."""

    def row(case, stats):
        return dict(case=case, **stats, problems=verdict(case, stats))

    def failed(case, error):
        return row(case, dict(kernels={}, shared_memory_bytes=0, error=str(error)[-200:]))

    return common.run(
        "gated_attention_tools.kernel_matrix.pallas_mosaic_gpu:compile_cases",
        target, cases, row, failed, per_child=per_child, env=DUMPS, log=log,
    )  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    bad = [r for r in rows if r["problems"]]
    refused = [r for r in rows if "refused" in r]
    lines = [
        f"# Mosaic GPU kernels compiled for {result['target']} (jax {result['jax']})",
        "",
        f"{len(rows)} cases: {len(refused)} refused by MosaicAttention.check ('auto' takes the "
        f"Triton kernel there), {len(rows) - len(bad) - len(refused)} compiled with no problem "
        "(0 spills, wgmma in every kernel, shared memory within the H100's 232,448 bytes per "
        f"block), {len(bad)} with a problem.",
        "",
    ]
    columns = ("case", "kernel", "registers", "spill stores (B)", "wgmma", "shared memory (B)")
    right = ("registers", "spill stores (B)", "shared memory (B)")
    lines += common.table((*columns, "problems"), _table_rows(rows), right)
    return "\n".join(lines) + "\n"


def _table_rows(rows):
    for r in rows:
        name = common.case_name(r["case"])
        if "refused" in r:
            yield f"| {name} | (refused) | | | | | {r['refused']} |"
            continue
        for kernel in KERNELS:
            k = r.get("kernels", {}).get(kernel, {})
            yield (
                name, kernel.removeprefix("gated_attention_mosaic_"), k.get("registers", ""),
                k.get("spill_store_bytes", ""), ", ".join(k.get("wgmma", [])),
                r.get("shared_memory_bytes", ""), "; ".join(r["problems"]) or r.get("refused", ""),
            )  # fmt: skip


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--per-child", type=int, default=8)
    args = parser.parse_args()
    cases = (matrix(False) + matrix(True))[: args.limit or None]
    rows = run(cases, per_child=args.per_child, log=lambda line: print(line, flush=True))
    import jax

    common.write(args.out, dict(target="h100", jax=jax.__version__, rows=rows), markdown)


if __name__ == "__main__":
    main()
