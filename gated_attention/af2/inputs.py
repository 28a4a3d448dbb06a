"""What the attention modules take: their data, masks and biases validated and laid out for
the op (ValueError or TypeError naming the argument, what it got and what was expected)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from gated_attention.af2 import config as config_lib
from gated_attention.core import checks


def check_data(q_data, m_data, q_name="q_data", m_name="m_data") -> None:
    for name, x in ((q_name, q_data), (m_name, m_data)):
        checks.check_float_array(name, x)
        if x.ndim < 3:
            raise ValueError(
                f"{name} must have rank >= 3 ([..., b, positions, channels]), got shape "
                f"{tuple(x.shape)}"
            )
    if q_data.ndim != m_data.ndim or q_data.shape[:-2] != m_data.shape[:-2]:
        raise ValueError(
            f"{q_name} {tuple(q_data.shape)} and {m_name} {tuple(m_data.shape)} must have "
            "the same batch dimensions [..., b]"
        )
    if q_data.dtype != m_data.dtype:
        raise TypeError(
            f"{q_name} and {m_name} must have the same dtype, got {q_data.dtype} and {m_data.dtype}"
        )


def positions_first(q_data, m_data, placement) -> tuple[tuple[int], int, int]:
    """((b,), q, k) of positions-first q_data [q, b, a] and m_data [k, b, m], validated; not with
    rows or positions split over devices (placement: a sharding.Placement)."""
    for name, x in (("q_data", q_data), ("m_data", m_data)):
        checks.check_float_array(name, x)
        if x.ndim != 3:
            raise ValueError(
                f"positions_first takes {name} of rank 3 ([positions, b, channels]), got shape "
                f"{tuple(x.shape)}"
            )
    if q_data.shape[1] != m_data.shape[1]:
        raise ValueError(
            f"positions_first: q_data {tuple(q_data.shape)} and m_data {tuple(m_data.shape)} "
            "must have the same batch b (their second dimension)"
        )
    if q_data.dtype != m_data.dtype:
        raise TypeError(
            f"q_data and m_data must have the same dtype, got {q_data.dtype} and {m_data.dtype}"
        )
    if placement.rows is not None or placement.keys is not None:
        raise ValueError(
            "positions_first does not take rows or positions split over devices "
            "(global_config.shard_rows_over / shard_columns_over): transpose to [b, q, a] first"
        )
    return (q_data.shape[1],), q_data.shape[0], m_data.shape[0]


def head_dims(cfg: config_lib.ModuleConfig, a: int, m: int) -> tuple[int, int]:
    key_dim = a if cfg.key_dim is None else cfg.key_dim
    value_dim = m if cfg.value_dim is None else cfg.value_dim
    num_head = cfg.num_head
    if key_dim % num_head:
        raise ValueError(f"{key_dim=} must be divisible by {num_head=}")
    if value_dim % num_head:
        raise ValueError(f"{value_dim=} must be divisible by {num_head=}")
    return key_dim // num_head, value_dim // num_head


def mask_or_bias(name, x, batch, heads, q_len, k_len):
    """A per-batch mask or bias as a rank len(batch)+3 array [..., b, h|1, q|1, k|1].

    Rank len(batch)+3 is taken as [..., b, h, q, k]; rank len(batch)+2 as [..., b, q, k], shared
    by every head. Each dimension must be 1 or equal.
    """
    full4 = (*batch, heads, q_len, k_len)
    shape = tuple(x.shape)
    if x.ndim == len(batch) + 2:
        x = jnp.expand_dims(x, -3)
    if x.ndim != len(full4):
        fix = ""
        if x.ndim == len(batch) + 1 and x.shape[-1] in (1, k_len):  # [..., b, k]: a key mask
            fix = f"; a key mask [..., b, k] is {name}[..., :, None, None, :]"
        raise ValueError(
            f"{name} of shape {shape} must have the rank of [..., b, h, q, k] = {full4} "
            f"or of [..., b, q, k] = {(*batch, q_len, k_len)} (no leading dimension is added), "
            f"each dimension 1 or equal; got rank {len(shape)}{fix}"
        )
    if any(d not in (1, t) for d, t in zip(x.shape, full4, strict=True)):
        desc = "[..., b, h, q, k]" if len(shape) == len(full4) else "[..., b, q, k]"
        target = full4 if len(shape) == len(full4) else (*batch, q_len, k_len)
        raise ValueError(
            f"{name} of shape {shape} does not broadcast to {desc} = {target} (each dimension "
            f"1 or equal){checks.mismatch(shape, target, desc)}"
        )
    return x


def nonbatched(nonbatched_bias, batch, heads, q_len, k_len, ring: int = 1):
    """nonbatched_bias [h, q, k] or [q, k] -> [1, ..., 1, h|1, q, k], shared over the batch.
    ring > 1 (inside a shard_map over shard_columns_over's ring devices): q may also be every
    device's queries, q * ring (ring.py: each device slices its own)."""
    checks.check_float_array("nonbatched_bias", nonbatched_bias)
    shape = tuple(nonbatched_bias.shape)
    allowed = {(heads, q, k_len) for q in (q_len, q_len * ring)}
    allowed |= {s[1:] for s in allowed}
    if shape not in allowed:
        also = f" (or q = {q_len * ring}: every device's queries)" if ring > 1 else ""
        raise ValueError(
            f"nonbatched_bias of shape {shape} must be [h, q, k] = {(heads, q_len, k_len)} "
            f"or [q, k] = {(q_len, k_len)}{also}"
        )
    x = nonbatched_bias if len(shape) == 3 else nonbatched_bias[None]
    return x.reshape((1,) * len(batch) + x.shape)


def mask_and_biases(mask, nonbatched_bias, bias, batch, heads, q_len, k_len, ring: int = 1):
    """Attention's mask and biases, validated, each [..., b|1, h|1, q|1, k|1]."""
    biases = []
    if nonbatched_bias is not None:
        biases.append(nonbatched(nonbatched_bias, batch, heads, q_len, k_len, ring))
    if bias is not None:
        checks.check_float_array("bias", bias)
        biases.append(mask_or_bias("bias", bias, batch, heads, q_len, k_len))
    if mask is not None:
        checks.check_bool_mask("mask", mask)
        mask = mask_or_bias("mask", mask, batch, heads, q_len, k_len)
    return mask, biases


def check_subbatch_size(subbatch_size: Any) -> None:
    if subbatch_size not in (None, "auto"):
        try:
            checks.check_int("subbatch_size", subbatch_size)
        except ValueError:
            raise ValueError(
                f"subbatch_size must be None, 'auto' or an int >= 1, got {subbatch_size!r}"
            ) from None


def global_mask(q_mask, batch, q_len, positions_first=False):
    """q_mask [..., b, q, 1] or [..., b, q], bool or float -> [..., b, q, 1] ([q, b, 1] or [q, b]
    -> [q, b, 1] with positions_first)."""
    dtype = jnp.result_type(q_mask)
    if dtype != jnp.bool_ and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"q_mask must be bool or float 0/1, got dtype {dtype}")
    shape, lead = tuple(q_mask.shape), (q_len, *batch) if positions_first else (*batch, q_len)
    names = "[q, b" if positions_first else "[..., b, q"
    if shape == lead:
        return q_mask[..., None]
    if shape != (*lead, 1):
        raise ValueError(
            f"q_mask of shape {shape} must be {names}, 1] = {(*lead, 1)} or {names}] = {lead}"
        )
    return q_mask
