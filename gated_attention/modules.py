"""AlphaFold 2's gated Attention and GlobalAttention as Haiku modules, over one attention op.

Einsum letters (AlphaFold 2's): b batch, q query positions, k key positions, h heads, c per-head
channel, a query input channels, m key/value input channels, o output channels; '...' extra leading
batch axes. Projections are written '...qhc' (a plain matmul on CPU; '...hqc' costs 3-4x) and the op
transposes to head-major inside, where its tiles stay small.

Parameter names, shapes and initializers are AlphaFold 2's (DESIGN.md), so AF2 params apply unchanged.
The module owns parameters, gate and output projection and calls the op once; it never branches on the
implementation, which comes from the configs.
"""

from __future__ import annotations

import math
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from gated_attention import attention, mapping
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


class Attention(hk.Module):
    """AlphaFold 2's gated multi-head attention (Jumper et al. 2021, Suppl. Alg. 7 and relatives).

    Parameters (a = q_data channels, m = m_data channels, h = num_head, c = key_dim // h,
    cv = value_dim // h, o = output_dim): query_w [a, h, c], key_w [m, h, c], value_w [m, h, cv],
    gating_w [a, h, cv] and gating_b [h, cv] when config.gating, output_w [h, cv, o], output_b [o];
    created in q_data's dtype with AlphaFold 2's initializers.
    """

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
          subbatch_size: inference subbatching of the (parameter-free) attention op over the
            leading batch axis: None (off), an int >= 1, or 'auto' (the largest subbatch whose dense
            logits fit the memory budget). Projections and results are unchanged.

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

        dtype = q_data.dtype
        glorot = _glorot_uniform()
        query_w = hk.get_parameter("query_w", (a, h, key_dim), dtype, init=glorot)
        key_w = hk.get_parameter("key_w", (m, h, key_dim), dtype, init=glorot)
        value_w = hk.get_parameter("value_w", (m, h, value_dim), dtype, init=glorot)
        q = jnp.einsum("...qa,ahc->...qhc", q_data, query_w)  # [..., b, q, h, c]
        k = jnp.einsum("...ka,ahc->...khc", m_data, key_w)  # [..., b, k, h, c]
        v = jnp.einsum("...ka,ahc->...khc", m_data, value_w)  # [..., b, k, h, cv]

        implementation, options = config_lib.attention_options(cfg, self.global_config)
        weighted_avg = _attend(
            q,
            k,
            v,
            biases,
            mask,
            scale=key_dim**-0.5,
            implementation=implementation,
            options=options,
            subbatch_size=subbatch_size,
        )  # [..., b, q, h, cv]

        if cfg.gating:
            weighted_avg = weighted_avg * _gate(q_data, h, value_dim)
        return _output_projection(
            weighted_avg, self.output_dim, self.global_config.zero_init, dtype
        )


def _check_subbatch_size(subbatch_size: Any) -> None:
    ok = subbatch_size is None or subbatch_size == "auto"
    ok = ok or (isinstance(subbatch_size, int) and not isinstance(subbatch_size, bool))
    if not ok or (isinstance(subbatch_size, int) and subbatch_size < 1):
        raise ValueError(
            f"subbatch_size must be None, 'auto' or an int >= 1, got {subbatch_size!r}"
        )


def _attend(q, k, v, biases, mask, *, subbatch_size, options, **op_kwargs):
    """The attention op on q [B, ..., T, N, H], k [B, ..., S, N, H], v [B, ..., S, N, Hv].

    With a subbatch_size, the op (and only the op: it has no parameters) runs on pieces of the
    leading axis B via mapping.subbatch; masks and biases of size 1 there are passed whole.
    'auto' takes the largest piece whose dense float32 logits and softmax weights,
    2 * 4 * N * T * S bytes per row (times any further batch axes), fit options.memory_budget_bytes.

    Returns:
      [B, ..., T, N, Hv].
    """

    def op(q, k, v, mask, *biases):
        return attention.dot_product_attention(
            q, k, v, list(biases) or None, mask, layout="BTNH", options=options, **op_kwargs
        )

    args = [q, k, v, mask, *biases]
    if subbatch_size is None:
        return op(*args)
    if subbatch_size == "auto":
        # q [B, ..., T, N, H] and k [B, ..., S, N, H]: N * T * S logits per row (and further axes).
        bytes_per_row = 2 * 4 * math.prod(q.shape[1:-1]) * k.shape[-3]
        subbatch_size = mapping.subbatch_size_for_budget(
            q.shape[0], bytes_per_row, options.memory_budget_bytes
        )
    batched = [True, True, True] + [x is not None and x.shape[0] != 1 for x in args[3:]]
    return mapping.subbatch(op, args, subbatch_size=subbatch_size, batched=batched)


def _gate(q_data, num_head, value_dim):
    """sigmoid(q_data . gating_w + gating_b) [..., b, q, h, cv]; gating_w [a, h, cv] zeros, gating_b
    [h, cv] ones (AF2)."""
    a, dtype = q_data.shape[-1], q_data.dtype
    shape = (a, num_head, value_dim)
    gating_w = hk.get_parameter("gating_w", shape, dtype, init=hk.initializers.Constant(0.0))
    gating_b = hk.get_parameter("gating_b", shape[1:], dtype, init=hk.initializers.Constant(1.0))
    gate = jnp.einsum("...qa,ahc->...qhc", q_data, gating_w)  # [..., b, q, h, cv]
    return jax.nn.sigmoid(gate + gating_b)


def _output_projection(weighted_avg, output_dim, zero_init, dtype):
    """output_w [h, cv, o], output_b [o]; '...qhc,hco->...qo'."""
    h, cv = weighted_avg.shape[-2], weighted_avg.shape[-1]
    init = hk.initializers.Constant(0.0) if zero_init else _glorot_uniform()
    output_w = hk.get_parameter("output_w", (h, cv, output_dim), dtype, init=init)
    output_b = hk.get_parameter(
        "output_b", (output_dim,), dtype, init=hk.initializers.Constant(0.0)
    )
    return jnp.einsum("...qhc,hco->...qo", weighted_avg, output_w) + output_b  # [..., b, q, o]


class GlobalAttention(hk.Module):
    """AlphaFold 2's global attention (Suppl. Alg. 19): one averaged query per head, shared key/value.

    Parameters: query_w [a, h, c], key_w [m, c], value_w [m, cv], gating_w [a, h, cv], gating_b
    [h, cv] (config.gating), output_w [h, cv, o], output_b [o].
    """

    def __init__(self, config: Any, global_config: Any, output_dim: int, name: str = "attention"):
        """Constructs the module; arguments as for Attention."""
        super().__init__(name=name)
        self.config = config_lib.module_config(config)
        self.global_config = config_lib.global_config(global_config)
        _check_output_dim(output_dim)
        self.output_dim = output_dim

    def __call__(
        self, q_data, m_data, q_mask, *, subbatch_size: int | str | None = None
    ) -> jax.Array:
        """Global attention from the masked mean of q_data to m_data.

        Args:
          q_data: [..., b, q, a].
          m_data: [..., b, k, m] with k == q (the positions q_mask also masks as keys).
          q_mask: [..., b, q, 1] (or [..., b, q]), bool or float 0/1 as AF2 passes it.
          subbatch_size: inference subbatching of the attention op, as for Attention.

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
        glorot = _glorot_uniform()
        query_w = hk.get_parameter("query_w", (a, h, key_dim), dtype, init=glorot)
        key_w = hk.get_parameter("key_w", (m, key_dim), dtype, init=glorot)
        value_w = hk.get_parameter("value_w", (m, value_dim), dtype, init=glorot)

        weights = q_mask.astype(dtype)  # [..., b, q, 1]
        q_avg = jnp.sum(weights * q_data, axis=-2) / (
            jnp.sum(weights, axis=-2) + 1e-10
        )  # [..., b, a]
        q = jnp.einsum("...a,ahc->...hc", q_avg, query_w)[..., :, None, :]  # [..., b, h, 1, c]
        k = jnp.einsum("...ka,ac->...kc", m_data, key_w)[..., :, None, :]  # [..., b, k, 1, c]
        v = jnp.einsum("...ka,ac->...kc", m_data, value_w)[..., :, None, :]  # [..., b, k, 1, cv]
        key_mask = jnp.swapaxes(q_mask.astype(bool), -1, -2)[..., None, :, :]  # [..., b, 1, 1, k]
        implementation, options = config_lib.attention_options(cfg, self.global_config)
        # The h heads attend as h query positions of one head (the shared key/value head).
        avg = _attend(
            q,
            k,
            v,
            [],
            key_mask,
            scale=key_dim**-0.5,
            implementation=implementation,
            options=options,
            subbatch_size=subbatch_size,
        )[..., :, 0, :]  # [..., b, h, cv]

        if cfg.gating:
            gated = avg[..., None, :, :] * _gate(q_data, h, value_dim)  # [..., b, q, h, cv]
            return _output_projection(gated, self.output_dim, self.global_config.zero_init, dtype)
        out = _output_projection(
            avg[..., None, :, :], self.output_dim, self.global_config.zero_init, dtype
        )  # [..., b, 1, o]
        return jnp.broadcast_to(out, (*batch, q_len, self.output_dim))  # [..., b, q, o]


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
