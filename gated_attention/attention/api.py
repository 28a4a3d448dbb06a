"""dot_product_attention: one validation, one choice of implementation, one call.

The op layer knows nothing of Haiku. It validates the inputs once, flattens the batch dimensions to
one, asks dispatch.py once for each platform kind's implementation and plan (logging and recording
the choice), and calls it with that plan (base.py says what an implementation takes). On a mesh it
runs per device: over rows (shard_rows_over, or explicit axes: sharding.shard_attention) or over
key blocks in a ring (shard_keys_over, ring.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from gated_attention.attention import base, dispatch
from gated_attention.attention.dispatch import (  # the op's public names, re-exported
    IMPLEMENTATIONS,
    Auto,
    Spec,
    describe,
    record_implementation_choices,
    resolve,
)
from gated_attention.core import checks, masking, numerics, platforms
from gated_attention.parallel import ring, sharding

__all__ = [
    "IMPLEMENTATIONS",
    "Auto",
    "describe",
    "dot_product_attention",
    "packed_dot_product_attention",
    "record_implementation_choices",
    "resolve",
]


def _full_rank(name: str, x, target: tuple[int, ...], ring: int = 1):
    """x right-aligned to target's rank (missing leading dimensions 1), validated. ring > 1 (a
    device's blocks inside a shard_map over shard_keys_over): T and S may also be every
    device's, ring times the block's (ring.py)."""
    if ring > 1 and len(x.shape) >= 2:
        whole = lambda got, size: size * ring if got == size * ring else size
        target = (*target[:-2], whole(x.shape[-2], target[-2]), whole(x.shape[-1], target[-1]))
    shape = checks.check_right_aligned(name, x.shape, target, "[..., N, T, S]")
    return x if tuple(x.shape) == shape else jnp.reshape(x, shape)


def _as_biases(bias, target: tuple[int, ...], ring: int = 1) -> tuple:
    """bias (None, an array or a sequence of arrays) -> a tuple of validated full-rank arrays."""
    if bias is None:
        return ()
    biases = tuple(bias) if isinstance(bias, (list, tuple)) else (bias,)
    checked = []
    for i, b in enumerate(biases):
        name = "bias" if len(biases) == 1 else f"bias[{i}]"
        checks.check_float_array(name, b)
        checked.append(_full_rank(name, b, target, ring))
    return tuple(checked)


def _window(local_window_size) -> tuple[int, int] | None:
    """jax.nn's local_window_size (None, an int or a (left, right) pair) -> None or a pair."""
    size = local_window_size
    if size is None:
        return None
    pair = (size, size) if isinstance(size, int) and not isinstance(size, bool) else size
    ok = isinstance(pair, (tuple, list)) and len(pair) == 2
    ok = ok and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pair)
    if not ok:
        raise ValueError(
            "local_window_size must be None, an int >= 0 or a (left, right) pair of ints >= 0, "
            f"got {size!r}"
        )
    return int(pair[0]), int(pair[1])


def _precision(precision):
    """None, a jax.lax.Precision or its name ('default', 'high', 'highest')."""
    if precision is None or isinstance(precision, jax.lax.Precision):
        return precision
    if isinstance(precision, str):
        try:
            return jax.lax.Precision(precision)
        except ValueError:
            pass
    raise ValueError(
        "precision must be None, a jax.lax.Precision or one of ('default', 'high', 'highest'), "
        f"got {precision!r}"
    )


def _options(
    query, *, is_causal, window, q_lengths, kv_lengths, soft_cap, precision, residual, logits_dtype
) -> base.Options:
    """The validated jax.nn/tokamax arguments as the implementations' Options."""
    batch_dims = tuple(query.shape[:-3])
    checks.check_bool("is_causal", is_causal)
    checks.check_bool("return_residual", residual)
    window = _window(window)
    checks.check_lengths("query_seq_lengths", q_lengths, batch_dims)
    checks.check_lengths("key_value_seq_lengths", kv_lengths, batch_dims)
    if soft_cap is not None:
        checks.check_positive_number("logits_soft_cap", soft_cap)
    acc = numerics.accumulation_dtype(query.dtype)
    if logits_dtype is not None and jnp.dtype(logits_dtype) != acc:
        raise ValueError(
            f"logits_dtype must be None or {acc} (logits are computed in float32, float64 for "
            f"float64 inputs), got {jnp.dtype(logits_dtype)}"
        )
    lengths = (
        None if x is None else jnp.reshape(jnp.asarray(x, jnp.int32), batch_dims)
        for x in (q_lengths, kv_lengths)
    )
    structure = masking.StructuredMask(is_causal, window, *lengths)
    return base.Options(
        structure, None if soft_cap is None else float(soft_cap), _precision(precision), residual
    )


def _flatten_batch(x, batch_dims: tuple[int, ...], trailing: int = 3):
    """[..., x, y, z] with leading dims 1 or equal to batch_dims -> [B or 1, x, y, z] (the last
    `trailing` dimensions kept: 4 for a packed [..., T, 3, N, H])."""
    lead, tail = tuple(x.shape[:-trailing]), tuple(x.shape[-trailing:])
    if all(d == 1 for d in lead):
        return x.reshape((1, *tail))
    if lead != batch_dims:
        # Mixed broadcasting over several leading axes: materialize only those axes.
        x = jnp.broadcast_to(x, (*batch_dims, *tail))
    return x.reshape((-1, *tail))


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | Sequence[jax.Array] | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    implementation: Spec = None,
    compute_dtype: str = "auto",
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    return_residual: bool = False,
    logits_soft_cap: float | None = None,
    precision: jax.lax.Precision | str | None = None,
    logits_dtype: Any = None,
    shard_rows_over: str | Sequence[str] | None = None,
    shard_keys_over: str | Sequence[str] | None = None,
    positions_first: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Softmax attention with additive biases and masks, over several implementations.

    jax.nn.dot_product_attention's arguments, with the same names, defaults and meaning (code
    written for it runs with this import instead), tokamax's logits_soft_cap, and these
    extensions: any number of leading batch dimensions; a sequence of biases, each with its own
    broadcast dimensions (a bias whose batch dimensions are 1 stays shared, never copied per
    row); value head dim Hv may differ from H; logits and softmax in float32 (float64 for float64
    inputs) whatever the input dtype; masked positions never leak (NaN, inf or garbage in masked
    queries, keys and values reach no unmasked output or gradient); a query with no key to attend
    to gives the uniform average of the values, never NaN (numerics.py). The causal, window and
    length masks are never built as [B, N, T, S] arrays (masking.py); grouped-query attention
    never repeats keys or values.

    Differences from jax.nn: the residual is float32 (jax.nn: the input dtype), and in rows with
    no key to attend to it is -1e9 + log(S) (jax.nn: about -0.7 * float32 max); value may have its
    own head dim; float8/integer inputs are refused.

    On a mesh with explicit axes each device attends for its own batch rows, heads and queries, as
    the inputs are sharded, with no communication; keys and values sharded along S are gathered
    first (sharding.shard_attention). The output has query's sharding.

    Shapes: T queries, S keys, N query heads, K key/value heads (N % K == 0), H query/key head
    dim, Hv value head dim.

    Args:
      query: [..., T, N, H].
      key: [..., S, K, H].
      value: [..., S, K, Hv].
      bias: None, a float array or a sequence of float arrays added together; each broadcasts
        to [..., N, T, S] aligned on the right (each dimension 1 or equal; missing leading
        dimensions count as 1, so [T, S] or [N, T, S] are fine).
      mask: None or a bool array broadcastable to [..., N, T, S] likewise; False = masked.
      scale: logit scale (a Python number), default H ** -0.5.
      implementation: None or 'auto', a name from IMPLEMENTATIONS, an implementation instance,
        an `Auto`, or a priority sequence of names and instances (module docstring).
      compute_dtype: the precision policy, one of numerics.POLICIES: 'auto' computes bfloat16 and
        float16 inputs in float32 on CPU; 'input' in their own dtype; 'float32' in float32.
      is_causal: query i attends keys j <= i (top-left aligned, as jax.nn, whatever T and S).
      query_seq_lengths: None or int [...] (query's batch dims): queries at or beyond the length
        attend nothing, and their output is zero (as jax.nn).
      key_value_seq_lengths: None or int [...]: keys at or beyond the length are masked.
      local_window_size: None, an int w (= (w, w)) or (left, right): query i attends keys in
        [i - left, i + right]; with is_causal both apply.
      return_residual: also return the logsumexp of each query's logits, [..., T, N] (jax.nn's
        layout), float32 (float64 for float64 inputs), without gradient.
      logits_soft_cap: None or c > 0: logits -> c * tanh(logits / c), applied to the scaled
        logits plus the biases, before the masks (tokamax's definition).
      precision: None, a jax.lax.Precision or its name, for the dots.
      logits_dtype: None or the logits' dtype, which is float32 (float64 for float64 inputs)
        here; anything else is refused.
      shard_rows_over: None, or the axis (axes) of the context mesh (jax.set_mesh) that the
        first batch dimension is split over: each device then attends for its own rows in a
        shard_map, under Auto mesh axes too (jit with sharded inputs), where XLA's partitioner
        would otherwise gather the rows around the implementations' loops. What a row shares
        (a bias or mask of size 1 there) is replicated.
      shard_keys_over: None, or the axis (axes) of the context mesh that the query positions T
        and the key/value positions S are split over, in contiguous blocks (context
        parallelism): each device attends its queries to the key blocks in turn, passed around
        the devices, and merges them by log-sum-exp, never gathering K or V (ring.py). A bias or
        mask with a query axis is split along it and stays; one with a key axis only travels
        with the keys. Under Auto and Explicit mesh axes (other explicit axes, such as one
        splitting the batch, become manual in the ring's shard_map); inside a shard_map over
        the axis the arrays are the device's blocks, and a bias or mask may also hold every
        query (each device slices its own) or every key (it stays, sliced per block).
      positions_first: query [T, B, N, H], key [S, B, K, H], value [S, B, K, Hv] and the output
        [T, B, N, Hv] (one batch dimension, second): attention along the columns of an array
        laid out [positions, batch, ...], as AF2's MSA [N_seq, N_res, c] is attended along each
        residue's column. The Pallas GPU kernels (Triton and Mosaic) read and write them as they
        lie, the other implementations get batch-first transposes. bias and mask stay [..., N, T, S] as above;
        the residual is [T, B, N]. Not with shard_rows_over or shard_keys_over; arrays sharded
        over explicit mesh axes run as the batch-first call on transposes.

    Returns:
      [..., T, N, Hv] in query's dtype; with return_residual, (that, the residual [..., T, N]).

    Raises:
      TypeError: a non-boolean mask, a non-float or 8-bit query/key/value/bias, non-integer
        lengths, a bad implementation type.
      ValueError: shapes that do not fit, query, key and value of different dtypes (as
        jax.nn), an unknown implementation name or policy, a bad value of any argument.
      NotImplementedError: a named implementation that cannot take these inputs here.
    """
    checks.check_bool("positions_first", positions_first)
    if positions_first:  # validated as the batch-first call whose transposes they are
        shapes = _positions_first(query, key, value, (shard_rows_over, shard_keys_over))
        if sharding.typed_sharded(query, key, value, bias, mask):
            # A kernel indexes no typed-sharded ref by row: the batch-first call, transposed.
            swap = lambda x: jnp.swapaxes(x, 0, 1)
            out = dot_product_attention(
                swap(query), swap(key), swap(value), bias, mask, scale=scale,
                implementation=implementation, compute_dtype=compute_dtype, is_causal=is_causal,
                query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                local_window_size=local_window_size, return_residual=return_residual,
                logits_soft_cap=logits_soft_cap, precision=precision, logits_dtype=logits_dtype,
            )  # fmt: skip
            return tuple(map(swap, out)) if return_residual else swap(out)
    else:
        shapes = (query, key, value)
    checks.check_qkv(*shapes)
    keys_over = sharding.mesh_axes(shard_keys_over, "shard_keys_over", manual=True)
    options = _options(
        shapes[0],
        is_causal=is_causal,
        window=local_window_size,
        q_lengths=query_seq_lengths,
        kv_lengths=key_value_seq_lengths,
        soft_cap=logits_soft_cap,
        precision=precision,
        residual=return_residual,
        logits_dtype=logits_dtype,
    )
    call, biases, mask = _prepare(
        (query, key, value), shapes, bias, mask, scale=scale, implementation=implementation,
        compute_dtype=compute_dtype, options=options, ring_blocks=sharding.ring_blocks(keys_over),
        positions_first=positions_first,
    )  # fmt: skip
    args = (query, key, value, biases, mask, options.structure)
    if positions_first:
        return call.attend(*args)
    if keys_over is not None:
        if shard_rows_over is not None:
            raise ValueError(
                f"shard_rows_over={shard_rows_over!r} and shard_keys_over={shard_keys_over!r}: "
                "give one (split rows with the mesh's other axes by placing the inputs)"
            )
        return _over_key_blocks(call, keys_over, *args)
    placement = sharding.mesh_axes(shard_rows_over)
    if placement is not None:
        return _on_rows(call.attend, placement, *args[:-1], options)
    out = sharding.shard_attention(call.attend, *args, residual=options.return_residual)
    return call.attend(*args) if out is None else out


def packed_dot_product_attention(
    qkv: jax.Array,
    bias: jax.Array | Sequence[jax.Array] | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    implementation: Spec = None,
    compute_dtype: str = "auto",
    is_causal: bool = False,
    query_seq_lengths: jax.Array | None = None,
    key_value_seq_lengths: jax.Array | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    return_residual: bool = False,
    logits_soft_cap: float | None = None,
    precision: jax.lax.Precision | str | None = None,
    positions_first: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Self-attention over query, key and value packed in one array, as one projection makes them.

    dot_product_attention(qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :], ...) with
    the same arguments and results, where the Pallas GPU kernels (Triton and Mosaic) read each
    slot's tiles from the packed array in place, so no slice of it is copied, and the Triton
    kernel writes the gradient of the whole array as one (Mosaic: its three, stacked); the
    other implementations get the three slices, and so does dot_product_attention's per-device
    shard_map where an input is sharded over an explicit mesh axis. This is the layout a projection by AF2's
    query, key and value weights stacked as [C, 3, N, H] produces (the modules' one-pass
    entry on a GPU), or [C, 4, N, H] with the gate's.

    Every argument but qkv is dot_product_attention's, with S = T, K = N and Hv = H (no
    sharding arguments: on a mesh the inputs' explicit shardings say where each part runs).

    Args:
      qkv: [..., T, P, N, H], P >= 3: slot 0 the queries, 1 the keys, 2 the values (N heads of
        head dim H each); slots from 3 on are the caller's (AF2's gate logits), never read here,
        and the gradient this op gives them is zero. With positions_first, [T, B, P, N, H].
      bias: as dot_product_attention's.
      mask: as dot_product_attention's.
      scale: as dot_product_attention's.
      implementation: as dot_product_attention's.
      compute_dtype: as dot_product_attention's.
      is_causal: as dot_product_attention's.
      query_seq_lengths: as dot_product_attention's.
      key_value_seq_lengths: as dot_product_attention's.
      local_window_size: as dot_product_attention's.
      return_residual: as dot_product_attention's.
      logits_soft_cap: as dot_product_attention's.
      precision: as dot_product_attention's.
      positions_first: qkv is [T, B, P, N, H] and the output [T, B, N, H].

    Returns:
      [..., T, N, H] in qkv's dtype ([T, B, N, H] positions first); with return_residual, (that,
      the residual [..., T, N]).

    Raises:
      TypeError: a non-float or 8-bit qkv, and as dot_product_attention.
      ValueError: qkv not of rank >= 4 with at least 3 slots ([..., T, P, N, H]; positions
        first rank 5), and as dot_product_attention.
      NotImplementedError: a named implementation that cannot take these inputs here.
    """
    checks.check_bool("positions_first", positions_first)
    checks.check_float_array("qkv", qkv)
    rank = 5 if positions_first else 4
    if (qkv.ndim != rank if positions_first else qkv.ndim < rank) or qkv.shape[-3] < 3:
        layout = "[T, B, P, N, H] (positions_first)" if positions_first else "[..., T, P, N, H]"
        raise ValueError(
            f"qkv must be {layout} with P >= 3 slots (query, key, value, then any of the "
            f"caller's), got {qkv.shape}"
        )
    one = base.slot_shape(qkv)
    shape = base.batch_first(one) if positions_first else one
    checks.check_qkv(shape, shape, shape)
    if sharding.typed_sharded(qkv, bias, mask):
        # Typed sharded (explicit axes, or manual ones inside a shard_map): a kernel may not index
        # such a ref by slot; dot_product_attention's per-device shard_map, on slices.
        return dot_product_attention(
            *base.unpacked(qkv), bias, mask, scale=scale,
            implementation=implementation, compute_dtype=compute_dtype, is_causal=is_causal,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size, return_residual=return_residual,
            logits_soft_cap=logits_soft_cap, precision=precision,
            positions_first=positions_first,
        )  # fmt: skip
    options = _options(
        shape, is_causal=is_causal, window=local_window_size, q_lengths=query_seq_lengths,
        kv_lengths=key_value_seq_lengths, soft_cap=logits_soft_cap, precision=precision,
        residual=return_residual, logits_dtype=None,
    )  # fmt: skip
    call, biases, mask = _prepare(
        (qkv, qkv, qkv), (shape, shape, shape), bias, mask, scale=scale,
        implementation=implementation, compute_dtype=compute_dtype, options=options,
        positions_first=positions_first, packed=True,
    )  # fmt: skip
    return call.attend(qkv, qkv, qkv, biases, mask, options.structure)


def _prepare(
    arrays, shapes, bias, mask, *, scale, implementation, compute_dtype, options, ring_blocks=1,
    **layout,
):  # fmt: skip
    """(_Call, biases, mask) of a call: `shapes` the validated batch-first, unpacked shapes of
    `arrays` as given, `layout` the Options' positions_first and packed."""
    biases, mask = _validated_pair(*shapes[:2], bias, mask, ring_blocks)
    checks.check_one_of("compute_dtype", compute_dtype, numerics.POLICIES)
    call = _Call(
        resolved=dispatch.resolve(implementation),
        requested=dispatch.describe(implementation),
        kinds=platforms.candidates((*arrays, biases, mask)),
        policy=compute_dtype,
        scale=shapes[0].shape[-1] ** -0.5 if scale is None else scale,
        options=dataclasses.replace(options, **layout),
    )
    return call, biases, mask


def _positions_first(query, key, value, sharded) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The batch-first shapes of positions-first query, key and value, which must have rank 4
    and one batch B; not with shard_rows_over or shard_keys_over (`sharded`)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        checks.check_float_array(name, x)
        if x.ndim != 4:
            raise ValueError(
                f"positions_first takes {name} of rank 4 ([T|S, B, N|K, H]), got shape "
                f"{tuple(x.shape)}"
            )
    if len({query.shape[1], key.shape[1], value.shape[1]}) > 1:
        raise ValueError(
            "positions_first: query, key and value must have one batch B (their second "
            f"dimension), got shapes {tuple(query.shape)}, {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    if any(x is not None for x in sharded):
        raise ValueError(
            f"positions_first does not take shard_rows_over or shard_keys_over, got {sharded}"
        )
    return tuple(base.batch_first(x) for x in (query, key, value))


def _validated_pair(query, key, bias, mask, ring_blocks: int):
    """(biases, mask) validated and right-aligned to [..., N, T, S]."""
    batch_dims = tuple(query.shape[:-3])
    q_len, heads = query.shape[-3:-1]
    target = (*batch_dims, heads, q_len, key.shape[-3])
    biases = _as_biases(bias, target, ring_blocks)
    if mask is not None:
        checks.check_bool_mask("mask", mask)
        mask = _full_rank("mask", mask, target, ring_blocks)
    return biases, mask


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call's resolved arguments: what `attend` needs beyond the arrays."""

    resolved: Any  # dispatch.resolve's Auto or priority tuple
    requested: str
    kinds: tuple[str, ...]  # the platform kinds the program may be compiled for
    policy: str
    scale: float
    options: base.Options

    def attend(self, query, key, value, biases, mask, structure):
        """Attention over these arrays (the whole call's or one device's): batch dimensions
        flattened, each kind's implementation chosen and planned once, run, restored."""
        first = self.options.positions_first  # [T, B, N, H]: one batch dimension, second
        packed = self.options.packed  # query, key and value one [..., T, 3, N, H] array
        rank = 4 if packed else 3
        batch_dims = (query.shape[1],) if first else tuple(query.shape[:-rank])
        flat = (query, key, value) if first else (
            tuple(_flatten_batch(x, batch_dims, rank) for x in (query, key, value))
        )  # fmt: skip
        flat += (
            tuple(_flatten_batch(b, batch_dims) for b in biases),
            None if mask is None else _flatten_batch(mask, batch_dims),
        )
        structure = structure.rows(lambda x: x.reshape(-1))  # [...] -> [B]
        options = dataclasses.replace(self.options, structure=structure)
        shapes = tuple(base.slot_shape(x) for x in flat[:3]) if packed else flat[:3]
        shapes = tuple(base.batch_first(x) for x in shapes) if first else shapes
        shapes = (*shapes, *flat[3:])
        choices = dispatch.choose_per_platform(
            self.resolved, self.kinds, shapes, self.policy, options, self.scale
        )
        dispatch.log_choice(self.requested, choices, *shapes[:3])
        out = platforms.dispatch(_branches(choices, self.scale, options), *flat)
        if first:
            return _restore_positions_first(out, structure, query.shape[0], options)
        return _restore(out, structure, flat[0].shape[1], batch_dims, options)


def _branches(choices, scale, options) -> dict:
    """{kind: callable} running each kind's choice with its plan; kinds whose implementation,
    compute dtype and plan agree share one callable (one branch, platforms.dispatch)."""
    made, branches = [], {}
    for kind, choice in choices.items():
        key = (choice.impl, choice.compute_dtype, choice.plan)
        fn = next((f for k, f in made if k == key), None)
        if fn is None:
            fn = _forward_mode_refused_by_name(
                choice.impl,
                functools.partial(
                    base.run,
                    choice.impl,
                    scale=scale,
                    compute_dtype=choice.compute_dtype,
                    options=options,
                    plan=choice.plan,
                ),
            )
            made.append((key, fn))
        branches[kind] = fn
    return branches


_JAX_NO_JVP = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"
FORWARD_MODE = "xla"  # the implementation that takes jax.jvp / jax.jacfwd (plain JAX)


def _forward_mode_refused_by_name(impl, fn):
    """fn, with JAX's TypeError for forward-mode derivatives of a custom VJP (the kernels' and
    'chunked''s backward) said in this library's words: which implementation takes them."""

    @functools.wraps(fn)
    def run(*args):
        try:
            return fn(*args)
        except TypeError as e:
            if _JAX_NO_JVP not in str(e):
                raise
            raise TypeError(
                f"implementation {impl.name!r} takes reverse-mode derivatives only (jax.grad, "
                "jax.vjp: its custom VJP keeps the backward's memory small); forward-mode ones "
                "(jax.jvp, jax.jacfwd, Hessian-vector products) need "
                f"implementation={FORWARD_MODE!r}, plain JAX at the dense softmax's memory"
            ) from None

    return run


def _restore_positions_first(out, structure, q_len: int, options):
    """_restore for positions-first [T, B, N, Hv] output; the residual [T, B, N]."""
    out, lse = out if options.return_residual else (out, None)
    valid = structure.valid_queries(q_len)  # [B, T]: jax.nn zeroes the rest
    if valid is not None:
        out = jnp.where(valid.T[:, :, None, None], out, jnp.zeros((), out.dtype))
    if lse is None:
        return out
    lse = jnp.transpose(lse, (2, 0, 1))  # [T, B, N]
    return out, lse if options.residual_gradient else jax.lax.stop_gradient(lse)


def _restore(out, structure, q_len: int, batch_dims, options):
    """The implementation's [B, ...] output (and residual) with jax.nn's zeroed queries, the
    batch dimensions restored, the residual in [..., T, N]."""
    out, lse = out if options.return_residual else (out, None)
    valid = structure.valid_queries(q_len)  # [B, T]: jax.nn zeroes the rest
    if valid is not None:
        out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
    out = out.reshape((*batch_dims, *out.shape[1:]))
    if lse is None:
        return out
    lse = jnp.swapaxes(lse, 1, 2)  # [B, T, N]
    if not options.residual_gradient:
        lse = jax.lax.stop_gradient(lse)
    return out, lse.reshape((*batch_dims, *lse.shape[1:]))


def _over_key_blocks(call, keys_over, query, key, value, biases, mask, structure):
    """attend over key blocks passed around the devices of shard_keys_over (ring.py)."""
    ring_options = dataclasses.replace(call.options, return_residual=True, residual_gradient=True)
    block = dataclasses.replace(call, options=ring_options).attend
    return ring.attend(
        block, keys_over, query, key, value, biases, mask, structure,
        residual=call.options.return_residual, manual=sharding.manual_axes(*keys_over),
    )  # fmt: skip


def _on_rows(attend, placement, query, key, value, biases, mask, options):
    """attend with each device on its own rows of the first batch dimension (shard_rows_over)."""
    if query.ndim < 4:
        raise ValueError(
            f"shard_rows_over splits the first batch dimension, but query of shape "
            f"{tuple(query.shape)} has none"
        )
    rows = query.shape[0]
    structure = options.structure
    lengths = (structure.q_lengths, structure.kv_lengths)

    def local(query, key, value, mask, q_lengths, kv_lengths, *biases):
        local_structure = dataclasses.replace(structure, q_lengths=q_lengths, kv_lengths=kv_lengths)
        return attend(query, key, value, tuple(biases), mask, local_structure)

    split = lambda x: None if x is None or x.shape[0] != rows or rows == 1 else 0
    args = (query, key, value, mask, *lengths, *biases)
    out_dims = (0, 0) if options.return_residual else 0
    dims = [split(x) for x in args]
    return sharding.on_rows(local, args, placement, row_dims=dims, out_dims=out_dims)
