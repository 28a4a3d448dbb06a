"""dot_product_attention: one validation, one choice of implementation, one call.

The op layer knows nothing of Haiku. It validates the inputs once, flattens the batch dimensions to
one, resolves the implementation once from the real shapes (logging and recording the choice), and
calls it (base.py says what an implementation takes). On a mesh with explicit axes it does so per
device (sharding.shard_attention).

`implementation` accepts a name from IMPLEMENTATIONS, an implementation instance (carrying its own
tuning, e.g. ChunkedAttention(query_chunk_size=256)), a priority sequence of those (the first that
takes the inputs runs), or None / 'auto' / an `Auto` instance (rules below). A single named
implementation never falls back: it raises NotImplementedError saying why it cannot run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import types
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from gated_attention import base, checks, masking, memory, numerics, platforms, ring, sharding
from gated_attention.chunked import DEFAULT_MEMORY_BUDGET_BYTES, ChunkedAttention
from gated_attention.cudnn import CudnnAttention
from gated_attention.mosaic import MosaicAttention
from gated_attention.pallas import PallasAttention
from gated_attention.pallas_tpu import PallasTpuAttention
from gated_attention.per_mode import measured
from gated_attention.xla import XlaAttention

IMPLEMENTATIONS: types.MappingProxyType[str, base.Implementation] = types.MappingProxyType(
    {
        "xla": XlaAttention(),
        "chunked": ChunkedAttention(),
        "cudnn": CudnnAttention(),
        "mosaic": MosaicAttention(),
        "pallas": PallasAttention(),
        "pallas_tpu": PallasTpuAttention(),
    }
)

# Largest float32 logits-and-weights working set of one batch row that 'auto' leaves to the dense
# implementation (which tiles over rows); longer rows go to the chunked one.
DENSE_ROW_BYTES = 16 * 2**20


@dataclasses.dataclass(frozen=True)
class Auto:
    """The 'auto' choice: rules, in order, applied to the real (per-device) shapes.

    1. On GPU, `mosaic` (Hopper, sm_90: TMA and wgmma) when it takes the inputs, else `pallas`
       (Triton, any GPU while JAX has that backend): both read a bias shared over the batch
       without copying it per row and keep its gradient O(N·T·S); else `cudnn` (half precision).
    1b. On TPU, `pallas_tpu` when it takes the inputs (float32, bfloat16; head dims <= 128; its
       tiles within VMEM): the same contract in Mosaic.
    2. `xla` when one batch row's float32 logits and weights, 2 * 4 * N * T * S bytes, fit in
       min(memory_budget_bytes, dense_row_bytes): it runs in tiles of rows, forward and backward,
       so its working set stays small whatever the batch. On 2 CPU cores the MSA-row and triangle
       shapes ran faster in row tiles than in query x key tiles (scripts/benchmark.py).
    3. Otherwise (long rows) `chunked`, whose query x key tiles bound the working set.

    Attributes:
      memory_budget_bytes: the working-set budget (global_config.memory_budget_mib).
      dense_row_bytes: the largest row working set left to `xla`.
      xla, chunked, cudnn, mosaic, pallas, pallas_tpu: the instances to run (None: defaults,
        chunked with this budget).
    """

    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
    dense_row_bytes: int = DENSE_ROW_BYTES
    xla: XlaAttention | None = None
    chunked: ChunkedAttention | None = None
    cudnn: CudnnAttention | None = None
    mosaic: MosaicAttention | None = None
    pallas: PallasAttention | None = None
    pallas_tpu: PallasTpuAttention | None = None

    def __post_init__(self):
        checks.check_int("memory_budget_bytes", self.memory_budget_bytes)
        checks.check_int("dense_row_bytes", self.dense_row_bytes)
        defaults = dict(
            xla=XlaAttention(),
            chunked=ChunkedAttention(memory_budget_bytes=self.memory_budget_bytes),
            cudnn=CudnnAttention(),
            mosaic=MosaicAttention(),
            pallas=PallasAttention(),
            pallas_tpu=PallasTpuAttention(),
        )
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)

    def choose(
        self, query, key, value, biases, mask, *, compute_dtype, options=base.PLAIN, platform=None
    ):
        """(implementation, reason) for these flattened inputs, compiled for `platform` (a
        platforms.KINDS name; None: the host's)."""
        platform = platforms.host() if platform is None else platform
        if platform == "gpu":  # what the device's run measured fastest, where it has an entry
            ours = (self.mosaic, self.pallas, self.cudnn, self.xla)
            tuned = measured(ours, query, key, value, biases, mask, compute_dtype, options)
            if tuned is not None:
                return tuned
        kernels = {
            "gpu": (
                (self.mosaic, "Hopper and the Mosaic GPU kernel"),
                (self.pallas, "GPU and the Pallas kernel"),
                (self.cudnn, "GPU and cuDNN"),
            ),
            "tpu": ((self.pallas_tpu, "TPU and the Pallas TPU kernel"),),
        }
        refused = []  # the kernels' reasons, kept in the reason of what runs instead
        if platform in kernels:
            for impl, what in kernels[platform]:
                try:
                    impl.check(
                        query,
                        key,
                        value,
                        biases,
                        mask,
                        compute_dtype=compute_dtype,
                        options=options,
                        platform=platform,
                    )
                    return impl, "; ".join([*refused, f"{what} takes these inputs"])
                except NotImplementedError as e:  # the next rule applies
                    refused.append(f"{impl.name} refused: {e}")
        _, q_len, heads, _ = query.shape
        row_bytes = memory.dense_row_bytes(heads, q_len, key.shape[1])
        limit = min(self.memory_budget_bytes, self.dense_row_bytes)
        sizes = f"one row's dense logits need {_mib(row_bytes)} MiB, limit {_mib(limit)} MiB"
        return (self.chunked if row_bytes > limit else self.xla), "; ".join([*refused, sizes])


Spec = str | base.Implementation | Auto | Sequence[str | base.Implementation] | None


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / memory.MIB:.3g}"


def _instance(item: Any, name: str) -> base.Implementation:
    if isinstance(item, base.Implementation):
        return item
    if isinstance(item, str) and item in IMPLEMENTATIONS:
        return IMPLEMENTATIONS[item]
    if isinstance(item, str):
        raise ValueError(
            f"{name} must be one of {('auto', *IMPLEMENTATIONS)}, an implementation instance or "
            f"a sequence of them, got {item!r}"
        )
    raise TypeError(
        f"{name} must be a name, an implementation instance (e.g. gated_attention.XlaAttention()) "
        f"or a sequence of them, got {type(item).__name__}"
    )


def resolve(implementation: Spec) -> Auto | tuple[base.Implementation, ...]:
    """Validates `implementation`: an Auto, or the implementations to try in order."""
    if implementation is None or implementation == "auto":
        return Auto()
    if isinstance(implementation, Auto):
        return implementation
    if isinstance(implementation, (list, tuple)):
        if not implementation:
            raise ValueError("implementation must not be an empty sequence")
        return tuple(_instance(x, f"implementation[{i}]") for i, x in enumerate(implementation))
    return (_instance(implementation, "implementation"),)


def describe(implementation: Spec) -> str:
    """A short label of an implementation spec, for logs and records."""
    if implementation is None or isinstance(implementation, (str, Auto)):
        return "auto" if not isinstance(implementation, str) else implementation
    if isinstance(implementation, (list, tuple)):
        return "(" + ", ".join(describe(x) for x in implementation) + ")"
    return implementation.name


def _choose(resolved, query, key, value, biases, mask, compute_dtype, options, platform):
    args = (query, key, value, biases, mask)
    kwargs = dict(compute_dtype=compute_dtype, options=options, platform=platform)
    if isinstance(resolved, Auto):
        return resolved.choose(*args, **kwargs)
    reasons = []
    for impl in resolved:
        try:
            impl.check(*args, **kwargs)
        except NotImplementedError as e:
            if len(resolved) == 1:
                raise NotImplementedError(
                    f"implementation={impl.name!r} cannot take these inputs: {e}"
                ) from None
            reasons.append(f"{impl.name}: {e}")
            continue
        first = "requested explicitly" if len(resolved) == 1 else "the first to take the inputs"
        return impl, "; ".join([*reasons, first])
    raise NotImplementedError(
        "no implementation of the priority list takes these inputs: " + "; ".join(reasons)
    )


def _choose_per_platform(resolved, kinds, query, policy, flat_args, options):
    """{kind: (implementation, reason, compute dtype)} for every kind the program may be compiled
    for where something takes the inputs, else NotImplementedError with each kind's reason (the
    inputs' or the host's first); a kind left out has no branch: compiling for it fails."""
    plans, errors = {}, []
    for kind in kinds:
        compute = numerics.compute_dtype(query.dtype, policy, backend=kind)
        try:
            impl, reason = _choose(resolved, *flat_args, compute, options, kind)
        except NotImplementedError as e:
            errors.append((kind, e))
            continue
        plans[kind] = (impl, reason, compute)
    if not plans:  # a GPU kernel refused on the GPU too: its reason there, not the host's only
        (_, first), *others = errors
        others = "".join(f"; compiled for {kind}: {e}" for kind, e in others)
        raise (NotImplementedError(f"{first}{others}") if others else first) from None
    return plans


_logged: set[str] = set()  # the choices logged so far
_choice_logs = threading.local()  # this thread's open recorders: a trace reaches its own thread's


def _recorders() -> list[list[dict[str, Any]]]:
    if not hasattr(_choice_logs, "open"):
        _choice_logs.open = []
    return _choice_logs.open


@contextlib.contextmanager
def record_implementation_choices() -> Iterator[list[dict[str, Any]]]:
    """Collects the implementation chosen by every dot_product_attention traced inside the block
    by this thread (recorders nest; another thread's traces are its own).

    Yields:
      A list that receives one dict per traced call: requested, chosen, reason, platform (the
      kind they are for: the inputs' own, the host's, or the first of a staged branch's),
      by_platform ({kind: {chosen, reason, compute_dtype}} for every kind the call may be compiled
      for, platforms.py) and the flattened [B, T|S, N, H] shapes of query, key and value. A module
      whose compute dtype differs between those kinds ('auto' with bfloat16 inputs: float32 on
      CPU) traces one branch per dtype, so one of its calls records one entry per branch.
    """
    record: list[dict[str, Any]] = []
    recorders = _recorders()
    recorders.append(record)
    try:
        yield record
    finally:  # by identity: an empty inner recorder equals an empty outer one
        del recorders[next(i for i, r in enumerate(recorders) if r is record)]


def _log_choice(requested: str, plans: dict, query, key, value) -> None:
    (kind, (impl, reason, _)), *others = plans.items()
    elsewhere = "".join(f"; on {k}: {p[0].name}" for k, p in others)
    message = (
        f"dot_product_attention: {requested} -> {impl.name} on {kind} ({reason}){elsewhere}, "
        f"query {tuple(query.shape)}"
    )
    if message not in _logged and len(_logged) < 20:  # each choice once (init and apply trace)
        _logged.add(message)
        logging.info("%s", message)
    shapes = dict(query=tuple(query.shape), key=tuple(key.shape), value=tuple(value.shape))
    by_platform = {
        k: dict(chosen=p[0].name, reason=p[1], compute_dtype=p[2].name) for k, p in plans.items()
    }
    entry = dict(
        requested=requested,
        chosen=impl.name,
        reason=reason,
        platform=kind,
        by_platform=by_platform,
        **shapes,
    )
    for record in _recorders():
        record.append(dict(entry))


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
    structure = masking.Structure(is_causal, window, *lengths)
    return base.Options(
        structure, None if soft_cap is None else float(soft_cap), _precision(precision), residual
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

    Returns:
      [..., T, N, Hv] in query's dtype; with return_residual, (that, the residual [..., T, N]).

    Raises:
      TypeError: a non-boolean mask, a non-float or 8-bit query/key/value/bias, non-integer
        lengths, a bad implementation type.
      ValueError: shapes that do not fit, query, key and value of different dtypes (as
        jax.nn), an unknown implementation name or policy, a bad value of any argument.
      NotImplementedError: a named implementation that cannot take these inputs here.
    """
    checks.check_qkv(query, key, value)
    batch_dims = tuple(query.shape[:-3])
    q_len, heads = query.shape[-3:-1]
    target = (*batch_dims, heads, q_len, key.shape[-3])
    keys_over = sharding.rows_mesh(shard_keys_over, "shard_keys_over", manual=True)
    ring_blocks = 1  # inside a shard_map over shard_keys_over: its device count
    if keys_over is not None and sharding.manual_axes(*keys_over):
        ring_blocks = math.prod(keys_over[0].shape[a] for a in keys_over[1])
    biases = _as_biases(bias, target, ring_blocks)
    if mask is not None:
        checks.check_bool_mask("mask", mask)
        mask = _full_rank("mask", mask, target, ring_blocks)
    checks.check_one_of("compute_dtype", compute_dtype, numerics.POLICIES)
    options = _options(
        query,
        is_causal=is_causal,
        window=local_window_size,
        q_lengths=query_seq_lengths,
        kv_lengths=key_value_seq_lengths,
        soft_cap=logits_soft_cap,
        precision=precision,
        residual=return_residual,
        logits_dtype=logits_dtype,
    )
    resolved = resolve(implementation)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    kinds = platforms.candidates((query, key, value, biases, mask))

    def attend(query, key, value, biases, mask, structure, options=options):  # or one shard's
        batch_dims = tuple(query.shape[:-3])
        q, k, v = (_flatten_batch(x, batch_dims) for x in (query, key, value))
        flat_biases = tuple(_flatten_batch(b, batch_dims) for b in biases)
        m = None if mask is None else _flatten_batch(mask, batch_dims)
        structure = structure.rows(lambda x: x.reshape(-1))  # [...] -> [B]
        call_options = dataclasses.replace(options, structure=structure)
        flat = (q, k, v, flat_biases, m)
        plans = _choose_per_platform(resolved, kinds, q, compute_dtype, flat, call_options)
        _log_choice(describe(implementation), plans, q, k, v)
        run = functools.cache(
            lambda impl, compute: (
                lambda *a: impl(*a, scale=scale, compute_dtype=compute, options=call_options)
            )
        )  # one callable per distinct choice, so kinds that agree share a branch
        out = platforms.dispatch({kind: run(p[0], p[2]) for kind, p in plans.items()}, *flat)
        out, lse = out if options.return_residual else (out, None)
        valid = structure.valid_queries(q.shape[1])  # [B, T]: jax.nn zeroes the rest
        if valid is not None:
            out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
        out = out.reshape((*batch_dims, *out.shape[1:]))
        if lse is None:
            return out
        lse = jnp.swapaxes(lse, 1, 2)  # [B, T, N]
        if not options.residual_gradient:
            lse = jax.lax.stop_gradient(lse)
        return out, lse.reshape((*batch_dims, *lse.shape[1:]))

    if keys_over is not None:
        if shard_rows_over is not None:
            raise ValueError(
                f"shard_rows_over={shard_rows_over!r} and shard_keys_over={shard_keys_over!r}: "
                "give one (split rows with the mesh's other axes by placing the inputs)"
            )
        ring_options = dataclasses.replace(options, return_residual=True, residual_gradient=True)
        block = functools.partial(attend, options=ring_options)
        return ring.attend(
            block, keys_over, query, key, value, biases, mask, options.structure,
            residual=options.return_residual, manual=sharding.manual_axes(*keys_over),
        )  # fmt: skip
    placement = sharding.rows_mesh(shard_rows_over)
    if placement is not None:
        return _on_rows(attend, placement, query, key, value, biases, mask, options)
    args = (query, key, value, biases, mask, options.structure)
    out = sharding.shard_attention(attend, *args, residual=options.return_residual)
    return attend(*args) if out is None else out


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
