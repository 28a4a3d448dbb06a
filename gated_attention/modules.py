"""AlphaFold 2's gated Attention and GlobalAttention as Haiku modules, over one attention op.

Einsum letters (AlphaFold 2's): b batch, q query positions, k key positions, h heads, c per-head
channel, a query input channels, m key/value input channels, o output channels; '...' extra leading
batch axes. Projections are written '...qhc' (a plain matmul on CPU; '...hqc' costs 3-4x) and the op
transposes to head-major inside, where its tiles stay small.

Parameter names, shapes and initializers are AlphaFold 2's (DESIGN.md), so AF2 params apply unchanged.
The module owns parameters, gate and output projection and calls the op once; it never branches on the
implementation, which comes from the configs. It asks the op layer (attention.caller_row_tile) whether
to run its whole forward in tiles of batch rows, which it then does for any implementation.
"""

from __future__ import annotations

import math
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from gated_attention import attention, mapping, precision, sharding
from gated_attention import config as config_lib


def _glorot_uniform() -> hk.initializers.Initializer:
    return hk.initializers.VarianceScaling(1.0, mode="fan_avg", distribution="uniform")


def _check_float(name: str, x) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {jnp.result_type(x)}")


def _check_data(q_data, m_data, q_name="q_data", m_name="m_data") -> None:
    for name, x in ((q_name, q_data), (m_name, m_data)):
        _check_float(name, x)
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


def _head_dims(cfg: config_lib.ModuleConfig, a: int, m: int) -> tuple[int, int]:
    key_dim = a if cfg.key_dim is None else cfg.key_dim
    value_dim = m if cfg.value_dim is None else cfg.value_dim
    num_head = cfg.num_head
    if key_dim % num_head:
        raise ValueError(f"{key_dim=} must be divisible by {num_head=}")
    if value_dim % num_head:
        raise ValueError(f"{value_dim=} must be divisible by {num_head=}")
    return key_dim // num_head, value_dim // num_head


def _check_output_dim(output_dim: Any) -> None:
    if not isinstance(output_dim, int) or isinstance(output_dim, bool) or output_dim < 1:
        raise ValueError(f"output_dim must be an int >= 1, got {output_dim!r}")


def _mask_or_bias(name, x, batch, heads, q_len, k_len, kind):
    """A per-batch mask or bias as a rank len(batch)+3 array [..., b, h|1, q|1, k|1].

    Rank len(batch)+3 is taken as [..., b, h, q, k]; rank len(batch)+2 as [..., b, q, k], shared
    by every head. Each dimension must be 1 or equal.
    """
    if kind == "mask" and jnp.result_type(x) != jnp.bool_:
        raise TypeError(
            f"{name} must be a boolean array (True = attend), got dtype {jnp.result_type(x)}; "
            "pass an additive float bias as bias= instead"
        )
    if kind == "bias":
        _check_float(name, x)
    full4 = (*batch, heads, q_len, k_len)
    if x.ndim == len(batch) + 2:
        x = jnp.expand_dims(x, -3)
    if x.ndim != len(full4) or any(d not in (1, t) for d, t in zip(x.shape, full4, strict=True)):
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} must broadcast to [..., b, h, q, k] = {full4} "
            f"(or [..., b, q, k] = {(*batch, q_len, k_len)}), each dimension 1 or equal"
        )
    return x


def _nonbatched(nonbatched_bias, batch, heads, q_len, k_len):
    """nonbatched_bias [h, q, k] or [q, k] -> [1, ..., 1, h|1, q, k], shared over the batch."""
    _check_float("nonbatched_bias", nonbatched_bias)
    shape = tuple(nonbatched_bias.shape)
    if shape not in ((heads, q_len, k_len), (q_len, k_len)):
        raise ValueError(
            f"nonbatched_bias of shape {shape} must be [h, q, k] = {(heads, q_len, k_len)} "
            f"or [q, k] = {(q_len, k_len)}"
        )
    x = nonbatched_bias if len(shape) == 3 else nonbatched_bias[None]
    return x.reshape((1,) * len(batch) + x.shape)


class _AttentionModule(hk.Module):
    """What Attention and GlobalAttention share: validated configs and the output width."""

    def __init__(self, config: Any, global_config: Any, output_dim: int, name: str = "attention"):
        """Constructs the module.

        Args:
          config: module config (AF2's: num_head, gating, optional key_dim/value_dim, ...); unknown
            keys raise ValueError. See config.ModuleConfig.
          global_config: AF2's global config (zero_init, ...) plus attention_implementation, chunk
            sizes and memory_budget_mib. See config.GlobalConfig.
          output_dim: o, channels of the output.
          name: Haiku module name.
        """
        super().__init__(name=name)
        self.config = config_lib.module_config(config)
        self.global_config = config_lib.global_config(global_config)
        _check_output_dim(output_dim)
        self.output_dim = output_dim


class Attention(_AttentionModule):
    """AlphaFold 2's gated multi-head attention (Jumper et al. 2021, Suppl. Alg. 7 and relatives).

    Parameters (a = q_data channels, m = m_data channels, h = num_head, c = key_dim // h,
    cv = value_dim // h, o = output_dim): query_w [a, h, c], key_w [m, h, c], value_w [m, h, cv],
    gating_w [a, h, cv] and gating_b [h, cv] when config.gating, output_w [h, cv, o], output_b [o];
    created in q_data's dtype with AlphaFold 2's initializers. The forward runs in the dtype of
    global_config.compute_dtype's policy (precision.py: float32 for bfloat16/float16 on CPU by
    default) and returns q_data's dtype.
    """

    def __call__(
        self,
        q_data,
        m_data,
        mask=None,
        nonbatched_bias=None,
        *,
        bias=None,
        subbatch_size: int | str | None = None,
    ) -> jax.Array:
        """Attends from q_data to m_data.

        Args:
          q_data: [..., b, q, a] queries (and gate input).
          m_data: [..., b, k, m] keys and values; same dtype as q_data.
          mask: None or bool, broadcastable to [..., b, h, q, k] (AF2 passes [b, 1, 1, k]) or a
            [..., b, q, k] mask applied to every head. False = masked out.
          nonbatched_bias: None, [h, q, k] or [q, k]; shared by the batch, never broadcast to it.
          bias: None or an additive float bias broadcastable like mask (AF2 before 2023, ColabFold).
          subbatch_size: inference subbatching over the leading batch axis (AF2's
            global_config.subbatch_size): None (off), an int >= 1, or 'auto' (the largest subbatch
            whose projections and dense logits fit the memory budget). Parameters are created
            once; the whole forward (projections, op, gate, output) runs per subbatch, so its
            working set is bounded. Results equal the unbatched ones up to float rounding.

        Returns:
          [..., b, q, output_dim] in q_data's dtype.
        """
        _check_data(q_data, m_data)
        _check_subbatch_size(subbatch_size)
        cfg = self.config
        batch, (q_len, a), (k_len, m) = q_data.shape[:-2], q_data.shape[-2:], m_data.shape[-2:]
        h = cfg.num_head
        key_dim, value_dim = _head_dims(cfg, a, m)
        biases = []
        if nonbatched_bias is not None:
            biases.append(_nonbatched(nonbatched_bias, batch, h, q_len, k_len))
        if bias is not None:
            biases.append(_mask_or_bias("bias", bias, batch, h, q_len, k_len, "bias"))
        if mask is not None:
            mask = _mask_or_bias("mask", mask, batch, h, q_len, k_len, "mask")

        params = _create_params(
            self, (a, h, key_dim), (m, h, key_dim), (m, h, value_dim), q_data.dtype
        )
        implementation, options = config_lib.attention_options(cfg, self.global_config)
        compute = precision.compute_dtype(q_data.dtype, options.compute_dtype)
        p = precision.cast_floats(params, compute)  # once, not per tile

        def forward(q_data, m_data, mask, *biases):  # pure: parameters are closed over
            out_dtype = q_data.dtype
            q_data, m_data = precision.cast_floats((q_data, m_data), compute)
            q = jnp.einsum("...qa,ahc->...qhc", q_data, p["query_w"])  # [..., b, q, h, c]
            k = jnp.einsum("...ka,ahc->...khc", m_data, p["key_w"])  # [..., b, k, h, c]
            v = jnp.einsum("...ka,ahc->...khc", m_data, p["value_w"])  # [..., b, k, h, cv]
            weighted_avg = attention.dot_product_attention(
                q,
                k,
                v,
                list(biases) or None,
                mask,
                scale=key_dim**-0.5,
                implementation=implementation,
                options=options,
            )  # [..., b, q, h, cv]
            return _gated_output(weighted_avg, q_data, p).astype(out_dtype)  # [..., b, q, o]

        args = [q_data, m_data, mask, *biases]
        if subbatch_size == "auto":
            # Per row of the leading axis (key_dim, value_dim per head): float32 logits and
            # weights, q, gate and the weighted average per query, k and v per key.
            rows = math.prod(q_data.shape[1:-2])
            per_row = (
                4
                * rows
                * h
                * (
                    2 * q_len * k_len
                    + q_len * (key_dim + 2 * value_dim)
                    + k_len * (key_dim + value_dim)
                )
            )
            subbatch_size = mapping.subbatch_size_for_budget(
                q_data.shape[0], per_row, options.memory_budget_bytes
            )
        batched = [True, True] + [x is not None and x.shape[0] != 1 for x in args[2:]]
        if subbatch_size is None:
            # Not asked to subbatch: still run the whole forward in row tiles when the op's
            # implementation says a tile's work then stays in cache. Under differentiation each
            # tile keeps its projections (matmuls without batch dims) and recomputes attention.
            tile = attention.caller_row_tile(
                implementation,
                (*batch, q_len, h, key_dim),
                (*batch, k_len, h, key_dim),
                compute,
                options,
            )
            if tile is None:
                return forward(*args)
            policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
            return mapping.subbatch(
                jax.checkpoint(forward, policy=policy), args, subbatch_size=tile, batched=batched
            )
        return mapping.subbatch(forward, args, subbatch_size=subbatch_size, batched=batched)


def _check_subbatch_size(subbatch_size: Any) -> None:
    ok = subbatch_size is None or subbatch_size == "auto"
    ok = ok or (isinstance(subbatch_size, int) and not isinstance(subbatch_size, bool))
    if not ok or (isinstance(subbatch_size, int) and subbatch_size < 1):
        raise ValueError(
            f"subbatch_size must be None, 'auto' or an int >= 1, got {subbatch_size!r}"
        )


def _create_params(module, query_shape, key_shape, value_shape, dtype) -> dict[str, jax.Array]:
    """AF2's parameters in AF2's order (so one PRNG key gives AF2's values): query_w, key_w,
    value_w (glorot uniform), gating_w [a, h, cv] zeros and gating_b [h, cv] ones (config.gating),
    output_w [h, cv, o] (zeros if global_config.zero_init, else glorot), output_b [o] zeros."""
    glorot, const = _glorot_uniform(), hk.initializers.Constant
    a, h, value_dim = query_shape[0], query_shape[1], value_shape[-1]
    params = dict(
        query_w=hk.get_parameter("query_w", query_shape, dtype, init=glorot),
        key_w=hk.get_parameter("key_w", key_shape, dtype, init=glorot),
        value_w=hk.get_parameter("value_w", value_shape, dtype, init=glorot),
    )
    if module.config.gating:
        params["gating_w"] = hk.get_parameter("gating_w", (a, h, value_dim), dtype, init=const(0.0))
        params["gating_b"] = hk.get_parameter("gating_b", (h, value_dim), dtype, init=const(1.0))
    out_init = const(0.0) if module.global_config.zero_init else glorot
    o = module.output_dim
    params["output_w"] = hk.get_parameter("output_w", (h, value_dim, o), dtype, init=out_init)
    params["output_b"] = hk.get_parameter("output_b", (o,), dtype, init=const(0.0))
    return params


def _gated_output(weighted_avg, q_data, params):
    """Gate (when params has gating_w) and output projection: [..., b, q|1, h, cv] -> [..., b, q|1, o].

    gate = sigmoid(q_data . gating_w + gating_b), computed from q_data as in AF2.
    """
    if "gating_w" in params:
        gate = jnp.einsum("...qa,ahc->...qhc", q_data, params["gating_w"])  # [..., b, q, h, cv]
        weighted_avg = weighted_avg * jax.nn.sigmoid(gate + params["gating_b"])
    # '...qhc,hco->...qo' as one matmul over the flattened (h, c): written as that einsum, XLA:CPU
    # transposed the activations to (c, h) order in every call (scripts/benchmark.py: the
    # triangle shape). With heads sharded over devices, the sum over them is an all-reduce into
    # the batch's sharding.
    *lead, h, c = weighted_avg.shape
    output_w = params["output_w"]
    out = jnp.einsum(
        "...k,ko->...o",
        weighted_avg.reshape(*lead, h * c),  # [..., b, q, h * cv]
        output_w.reshape(h * c, output_w.shape[-1]),  # [h * cv, o]
        out_sharding=sharding.out_sharding(weighted_avg, keep=weighted_avg.ndim - 2),
    )  # [..., b, q, o]
    return out + params["output_b"]


class GlobalAttention(_AttentionModule):
    """AlphaFold 2's global attention (Suppl. Alg. 19): one averaged query per head, shared key/value.

    Parameters: query_w [a, h, c], key_w [m, c], value_w [m, cv], gating_w [a, h, cv], gating_b
    [h, cv] (config.gating), output_w [h, cv, o], output_b [o].
    """

    def __call__(
        self, q_data, m_data, q_mask, *, subbatch_size: int | str | None = None
    ) -> jax.Array:
        """Global attention from the masked mean of q_data to m_data.

        Args:
          q_data: [..., b, q, a].
          m_data: [..., b, k, m] with k == q (the positions q_mask also masks as keys).
          q_mask: [..., b, q, 1] (or [..., b, q]), bool or float 0/1 as AF2 passes it.
          subbatch_size: inference subbatching over the leading batch axis, as for Attention.

        Returns:
          [..., b, q, output_dim] in q_data's dtype.
        """
        _check_data(q_data, m_data)
        _check_subbatch_size(subbatch_size)
        cfg = self.config
        batch, (q_len, a), (k_len, m) = q_data.shape[:-2], q_data.shape[-2:], m_data.shape[-2:]
        if k_len != q_len:
            raise ValueError(
                f"m_data has {k_len} positions but q_data has {q_len}; global attention "
                "masks keys with q_mask, so they must be equal"
            )
        q_mask = _global_mask(q_mask, batch, q_len)
        h = cfg.num_head
        key_dim, value_dim = _head_dims(cfg, a, m)
        dtype = q_data.dtype
        params = _create_params(self, (a, h, key_dim), (m, key_dim), (m, value_dim), dtype)
        implementation, options = config_lib.attention_options(cfg, self.global_config)
        compute = precision.compute_dtype(dtype, options.compute_dtype)
        p = precision.cast_floats(params, compute)  # once, not per subbatch

        def forward(q_data, m_data, q_mask):  # pure: parameters are closed over
            q_data, m_data = precision.cast_floats((q_data, m_data), compute)
            weights = q_mask.astype(compute)  # [..., b, q, 1]
            q_avg = jnp.sum(weights * q_data, axis=-2) / (
                jnp.sum(weights, axis=-2) + 1e-10
            )  # [..., b, a]
            q = jnp.einsum("...a,ahc->...hc", q_avg, p["query_w"])  # [..., b, h, c]
            k = jnp.einsum("...ka,ac->...kc", m_data, p["key_w"])  # [..., b, k, c]
            v = jnp.einsum("...ka,ac->...kc", m_data, p["value_w"])  # [..., b, k, cv]
            key_mask = jnp.swapaxes(q_mask.astype(bool), -1, -2)[
                ..., None, :, :
            ]  # [..., b, 1, 1, k]
            # The h heads attend as h query positions of one head (the shared key/value head).
            avg = attention.dot_product_attention(
                q[..., None, :],
                k[..., None, :],
                v[..., None, :],
                None,
                key_mask,
                scale=key_dim**-0.5,
                implementation=implementation,
                options=options,
            )  # [..., b, h, 1, cv]
            out = _gated_output(jnp.swapaxes(avg, -3, -2), q_data, p)  # [..., b, q|1, o]
            out = jnp.broadcast_to(out, (*q_data.shape[:-1], self.output_dim))  # [..., b, q, o]
            return out.astype(dtype)

        if subbatch_size == "auto":  # per row: gate and gated average per query, k and v per key
            queries, keys = math.prod(q_data.shape[1:-1]), math.prod(m_data.shape[1:-1])
            per_row = 4 * (
                queries * (2 * h * value_dim + self.output_dim) + keys * (key_dim + value_dim)
            )
            subbatch_size = mapping.subbatch_size_for_budget(
                q_data.shape[0], per_row, options.memory_budget_bytes
            )
        if subbatch_size is None:
            return forward(q_data, m_data, q_mask)
        return mapping.subbatch(forward, [q_data, m_data, q_mask], subbatch_size=subbatch_size)


def _global_mask(q_mask, batch, q_len):
    """q_mask [..., b, q, 1] or [..., b, q], bool or float -> [..., b, q, 1]."""
    dtype = jnp.result_type(q_mask)
    if dtype != jnp.bool_ and not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"q_mask must be bool or float 0/1, got dtype {dtype}")
    shape = tuple(q_mask.shape)
    if shape == (*batch, q_len):
        return q_mask[..., None]
    if shape != (*batch, q_len, 1):
        raise ValueError(
            f"q_mask of shape {shape} must be [..., b, q, 1] = {(*batch, q_len, 1)} "
            f"or [..., b, q] = {(*batch, q_len)}"
        )
    return q_mask
