"""The argument checks every layer uses at its boundary: one message per kind of mistake.

Each raises ValueError or TypeError naming the argument, what it got and what was expected.
Inside a layer (implementations, loops) inputs are trusted: there, `assert` states invariants.
"""

from __future__ import annotations

import operator
from numbers import Real
from typing import Any

import jax.numpy as jnp


def check_int(name: str, value: Any, *, minimum: int = 1, optional: bool = False) -> int | None:
    """value as an int >= minimum (numpy integers accepted, bools not); None passes if optional."""
    if value is None and optional:
        return None
    try:
        as_int = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        as_int = None
    if as_int is None or as_int < minimum:
        none = "None or " if optional else ""
        raise ValueError(f"{name} must be {none}an int >= {minimum}, got {value!r}")
    return as_int


def check_positive_number(name: str, value: Any, *, unit: str = "") -> None:
    """A real number > 0 (bools not), e.g. a size in MiB."""
    if isinstance(value, bool) or not isinstance(value, Real) or not value > 0:
        of = f" of {unit}" if unit else ""
        raise ValueError(f"{name} must be a positive number{of}, got {value!r}")


def check_bool(name: str, value: Any) -> None:
    """TypeError unless value is a bool (a wrong type, as every other type check here)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_one_of(name: str, value: Any, options: tuple) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")


def check_float_array(name: str, x: Any) -> None:
    """A float16/bfloat16/float32/float64 array; integer and 8-bit (quantized) dtypes refused."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {dtype}")
    if jnp.finfo(dtype).bits < 16:
        raise TypeError(
            f"{name} must be a floating-point array of at least 16 bits, got dtype {dtype} "
            "(quantized inputs are not supported: dequantize them first)"
        )


def check_rate(name: str, rate: Any) -> None:
    """A dropout rate: a real number in [0, 1)."""
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.0 <= rate < 1.0:
        raise ValueError(f"{name} must be a number in [0, 1), got {rate!r}")


def check_bool_mask(name: str, x: Any) -> None:
    dtype = jnp.result_type(x)
    if dtype != jnp.bool_:
        raise TypeError(
            f"{name} must be a boolean array (True = attend), got dtype {dtype}; pass an additive "
            "float bias as bias= instead"
        )


def check_right_aligned(name: str, shape: tuple, target: tuple, target_desc: str) -> tuple:
    """shape broadcasts to target right-aligned (rank <= target's, missing leading dimensions
    count as 1, each dimension 1 or equal); returns shape with those leading 1s."""
    shape = tuple(shape)
    full = (1,) * (len(target) - len(shape)) + shape
    if len(shape) > len(target) or any(d not in (1, t) for d, t in zip(full, target, strict=True)):
        raise ValueError(
            f"{name} of shape {shape} must broadcast to {target_desc} = {target}: aligned on the "
            f"right, rank <= {len(target)}, each dimension 1 or equal (missing leading dimensions "
            f"count as 1){mismatch(shape, target, target_desc)}"
        )
    return full


def mismatch(shape: tuple, target: tuple, target_desc: str) -> str:
    """'; got ...' naming what does not fit when shape is right-aligned to target: the rank, or
    each dimension that is neither 1 nor target's, by its letter in target_desc ('[..., N, T, S]')."""
    shape, target = tuple(shape), tuple(target)
    if len(shape) > len(target):
        return f"; got rank {len(shape)}, expected at most {len(target)}"
    letters = [x.strip() for x in target_desc.strip("[]").split(",") if x.strip() != "..."]
    offset = len(target) - len(shape)
    wrong = []
    for i, (d, t) in enumerate(zip(shape, target[offset:], strict=True)):
        if d not in (1, t):
            axis = i + offset - len(target)  # negative: counted from the right
            letter = letters[axis] if -axis <= len(letters) else "a batch dimension"
            wrong.append(f"dimension {i - len(shape)} ({letter}) is {d}, expected 1 or {t}")
    return "; " + ", ".join(wrong) if wrong else ""


def check_lengths(name: str, x: Any, batch_dims: tuple) -> None:
    """None, or an integer array of shape batch_dims ((1,) also for unbatched inputs, jax.nn's)."""
    if x is None:
        return
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be None or an integer array, got dtype {dtype}")
    shape = tuple(jnp.shape(x))
    if shape != tuple(batch_dims) and not (batch_dims == () and shape == (1,)):
        raise ValueError(
            f"{name} must have the batch shape of query, query.shape[:-3] = {tuple(batch_dims)}, "
            f"got shape {shape}"
        )


def check_qkv(query, key, value) -> None:
    """dot_product_attention's query [..., T, N, H], key [..., S, K, H] and value [..., S, K, Hv]:
    float arrays of one dtype and rank whose shapes fit (grouped-query heads: N % K == 0)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        check_float_array(name, x)
        if x.ndim < 3:
            raise ValueError(f"{name} must have rank >= 3 ([..., T, N, H]), got shape {x.shape}")
    q, k, v = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    if not len(q) == len(k) == len(v):
        raise ValueError(
            f"query, key and value must have the same rank (the same batch dimensions before "
            f"[T, N, H], [S, K, H], [S, K, Hv]), got ranks {len(q)}, {len(k)} and {len(v)}: "
            f"shapes {q}, {k} and {v}"
        )
    dtypes = [jnp.result_type(x) for x in (query, key, value)]
    if len(set(dtypes)) > 1:  # jax.nn raises too: no silent promotion of a half-precision query
        raise ValueError(
            "query, key and value must have the same dtype (as in jax.nn.dot_product_attention), "
            f"got {dtypes[0]}, {dtypes[1]} and {dtypes[2]}; cast them to one"
        )
    problems = []
    if not q[:-3] == k[:-3] == v[:-3]:
        problems.append(f"batch dimensions differ: {q[:-3]}, {k[:-3]}, {v[:-3]}")
    if k[-2] != v[-2]:
        problems.append(f"key and value head counts K differ: {k[-2]} != {v[-2]}")
    elif k[-2] and q[-2] % k[-2]:
        problems.append(
            f"query heads N={q[-2]} must be a multiple of key/value heads K={k[-2]} "
            "(grouped-query attention)"
        )
    if k[-3] != v[-3]:
        problems.append(f"key and value lengths S differ: {k[-3]} != {v[-3]}")
    if q[-1] != k[-1]:
        problems.append(f"query and key head dims H differ: {q[-1]} != {k[-1]}")
    if 0 in q[-3:] or 0 in k[-3:] or 0 in v[-1:]:
        problems.append("T, S, N, H and Hv must be non-empty")
    if problems:
        raise ValueError(
            f"query {q}, key {k} and value {v} (layout [..., T, N, H], [..., S, K, H]) do not fit: "
            + "; ".join(problems)
        )
