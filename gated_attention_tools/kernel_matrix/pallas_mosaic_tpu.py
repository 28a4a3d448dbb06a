"""The Mosaic TPU kernels (gated_attention/attention/pallas_mosaic_tpu/) compiled for TPU targets by libtpu, deviceless.

For one case (common.FIELDS: dtype, head dim, bias and mask forms, lengths) `compile_case` asks
PallasTpuAttention.check whether it takes the case on a TPU, then compiles the op's forward and
its gradient (the cotangent an argument) for the target, and reads (`read`) which Mosaic kernels
the program holds and its device memory. Mosaic fails a compile whose kernels exceed the scoped
VMEM, so a compile is the proof that every kernel fits. Nothing runs on a TPU: these say what
compiles, never how fast.

  python -m gated_attention_tools.kernel_matrix.pallas_mosaic_tpu --target v5e --out benchmark_results/tpu_kernels/v5e.json

compiles the whole case matrix in a child process and writes a markdown summary beside it.
"""

from __future__ import annotations

import time
from typing import Any

from gated_attention_tools import targets
from gated_attention_tools.kernel_matrix import common

KERNELS = (
    "gated_attention_tpu_forward",
    "gated_attention_tpu_dkdv",
    "gated_attention_tpu_dq",
    "gated_attention_tpu_dbias",
)
DTYPES = ("float32", "bfloat16")
HEAD_DIMS = (8, 16, 32, 64, 128)
# The bias forms' operands over [B, N, T, S] ('1' broadcast): 'both' is AF2's row attention.
BIAS_SHAPES = {"shared": ("1NTS",), "per_row": ("BNTS",), "both": ("1NTS", "B11S"), "none": ()}
MASK_SHAPES = common.MASK_SHAPES
SIZES = common.Sizes(batch=2, q_len=300, k_len=260, heads=4)  # lengths no tile (128) divides


def case_name(case: dict[str, Any]) -> str:
    return common.case_name(case, SIZES, batch=True)


def compile_case(
    target: str,
    dtype: str,
    head_dim: int,
    bias: str,
    mask: str,
    batch: int = SIZES.batch,
    q_len: int = SIZES.q_len,
    k_len: int = SIZES.k_len,
    heads: int = SIZES.heads,
    options: bool = False,
) -> dict[str, Any]:
    """Compiles one case's forward and gradient with PallasTpuAttention for `target` (call in a
    process set up by targets.in_child). With `options`, the op's further arguments too: 2 key/value
    heads under the query heads, causal, a window, both sequence lengths, a soft cap and the
    residual. Returns accepted (check's verdict), kernels (the Mosaic kernels in the program),
    memory (targets.memory), seconds, and error (None if it compiled)."""
    import jax
    import jax.numpy as jnp

    from gated_attention import PallasTpuAttention
    from gated_attention.attention import base
    from gated_attention.core import masking

    sizes = common.Sizes(batch, q_len, k_len, heads)
    dt = jnp.dtype(dtype)
    sd = jax.ShapeDtypeStruct
    q = sd((batch, q_len, heads, head_dim), dt)
    kv = sd((batch, k_len, heads // 2 if options else heads, head_dim), dt)
    lengths = sd((batch,), jnp.int32) if options else None
    opts = base.PLAIN
    biases = [sd(sizes.shape(spec), dt) for spec in BIAS_SHAPES[bias]]
    mask_spec = MASK_SHAPES[mask]
    mask_arg = None if mask_spec is None else sd(sizes.shape(mask_spec), jnp.bool_)
    impl = PallasTpuAttention()
    result: dict[str, Any] = {}
    if options:
        structure = masking.StructuredMask(True, (200, 0), lengths, lengths)
        opts = base.Options(structure, logits_soft_cap=30.0, return_residual=True)
    try:
        impl.check(
            q, kv, kv, tuple(biases), mask_arg, compute_dtype=dt, options=opts, platform="tpu"
        )
        result["accepted"] = True
    except NotImplementedError as e:
        return dict(accepted=False, reason=str(e), kernels=[], memory=None, error=None)

    def step(q, k, v, biases, mask, lengths, cotangent):
        call = opts
        if options:  # the lengths as traced arguments, as a model passes them
            call = base.Options(
                masking.StructuredMask(True, (200, 0), lengths, lengths),
                logits_soft_cap=30.0,
                return_residual=True,
            )

        def f(q, k, v, biases):
            out = impl(q, k, v, tuple(biases), mask, scale=0.3, compute_dtype=dt, options=call)
            return out[0] if options else out

        _, vjp = jax.vjp(f, q, k, v, biases)
        return vjp(cotangent)

    start = time.perf_counter()
    try:
        compiled = targets.compile(step, q, kv, kv, biases, mask_arg, lengths, q, target=target)
    except Exception as e:  # noqa: BLE001 - the compiler's error is the result
        return dict(result, kernels=[], memory=None, error=f"{type(e).__name__}: {e}"[:300])
    return dict(result, **read(compiled), seconds=round(time.perf_counter() - start, 1), error=None)


def read(compiled) -> dict[str, Any]:
    """What a compile says: the Mosaic kernels in the program (a compile is the proof each fits
    the scoped VMEM) and its device memory (targets.memory)."""
    text = compiled.as_text()
    return dict(kernels=[k for k in KERNELS if k in text], memory=targets.memory(compiled))


def compile_cases(target: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """compile_case for several cases in one process (libtpu starts once; common.run)."""
    return [compile_case(target, **case) for case in cases]


def matrix() -> list[dict[str, Any]]:
    """Every dtype x head dim x bias form x mask form at lengths no tile divides (300 queries,
    260 keys in tiles of 128), and AF2's triangle (4 heads of 32, shared bias, key mask) at N_res
    2,048 in bfloat16 and 1,024 in float32."""
    cases = common.matrix(DTYPES, HEAD_DIMS)
    # every further argument of the op at once, each dtype and two head dims
    cases += common.matrix(DTYPES, (32, 128), ("both",), ("key",), options=True)
    for dtype, n_res in (("bfloat16", 2048), ("float32", 1024)):  # what fits a v5e's 16 GB
        cases.append(
            dict(
                dtype=dtype,
                head_dim=32,
                bias="shared",
                mask="key",
                batch=n_res,
                q_len=n_res,
                k_len=n_res,
            )
        )
    return cases


def verdict(result: dict[str, Any]) -> list[str]:
    """What is wrong with one compiled case ([] if nothing): a refusal, an error, a kernel
    missing."""
    if not result["accepted"]:
        return [f"refused: {result['reason']}"]
    if result["error"]:
        return [result["error"]]
    missing = [k for k in KERNELS[:3] if k not in result["kernels"]]
    return [f"kernel missing: {k}" for k in missing]


def run(target: str, cases) -> list[dict[str, Any]]:
    """Rows (the case's fields, name, problems, compile_case's result) for the cases, compiled
    in one child process (a compiler crash raises a RuntimeError)."""

    def row(case, result):
        return dict(case, name=case_name(case), problems=verdict(result), **result)

    return common.run(
        "gated_attention_tools.kernel_matrix.pallas_mosaic_tpu:compile_cases",
        target, cases, row, per_child=0,
    )  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# Pallas TPU kernels compiled for {result['target']} (deviceless; no time measured)",
        "",
        f"jax {result['jax']}, libtpu {result['libtpu']}; forward and gradient of each case, the "
        "cotangent an argument. A compile within the scoped VMEM is what Mosaic allows, so "
        "'compiles' means every kernel fits.",
        "",
        f"{result['compiled']} of {len(result['cases'])} cases compile; "
        f"{result['refused']} refused by check().",
        "",
    ]
    columns = ("case", "kernels", "peak MiB", "temp MiB", "seconds", "problems")
    lines += common.table(columns, map(_table_row, result["cases"]), columns[2:5])
    return "\n".join(lines) + "\n"


def _table_row(case: dict[str, Any]) -> tuple:
    memory = case["memory"] or {}
    mib = lambda k: f"{memory[k] / 2**20:.1f}" if k in memory else ""
    kernels = ", ".join(k.removeprefix("gated_attention_tpu_") for k in case["kernels"])
    problems = "; ".join(case["problems"]) or "none"
    return (case["name"], kernels, mib("peak"), mib("temp"), case.get("seconds", ""), problems)


def main(argv=None) -> None:
    parser = common.parser(__doc__, limit=False)
    parser.add_argument("--target", required=True, choices=[t for t in targets.TARGETS])
    args = parser.parse_args(argv)
    if targets.TARGETS[args.target].kind != "tpu":
        parser.error(f"--target must be a TPU target, got {args.target!r}")
    reason = targets.missing(args.target)
    if reason:
        raise SystemExit(f"cannot compile for {args.target}: {reason}")
    import importlib.metadata

    import jax

    rows = run(args.target, matrix())
    result = dict(
        target=args.target,
        jax=jax.__version__,
        libtpu=importlib.metadata.version("libtpu"),
        compiled=sum(1 for r in rows if r["accepted"] and not r["error"]),
        refused=sum(1 for r in rows if not r["accepted"]),
        cases=rows,
    )
    out = common.write(args.out, result, markdown, newline=True)
    print(f"{result['compiled']} of {len(rows)} compile; {result['refused']} refused -> {out}")


if __name__ == "__main__":
    main()
