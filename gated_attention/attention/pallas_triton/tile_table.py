"""The tiles of the Pallas GPU kernels (attention/pallas_triton/implementation.py): (block_q, block_k, num_warps, num_stages) by
everything that decides them, read from tile_table.json beside this module.

The table is generated, never written by hand: `python -m
gated_attention_tools.kernel_matrix.tile_table` reads the kernel matrices' ptxas results
(benchmark_results/gpu_kernels/*.json, deviceless compiles) and keeps per key the tiles that
compiled clean on every target of the key's shared-memory class in every case of the key (the
'large' class: an A100, an H100 and a B200; the 'small': an RTX 4090, sm_89, and an RTX PRO 6000
Blackwell, sm_120; clean: 0 spill bytes in all three kernels, shared memory within the class's
SHARED_MEMORY_CLASSES limit by ptxas and by the plan's estimate, MMA instructions in every
non-IEEE kernel; the generator's EXEMPT lets a few keys off the B200 or the RTX PRO 6000, where no
candidate compiled clean): the largest for the heaviest form (both biases, a full mask), else the
candidate nearest that. tests/attention/test_tile_table.py checks that the shipped table is what the
generator makes of the results. The committed results predate the rows' own `tiles` field
(kernel_matrix/pallas_triton.py now writes it): each was compiled once, with the tiles then in
force, so for them the generator reads those tiles from its record of the hand tables they ran
under (its UNRECORDED_*); a rerun with candidate tiles lets the rule choose.

A key is (shared-memory class 'large' | 'small', the GPU's (shared_memory_class), dtype kind 'float32' | 'half', float32 dot precision level 'default' | 'high' |
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

from gated_attention.core import platforms

MIN_TILE = 16  # Triton's dot needs at least 16 rows, columns and contraction elements
# The table's shared-memory classes by the least opt-in shared memory per block of their GPUs:
# 'large' the data-centre GPUs (an A100's 163 KiB; H100, B200 227 KiB), 'small' the consumer and
# workstation ones (99 KiB: sm_86 and sm_89, RTX 30 / 40, A10, L4, L40S; sm_120, RTX 50 and RTX
# PRO 6000). A GPU takes the largest class whose limit it has.
SHARED_MEMORY_CLASSES = types.MappingProxyType({"large": 166_912, "small": 101_376})
SHARED_MEMORY_LIMIT = SHARED_MEMORY_CLASSES["large"]  # an A100's, the large class's smallest
FALLBACK = (16, 16, 4, 1)  # keys the table lacks: the smallest tiles, which compile everywhere
HEAVIEST_FORM = ("both", "full")  # the form a call that names none is looked up as
TABLE_FILE = Path(__file__).with_name("tile_table.json")
COLUMNS = (
    "shared_memory",
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
    return types.MappingProxyType({tuple(row[:7]): tuple(row[7:]) for row in data["tiles"]})


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


def shared_memory_class(limit: int | None = None) -> str:
    """The SHARED_MEMORY_CLASSES name of a GPU with `limit` bytes of opt-in shared memory per block
    (None: the GPU being compiled for, platforms.gpu_shared_memory_per_block; with no GPU known,
    'large', the data-centre GPUs' tiles as before there were classes)."""
    if limit is None:
        limit = platforms.gpu_shared_memory_per_block()
        if limit is None:
            return "large"
    fits = [name for name, need in SHARED_MEMORY_CLASSES.items() if need <= limit]
    if not fits:
        raise ValueError(
            f"limit must be at least {min(SHARED_MEMORY_CLASSES.values()):,} bytes (the smallest "
            f"class's), got {limit:,}"
        )
    return max(fits, key=SHARED_MEMORY_CLASSES.get)


def table_key(
    compute_dtype, precision, head_dim: int, options: bool = False, form=None, shared_memory=None
) -> tuple:
    """The table's key of a call: `precision` is the float32 dots' (gpu_common.dot_precision), `form`
    the call's kernel_form (None: HEAVIEST_FORM), `shared_memory` a SHARED_MEMORY_CLASSES name
    (None: the GPU's, shared_memory_class)."""
    bias, mask = form or HEAVIEST_FORM
    level = _precision_level(precision)
    group = shared_memory_class() if shared_memory is None else shared_memory
    if group not in SHARED_MEMORY_CLASSES:
        raise ValueError(
            f"shared_memory must be one of {tuple(SHARED_MEMORY_CLASSES)}, got {group!r}"
        )
    kind = _dtype_kind(compute_dtype)
    return (group, kind, level, _pow2_tile(head_dim), bool(options), bias, mask)


def lookup(
    compute_dtype, precision, head_dim: int, options: bool = False, form=None, shared_memory=None
) -> tuple:
    """(block_q, block_k, num_warps, num_stages) for a call (table_key), FALLBACK where the table
    has no entry."""
    key = table_key(compute_dtype, precision, head_dim, options, form, shared_memory)
    return table().get(key, FALLBACK)
