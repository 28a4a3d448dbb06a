"""What the kernel matrix's backends share: the case schema, the matrix of cases, the op's program
of a GPU case, the loop that compiles cases for a target in child processes, and the writing of
results with their markdown summary.

A case is a dict of FIELDS (as the results files hold it): dtype, head dim, bias and mask forms
(BIASES, MASKS), for float32 a precision (PRECISIONS), whether the op's further arguments come
too (`options`), and the problem's sizes where they are not the backend's Sizes. Each backend
gives the forms their operands' shapes (letters over [B, N, T, S], '1' broadcast): BIAS_SHAPES
and MASK_SHAPES here for the GPU kernels, the TPU's own 'both' (AF2's row attention) in
pallas_mosaic_tpu.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from gated_attention_tools import targets

FIELDS = {
    "dtype": "the inputs' dtype (DTYPES)",
    "head_dim": "q's, k's and v's head dim",
    "bias": "a BIASES form",
    "mask": "a MASKS form",
    "precision": "a PRECISIONS level, float32's (half precision ignores it; TPU cases have none)",
    "options": "the op's further arguments too: fewer key/value heads than query heads, causal, "
    "a window, both sequence lengths (traced), a soft cap and the residual",
    "batch": "B: q [B, T, N, head_dim], k and v [B, S, N (fewer with options), head_dim]",
    "q_len": "T, the queries",
    "k_len": "S, the keys",
    "heads": "N, the query heads",
    "positions_first": "q, k and v [T|S, B, N, head_dim] and the op's positions_first: the "
    "kernels' in-place column reads",
    "rows_per_program": "the Mosaic GPU forward's batch rows a program (MosaicAttention's)",
    "consumer_warpgroups": "the Mosaic GPU forward's compute warpgroups a program "
    "(MosaicAttention's)",
    "block_k": "the Mosaic GPU kernels' keys a tile (MosaicAttention's; None: its rule)",
    "persistent": "the Mosaic GPU forward as one program per multiprocessor (MosaicAttention's)",
}
REQUIRED = ("dtype", "head_dim", "bias", "mask")
DTYPES = ("float32", "bfloat16", "float16")
BIASES = ("shared", "per_row", "both", "none")
MASKS = ("key", "full", "none")
PRECISIONS = ("default", "high", "highest")  # float32 only; half precision ignores it
# The GPU cases' operands (case_program): 'both' is a shared and a per-row bias.
BIAS_SHAPES = {"shared": ("1NTS",), "per_row": ("BNTS",), "both": ("1NTS", "BNTS"), "none": ()}
MASK_SHAPES = {"key": "B11S", "full": "BNTS", "none": None}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A case's problem sizes (FIELDS' batch, q_len, k_len, heads); the defaults are the GPU
    matrices', lengths no tile divides."""

    batch: int = 2
    q_len: int = 200
    k_len: int = 136
    heads: int = 2

    def of(self, case: dict[str, Any]) -> Sizes:
        """These sizes with the case's own where it gives them."""
        given = {f.name: case[f.name] for f in dataclasses.fields(self) if f.name in case}
        return dataclasses.replace(self, **given)

    def shape(self, spec: str) -> tuple[int, ...]:
        """An operand's shape from its letters over [B, N, T, S] ('1' broadcast)."""
        sizes = {"B": self.batch, "N": self.heads, "T": self.q_len, "S": self.k_len, "1": 1}
        return tuple(sizes[c] for c in spec)


def check(case: dict[str, Any]) -> dict[str, Any]:
    """The case, if it is one (FIELDS, REQUIRED, the forms and levels); else a ValueError."""
    unknown = set(case) - set(FIELDS)
    missing = [f for f in REQUIRED if f not in case]
    if unknown or missing:
        raise ValueError(f"{case}: unknown fields {sorted(unknown)}, missing {missing}")
    if case["bias"] not in BIASES or case["mask"] not in MASKS:
        raise ValueError(f"{case}: bias one of {BIASES}, mask one of {MASKS}")
    if case.get("precision", "default") not in PRECISIONS:
        raise ValueError(f"{case}: precision one of {PRECISIONS}")
    return case


def matrix(
    dtypes: Iterable[str],
    head_dims: Iterable[int],
    biases: Iterable[str] = BIASES,
    masks: Iterable[str] = MASKS,
    precisions: Sequence[str] | None = None,
    options: bool = False,
) -> list[dict[str, Any]]:
    """Cases by dtype x head dim x bias x mask; with `precisions`, float32 at each of them (half
    precision at 'default'), without, no precision field; with `options`, options=True."""
    cases = []
    for dtype, head_dim, bias, mask in itertools.product(dtypes, head_dims, biases, masks):
        case = dict(dtype=dtype, head_dim=head_dim, bias=bias, mask=mask)
        if precisions is None:
            levels = [case]
        else:
            levels = [
                dict(case, precision=p)
                for p in (precisions if dtype == "float32" else ("default",))
            ]
        cases += [dict(c, options=True) if options else c for c in levels]
    return cases


def case_name(case: dict[str, Any], sizes: Sizes = Sizes(), batch: bool = False) -> str:
    """'float32 high H32 bias=both mask=key T=200 S=136 +options' (with `batch`, B= too); the
    lengths the case's or else `sizes`'."""
    precision = (
        f" {case['precision']}" if case["dtype"] == "float32" and "precision" in case else ""
    )
    sizes = sizes.of(case)
    return (
        f"{case['dtype']}{precision} H{case['head_dim']} bias={case['bias']} mask={case['mask']} "
        + (f"B={sizes.batch} " if batch else "")
        + f"T={sizes.q_len} S={sizes.k_len}"
        + (" +options" if case.get("options") else "")
        + (" +positions_first" if case.get("positions_first") else "")
        + (f" R={case['rows_per_program']}" if case.get("rows_per_program") else "")
        + (f" C={case['consumer_warpgroups']}" if case.get("consumer_warpgroups") else "")
        + (f" bk={case['block_k']}" if case.get("block_k") else "")
        + (" persistent" if case.get("persistent") else "")
    )


def case_program(
    impl, dtype, head_dim, bias, mask, precision=None, options=False, batch=2, q_len=200,
    k_len=136, heads=2, positions_first=False,
):  # fmt: skip
    """(step, abstract args) of one GPU case: the op's forward and vjp through
    ga.dot_product_attention with `impl`. `bias` a BIASES form, `mask` a MASKS form (BIAS_SHAPES,
    MASK_SHAPES); with `options`, the op's further arguments too: one key/value head under the
    query heads, causal, a (96, 0) window, both sequence lengths (traced), a soft cap and the
    residual; with `positions_first`, q, k, v and the cotangent [T|S, B, N, head_dim]."""
    import jax
    import jax.numpy as jnp

    import gated_attention as ga

    dt = jnp.dtype(dtype)
    sizes = Sizes(batch, q_len, k_len, heads)
    rows = lambda length: (length, batch) if positions_first else (batch, length)
    qkv = jax.ShapeDtypeStruct((*rows(q_len), heads, head_dim), dt)
    kv = jax.ShapeDtypeStruct((*rows(k_len), 1 if options else heads, head_dim), dt)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32) if options else None
    biases = tuple(jax.ShapeDtypeStruct(sizes.shape(s), dt) for s in BIAS_SHAPES[bias])
    mask_spec = None
    if MASK_SHAPES[mask] is not None:
        mask_spec = jax.ShapeDtypeStruct(sizes.shape(MASK_SHAPES[mask]), jnp.bool_)

    def step(q, k, v, biases, mask, lengths, cotangent):
        extra = {}
        if options:
            extra = dict(
                is_causal=True,
                local_window_size=(96, 0),
                query_seq_lengths=lengths,
                key_value_seq_lengths=lengths,
                logits_soft_cap=30.0,
            )

        def attend(q, k, v, biases):  # -> (out, residual or None)
            result = ga.dot_product_attention(
                q, k, v, list(biases) or None, mask, implementation=impl, compute_dtype="input",
                precision=precision, return_residual=options, positions_first=positions_first,
                **extra,
            )  # fmt: skip
            return result if options else (result, None)

        out, vjp, residual = jax.vjp(attend, q, k, v, tuple(biases), has_aux=True)
        return out, residual, vjp(cotangent)

    return step, (qkv, kv, kv, biases, mask_spec, lengths, qkv)


def run(
    function: str,
    target: str,
    cases: Sequence[dict[str, Any]],
    row: Callable[[dict, Any], dict],
    failed: Callable[[dict, RuntimeError], dict] | None = None,
    per_child: int = 1,
    env: dict[str, str] | None = None,
    log: Callable[[str], None] | None = None,
    name: Callable[[dict], str] = case_name,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """The cases' rows, compiled for `target` in fresh processes set up for deviceless compiles
    (targets.in_child, with `env`), `per_child` cases each (0: all in one): `function`
    ('module:function') is called there as function(target=, cases=, **kwargs) and returns one
    result per case, which `row(case, result)` makes the case's row. Where a child dies (a
    RuntimeError) `failed(case, error)` makes the row of each case it had (None: the error
    propagates). `log` gets '[i/n] name: problems (or ok)' a row, the row's `problems`."""
    rows = []
    for case in cases:
        check(case)
    step = per_child or max(len(cases), 1)
    for start in range(0, len(cases), step):
        batch = list(cases[start : start + step])
        try:
            results = targets.in_child(
                function, dict(target=target, cases=batch, **kwargs), env=env
            )
        except RuntimeError as e:
            if failed is None:
                raise
            made = [failed(case, e) for case in batch]
        else:
            made = [row(case, result) for case, result in zip(batch, results, strict=True)]
        for case, made_row in zip(batch, made, strict=True):
            rows.append(made_row)
            if log is not None:
                problems = "; ".join(made_row["problems"]) or "ok"
                log(f"[{len(rows)}/{len(cases)}] {name(case)}: {problems}")
    return rows


def failure(error: RuntimeError) -> str:
    """A failed child's last line of stderr, as a row's problem."""
    return f"compile failed: {str(error).strip().splitlines()[-1][:200]}"


def parser(doc: str, limit: bool = True) -> argparse.ArgumentParser:
    """A command's parser (its description the doc's first paragraph) with --out (and --limit)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the .json path (a .md is written beside)")
    if limit:
        parser.add_argument("--limit", type=int, default=0, help="first N cases only (0: all)")
    return parser


def write(
    out: str | Path,
    result: dict[str, Any],
    markdown: Callable[[dict], str],
    newline: bool = False,
) -> Path:
    """Writes the result as JSON to `out` (a final newline with `newline`) and its markdown
    summary beside it (.md)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + ("\n" if newline else ""))
    out.with_suffix(".md").write_text(markdown(result))
    print(f"wrote {out.resolve()} and {out.with_suffix('.md').resolve()}", flush=True)
    return out


def cells(values: Iterable[Any]) -> str:
    """One markdown table line."""
    return "| " + " | ".join(map(str, values)) + " |"


def table(
    columns: Sequence[str], rows: Iterable[Sequence[Any] | str], right: Collection[str] = ()
) -> list[str]:
    """A markdown table's lines: the header, its rule (the `right` columns right-aligned), a line
    per row (a row given as a string passes as it is)."""
    lines = [cells(columns), cells("---:" if c in right else "---" for c in columns)]
    return lines + [r if isinstance(r, str) else cells(r) for r in rows]
