"""The tiles of the Pallas GPU kernels (attention/pallas_triton/implementation.py): (block_q, block_k, num_warps, num_stages) by
everything that decides them, read from tile_table.json beside this module.

The table is generated, never written by hand: `python -m
gated_attention_tools.kernel_matrix.tile_table` reads the kernel matrices' ptxas results
(benchmark_results/gpu_kernels/*.json, deviceless compiles for an A100, an H100 and a B200) and
keeps per key the tiles that compiled clean on every one of those targets in every case of the key
(0 spill bytes in all three kernels, shared memory within the A100's SHARED_MEMORY_LIMIT, MMA
instructions in every non-IEEE kernel; the generator's EXEMPT lets one key off the B200, where no
candidate compiled clean): the largest for the heaviest form (both biases, a full mask), else the
candidate nearest that. tests/attention/test_tile_table.py checks that the shipped table is what the
generator makes of the results. The committed results predate the rows' own `tiles` field
(kernel_matrix/pallas_triton.py now writes it): each was compiled once, with the tiles then in
force, so for them the generator reads those tiles from its record of the hand tables they ran
under (its UNRECORDED_*); a rerun with candidate tiles lets the rule choose.

A key is (dtype kind 'float32' | 'half', float32 dot precision level 'default' | 'high' |
'highest' (half precision: 'default'), head dim padded to a power of two >= MIN_TILE, whether the
op's further arguments are asked, bias form, mask form (kernel_form)).
"""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path

import jax.numpy as jnp
from jax import lax

MIN_TILE = 16  # Triton's dot needs at least 16 rows, columns and contraction elements
SHARED_MEMORY_LIMIT = 166_912  # an A100's opt-in shared memory per block, the smaller target's
FALLBACK = (16, 16, 4, 1)  # keys the table lacks: the smallest tiles, which compile everywhere
HEAVIEST_FORM = ("both", "full")  # the form a call that names none is looked up as
TABLE_FILE = Path(__file__).with_name("tile_table.json")
COLUMNS = (
    "dtype_kind",
    "precision",
    "head_dim",
    "options",
    "bias",
    "mask",
    "block_q",
    "block_k",
    "num_warps",
    "num_stages",
)


def load(path: Path = TABLE_FILE) -> types.MappingProxyType:
    """{key: (block_q, block_k, num_warps, num_stages)} from a table file."""
    data = json.loads(Path(path).read_text())
    if tuple(data["columns"]) != COLUMNS:
        raise ValueError(f"{path}: columns {data['columns']}, expected {list(COLUMNS)}")
    return types.MappingProxyType({tuple(row[:6]): tuple(row[6:]) for row in data["tiles"]})


@functools.cache
def table() -> types.MappingProxyType:
    """The shipped table, read on first use."""
    return load()


def _pow2_tile(n: int) -> int:
    return max(MIN_TILE, 1 << max(0, n - 1).bit_length())


def _dtype_kind(dtype) -> str:
    return "float32" if jnp.dtype(dtype) == jnp.float32 else "half"


def _precision_level(precision) -> str:
    if precision is None or precision == lax.Precision.DEFAULT:
        return "default"
    return "highest" if precision == lax.Precision.HIGHEST else "high"


def kernel_form(biases, mask) -> tuple[str, str]:
    """(bias form, mask form) of a call, the names of the kernel matrix's forms: 'shared' (batch
    dimension 1), 'per_row', 'both' or 'none'; 'key' ([B|1, 1, 1, S]), 'full' or 'none'."""
    shared = any(b.shape[0] == 1 for b in biases)
    per_row = any(b.shape[0] != 1 for b in biases)
    bias = {(True, True): "both", (True, False): "shared", (False, True): "per_row"}
    masks = "none" if mask is None else "key" if mask.shape[1] == mask.shape[2] == 1 else "full"
    return bias.get((shared, per_row), "none"), masks


def table_key(compute_dtype, precision, head_dim: int, options: bool = False, form=None) -> tuple:
    """The table's key of a call: `precision` is the float32 dots' (gpu_common.dot_precision), `form`
    the call's kernel_form (None: HEAVIEST_FORM)."""
    bias, mask = form or HEAVIEST_FORM
    level = _precision_level(precision)
    return (_dtype_kind(compute_dtype), level, _pow2_tile(head_dim), bool(options), bias, mask)


def lookup(compute_dtype, precision, head_dim: int, options: bool = False, form=None) -> tuple:
    """(block_q, block_k, num_warps, num_stages) for a call (table_key), FALLBACK where the table
    has no entry."""
    return table().get(table_key(compute_dtype, precision, head_dim, options, form), FALLBACK)
