"""dot_product_attention: argument checks, layout handling and dispatch to an implementation.

The op layer knows nothing of Haiku. Every implementation takes the head-major layout
query [B, N, T, H], key [B, N, S, H], value [B, N, S, Hv], a tuple of biases (possibly empty) and a
mask or None, each of rank 4 with dimensions 1 or equal to [B, N, T, S], and returns [B, N, T, Hv] in query's dtype (see xla.py, the
specification). This module turns the public layouts into that one.

Dispatch is a table (IMPLEMENTATIONS). An explicitly named implementation never falls back; 'auto'
chooses by backend, shapes and memory budget, logs its choice at trace time, and the choice can be
inspected with `record_implementation_choices()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from gated_attention import chunked, cudnn, mapping, precision, sharding, xla

LAYOUTS = ("BTNH", "BNTH")

# Working-set budget for chunk sizes and the limits of 'auto' (global_config.memory_budget_mib
# sets it per module; config.py takes its default from here).
DEFAULT_MEMORY_BUDGET_BYTES = 256 * 2**20

# Largest float32 logits-and-weights working set of one batch row that 'auto' leaves to the dense
# implementation (which tiles over rows); longer rows go to the chunked one. See choose_implementation.
DENSE_ROW_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Tuning knobs an implementation may use; the dense one uses none.

    Attributes:
      query_chunk_size: query tile length for 'chunked' (None: chosen from the budget).
      key_chunk_size: key tile length for 'chunked' (None: chosen from the budget).
      memory_budget_bytes: working-set budget for 'auto' and for choosing chunk sizes.
      compute_dtype: the precision policy (precision.POLICIES): 'auto' computes bfloat16/float16
        inputs in float32 on CPU, 'input' in their own dtype, 'float32' in float32 everywhere.
    """

    query_chunk_size: int | None = None
    key_chunk_size: int | None = None
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    compute_dtype: str = "auto"

    def __post_init__(self):
        for name in ("query_chunk_size", "key_chunk_size"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
        budget = self.memory_budget_bytes
        if not _is_int(budget) or budget < 1:
            raise ValueError(f"memory_budget_bytes must be an int >= 1, got {budget!r}")
        precision.check_policy("compute_dtype", self.compute_dtype)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Implementation:
    """An entry of the dispatch table.

    Attributes:
      fn: fn(query, key, value, biases, mask, *, scale, options) in the head-major layout;
        biases is a tuple, added by the implementation (never summed whole beforehand).
      supports: fn(query, key, value, biases, mask) -> None if the implementation can take these
        inputs on the current backend, else a string saying why not.
      caller_row_tile: fn(batch, row_queries, row_logits) -> the batch rows per tile in which a
        caller able to run its whole computation per tile (the modules) should do so, or None.
      row_tile: fn(batch, heads, q_len, kv_len) -> the batch rows fn should be called on at a time,
        or None (the whole batch at once). dot_product_attention then runs fn per tile of rows,
        with the layout change and the compute-dtype cast inside the tile (no head-major copy of
        the whole query, key and value), each tile recomputed in the backward (jax.checkpoint).
    """

    fn: Callable[..., jax.Array]
    supports: Callable[..., str | None]
    caller_row_tile: Callable[[int, int, int], int | None] = lambda *args: None
    row_tile: Callable[[int, int, int, int], int | None] = lambda *args: None


def _always(*args) -> None:
    del args
    return None


def _chunked(query, key, value, bias, mask, *, scale, options):
    return chunked.chunked_attention(
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        query_chunk_size=options.query_chunk_size,
        key_chunk_size=options.key_chunk_size,
        memory_budget_bytes=options.memory_budget_bytes,
    )


IMPLEMENTATIONS: dict[str, Implementation] = {
    "xla": Implementation(xla.dense, _always, xla.caller_row_tile, xla.row_tile),
    "chunked": Implementation(_chunked, _always),
    "cudnn": Implementation(cudnn.attend, cudnn.supports),
}

_choice_log: list[list[dict[str, Any]]] = []


@contextlib.contextmanager
def record_implementation_choices() -> Iterator[list[dict[str, Any]]]:
    """Collects the implementation chosen by every dot_product_attention traced inside the block.

    Yields:
      A list that receives one dict per call: requested, chosen, reason and the head-major shapes.
    """
    record: list[dict[str, Any]] = []
    _choice_log.append(record)
    try:
        yield record
    finally:
        _choice_log.remove(record)


def implementation_names() -> tuple[str, ...]:
    """The names `implementation` accepts: 'auto' and every entry of the dispatch table."""
    return ("auto", *IMPLEMENTATIONS)


def choose_implementation(
    query, key, value, bias=None, mask=None, *, memory_budget_bytes: int | None = None
) -> tuple[str, str]:
    """The implementation 'auto' picks for head-major inputs, and why.

    Rules, in order: on GPU, 'cudnn' when it supports the inputs. Otherwise 'xla' when the float32
    logits and weights of one batch row, 2 * 4 * N * T * S bytes, fit in min(memory budget,
    DENSE_ROW_BYTES): the dense implementation then runs in tiles of rows, forward and backward
    (recomputing each tile), so its working set stays small whatever the batch. Otherwise (long
    sequences) 'chunked', whose query x key tiles bound the working set. Measured on 2 CPU cores
    with scripts/benchmark.py (float32 forward): the MSA-row shape and TriangleAttention at N_res
    256 and 512 ran 1.4-1.8x faster in row tiles than in query x key tiles (the 128^2 triangle was
    level); self-attention at 1 x 1,024 tokens and beyond ran 1.6-2.6x faster chunked.
    Arrays or jax.ShapeDtypeStructs are accepted.

    Returns:
      (name, reason).
    """
    budget = memory_budget_bytes or DEFAULT_MEMORY_BUDGET_BYTES
    if jax.default_backend() == "gpu" and "cudnn" in IMPLEMENTATIONS:
        why_not = IMPLEMENTATIONS["cudnn"].supports(query, key, value, bias, mask)
        if why_not is None:
            return "cudnn", "GPU backend and cuDNN supports these inputs"
    _, heads, q_len, _ = query.shape
    row_bytes = 2 * 4 * heads * q_len * key.shape[2]
    limit = min(budget, DENSE_ROW_BYTES)
    sizes = f"one row's dense logits need {_mib(row_bytes)} MiB, limit {_mib(limit)} MiB"
    if "chunked" in IMPLEMENTATIONS and row_bytes > limit:
        return "chunked", sizes
    return "xla", sizes


def caller_row_tile(
    implementation: str | None,
    query_shape: tuple[int, ...],
    key_shape: tuple[int, ...],
    dtype=jnp.float32,
    options: AttentionOptions | None = None,
) -> int | None:
    """Rows of the leading axis per tile for a caller that can run all its work per tile.

    A module whose rows are independent (projections, attention, gate, output) may run them in
    tiles of this many rows of its leading axis, which keeps a tile's whole working set in cache;
    None means it should not tile. Depends on the implementation dot_product_attention would use
    ('auto' resolved as it would be, without logging).

    Args:
      implementation: as for dot_product_attention.
      query_shape: [..., T, N, H] (the 'BTNH' layout); the leading axis is the one tiled.
      key_shape: [..., S, N, H].
      dtype: the dtype query and key will have.
      options: as for dot_product_attention.
    """
    options = AttentionOptions() if options is None else options
    name = "auto" if implementation is None else implementation
    if name not in IMPLEMENTATIONS and name != "auto":
        return None  # dot_product_attention raises the error
    *lead, q_len, heads, head_dim = query_shape
    if not lead:
        return None
    if name == "auto":
        rows = math.prod(lead)
        q = jax.ShapeDtypeStruct((rows, heads, q_len, head_dim), dtype)
        k = jax.ShapeDtypeStruct((rows, heads, key_shape[-3], head_dim), dtype)
        name, _ = choose_implementation(q, k, k, memory_budget_bytes=options.memory_budget_bytes)
    row_queries = math.prod(lead[1:]) * q_len
    return IMPLEMENTATIONS[name].caller_row_tile(
        lead[0], row_queries, row_queries * heads * key_shape[-3]
    )


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.3g}"


def _resolve(name, query, key, value, bias, mask, options: AttentionOptions) -> str:
    requested = "auto" if name is None else name
    if requested not in implementation_names():
        raise ValueError(
            f"implementation must be one of {implementation_names()} or None, got {requested!r}"
        )
    if requested == "auto":
        chosen, reason = choose_implementation(
            query, key, value, bias, mask, memory_budget_bytes=options.memory_budget_bytes
        )
    else:
        why_not = IMPLEMENTATIONS[requested].supports(query, key, value, bias, mask)
        if why_not is not None:
            raise NotImplementedError(
                f"implementation={requested!r} cannot take these inputs: {why_not}"
            )
        chosen, reason = requested, "requested explicitly"
    logging.log_first_n(
        logging.INFO,
        "dot_product_attention: %s -> %s (%s), query %s",
        20,
        requested,
        chosen,
        reason,
        tuple(query.shape),
    )
    for record in _choice_log:
        record.append(
            dict(
                requested=requested,
                chosen=chosen,
                reason=reason,
                query=tuple(query.shape),
                key=tuple(key.shape),
                value=tuple(value.shape),
            )
        )
    return chosen


def _check_dtype(name: str, x, kind: str) -> None:
    dtype = jnp.result_type(x)
    if kind == "bool" and dtype != jnp.bool_:
        raise TypeError(
            f"{name} must be a boolean array (True = attend), got dtype {dtype}; pass an additive "
            "float bias as bias= instead"
        )
    if kind == "float" and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {dtype}")


def _check_broadcastable(name: str, x, target: tuple[int, ...], target_desc: str) -> None:
    shape = tuple(x.shape)
    if len(shape) != len(target) or any(
        d not in (1, t) for d, t in zip(shape, target, strict=True)
    ):
        raise ValueError(
            f"{name} of shape {shape} must have rank {len(target)} and broadcast to {target_desc} "
            f"= {target} (each dimension 1 or equal)"
        )


def _check_qkv(query, key, value, layout: str) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check_dtype(name, x, "float")
        if x.ndim < 3:
            raise ValueError(
                f"{name} must have rank >= 3 ([..., T, N, H] for layout {layout!r}), "
                f"got shape {tuple(x.shape)}"
            )
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(
            f"query, key and value must have the same rank, got shapes {tuple(query.shape)}, "
            f"{tuple(key.shape)} and {tuple(value.shape)}"
        )
    seq, head = (-3, -2) if layout == "BTNH" else (-2, -3)
    letters = "[..., T, N, H]" if layout == "BTNH" else "[..., N, T, H]"
    q, k, v = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    problems = []
    if not q[:-3] == k[:-3] == v[:-3]:
        problems.append(f"batch dimensions differ: {q[:-3]}, {k[:-3]}, {v[:-3]}")
    if not q[head] == k[head] == v[head]:
        problems.append(f"head counts N differ: {q[head]}, {k[head]}, {v[head]}")
    if k[seq] != v[seq]:
        problems.append(f"key and value lengths S differ: {k[seq]} != {v[seq]}")
    if q[-1] != k[-1]:
        problems.append(f"query and key head dims H differ: {q[-1]} != {k[-1]}")
    if problems:
        raise ValueError(
            f"query {q}, key {k} and value {v} (layout {letters}) do not fit: "
            + "; ".join(problems)
        )


def _flatten_batch(x, batch_dims: tuple[int, ...]):
    """[..., x, y, z] with leading dims 1 or equal to batch_dims -> [B or 1, x, y, z]."""
    lead = tuple(x.shape[:-3])
    if all(d == 1 for d in lead):
        return x.reshape((1, *x.shape[-3:]))
    if lead != batch_dims:
        # Mixed broadcasting over several leading axes: materialize only those axes.
        x = jnp.broadcast_to(x, (*batch_dims, *x.shape[-3:]))
    return x.reshape((-1, *x.shape[-3:]))


def _check_biases(bias, target, target_desc) -> tuple:
    """bias (None, an array or a sequence of arrays) -> a tuple of validated arrays."""
    if bias is None:
        return ()
    biases = tuple(bias) if isinstance(bias, (list, tuple)) else (bias,)
    for i, b in enumerate(biases):
        name = "bias" if len(biases) == 1 else f"bias[{i}]"
        _check_dtype(name, b, "float")
        _check_broadcastable(name, b, target, target_desc)
    return biases


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | Sequence[jax.Array] | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    implementation: str | None = None,
    layout: str = "BTNH",
    options: AttentionOptions | None = None,
) -> jax.Array:
    """Softmax attention with an additive bias and a boolean mask, over several implementations.

    softmax(scale * q.k + bias, masked entries replaced by -1e9) . v, with logits and softmax in
    float32 (float64 for float64 inputs) whatever the input dtype. A fully masked query row gives the
    uniform average of the values (never NaN). bfloat16/float16 inputs are computed in float32 on
    CPU unless options.compute_dtype says otherwise (precision.py); the output has query's dtype.

    On a mesh with explicit axes, each device attends for its own batch rows, heads and queries,
    as the inputs are sharded, with no communication; keys and values sharded along S are
    gathered first (sharding.shard_attention). The output has query's sharding.

    Args:
      query: [..., T, N, H] (layout 'BTNH', jax.nn's) or [..., N, T, H] (layout 'BNTH').
      key: [..., S, N, H] or [..., N, S, H].
      value: [..., S, N, Hv] or [..., N, S, Hv].
      bias: None, a float array, or a sequence of float arrays added together; each has query's rank
        and broadcasts to [..., N, T, S] (each dimension 1 or equal). A bias whose batch dimensions
        are 1 stays shared over the batch.
      mask: None or a bool array of query's rank broadcastable to [..., N, T, S]; False = masked out.
      scale: logit scale, default H ** -0.5.
      implementation: None or 'auto' (choose), or a name from `implementation_names()`.
      layout: 'BTNH' or 'BNTH', the layout of query, key, value and the output.
      options: AttentionOptions (chunk sizes, memory budget).

    Returns:
      [..., T, N, Hv] ('BTNH') or [..., N, T, Hv] ('BNTH') in query's dtype.

    Raises:
      TypeError: a non-boolean mask, a non-float query/key/value/bias.
      ValueError: shapes that do not fit, an unknown implementation or layout.
      NotImplementedError: a named implementation that cannot take these inputs here.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    options = AttentionOptions() if options is None else options
    if not isinstance(options, AttentionOptions):
        raise TypeError(f"options must be an AttentionOptions, got {type(options).__name__}")
    _check_qkv(query, key, value, layout)
    seq, head = (-3, -2) if layout == "BTNH" else (-2, -3)
    batch_dims = tuple(query.shape[:-3])
    heads, q_len, kv_len = query.shape[head], query.shape[seq], key.shape[seq]
    target = (*batch_dims, heads, q_len, kv_len)
    target_desc = "[..., N, T, S]"
    biases = _check_biases(bias, target, target_desc)
    if mask is not None:
        _check_dtype("mask", mask, "bool")
        _check_broadcastable("mask", mask, target, target_desc)
    if scale is None:
        scale = query.shape[-1] ** -0.5
    out_dtype = query.dtype
    compute = precision.compute_dtype(out_dtype, options.compute_dtype)

    def attend(query, key, value, biases, mask):  # all of the inputs, or one device's shard
        batch_dims = tuple(query.shape[:-3])
        heads, q_len, kv_len = query.shape[head], query.shape[seq], key.shape[seq]
        q, k, v = (_flatten_batch(x, batch_dims) for x in (query, key, value))  # caller's layout
        biases = tuple(_flatten_batch(b, batch_dims) for b in biases)
        m = None if mask is None else _flatten_batch(mask, batch_dims)
        batch = q.shape[0]
        head_major = [
            jax.ShapeDtypeStruct((batch, heads, x.shape[seq], x.shape[-1]), compute)
            for x in (q, k, v)
        ]
        chosen = _resolve(implementation, *head_major, biases, m, options)
        impl = IMPLEMENTATIONS[chosen]

        def run(q, k, v, m, *biases):  # a tile of batch rows (or all of them)
            if layout == "BTNH":
                q, k, v = (jnp.swapaxes(x, -3, -2) for x in (q, k, v))
            if compute != out_dtype:  # biases are cast by the implementations, as for any dtype
                q, k, v = (x.astype(compute) for x in (q, k, v))
            out = impl.fn(q, k, v, biases, m, scale=scale, options=options).astype(out_dtype)
            return jnp.swapaxes(out, -3, -2) if layout == "BTNH" else out  # the caller's layout

        rows = impl.row_tile(batch, heads, q_len, kv_len)
        if rows is None:
            out = run(q, k, v, m, *biases)
        else:  # every arg's leading dim is batch (cut into tiles) or 1 (shared by every tile)
            out = mapping.subbatch(jax.checkpoint(run), [q, k, v, m, *biases], subbatch_size=rows)
        return out.reshape((*batch_dims, *out.shape[1:]))

    # On a mesh with explicit axes each device attends for its own rows, heads and queries.
    out = sharding.shard_attention(attend, query, key, value, biases, mask, layout)
    return attend(query, key, value, biases, mask) if out is None else out


def num_flops(query_shape, key_shape, value_shape) -> int:
    """Multiply-add FLOPs (2 per MAC) of the two attention matmuls for 'BTNH' shapes."""
    *lead, t, n, h = query_shape
    s, hv = key_shape[-3], value_shape[-1]
    return 2 * math.prod(lead) * n * t * s * (h + hv)
