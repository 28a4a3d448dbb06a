"""AlphaFold 2's formulation of gated attention, for benchmarks and compatibility tests.

Written in-repo from the published algorithm (Jumper et al. 2021, Suppl. Alg. 7) in AlphaFold 2's
own layout: 'bqhc' einsums, the nonbatched bias added to materialized logits, masking by jnp.where
with -1e9, a float32 softmax, and the same parameter names, shapes and initializers. It is the
baseline scripts/benchmark.py compares against and the stand-in for AF2's module in tests that
check AF2 parameters apply unchanged to gated_attention.Attention. Not part of the library.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp


class AF2Attention(hk.Module):
    """AlphaFold 2's Attention, as AF2 formulates it (2023 version, mask argument)."""

    def __init__(
        self,
        num_head: int,
        output_dim: int,
        gating: bool = True,
        zero_init: bool = True,
        key_dim: int | None = None,
        value_dim: int | None = None,
        name: str = "attention",
    ):
        super().__init__(name=name)
        self.num_head, self.output_dim, self.gating, self.zero_init = (
            num_head,
            output_dim,
            gating,
            zero_init,
        )
        self.key_dim, self.value_dim = key_dim, value_dim

    def __call__(self, q_data, m_data, mask=None, nonbatched_bias=None, bias=None):
        """q_data [b, q, a], m_data [b, k, m] -> [b, q, o].

        mask: bool [b, 1|h, 1|q, k] (AF2 since 2023) or None; bias: additive [b, 1|h, 1|q, k]
        (AF2 before 2023 and ColabFold pass the mask as bias = 1e9 * (mask - 1)) or None.
        """
        h = self.num_head
        key_dim = (self.key_dim or q_data.shape[-1]) // h
        value_dim = (self.value_dim or m_data.shape[-1]) // h
        glorot = hk.initializers.VarianceScaling(1.0, mode="fan_avg", distribution="uniform")
        dtype = q_data.dtype
        q_w = hk.get_parameter("query_w", (q_data.shape[-1], h, key_dim), dtype, init=glorot)
        k_w = hk.get_parameter("key_w", (m_data.shape[-1], h, key_dim), dtype, init=glorot)
        v_w = hk.get_parameter("value_w", (m_data.shape[-1], h, value_dim), dtype, init=glorot)
        q = jnp.einsum("bqa,ahc->bqhc", q_data, q_w) * key_dim ** (-0.5)  # [b, q, h, c]
        k = jnp.einsum("bka,ahc->bkhc", m_data, k_w)  # [b, k, h, c]
        v = jnp.einsum("bka,ahc->bkhc", m_data, v_w)  # [b, k, h, cv]
        logits = jnp.einsum("bqhc,bkhc->bhqk", q, k)  # [b, h, q, k]
        if nonbatched_bias is not None:
            logits += jnp.expand_dims(nonbatched_bias, axis=0)
        if bias is not None:
            logits += bias
        if mask is not None:
            logits = jnp.where(mask, logits, jnp.asarray(-1e9, logits.dtype))
        weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(logits.dtype)
        weighted_avg = jnp.einsum("bhqk,bkhc->bqhc", weights, v)  # [b, q, h, cv]
        if self.gating:
            g_w = hk.get_parameter(
                "gating_w",
                (q_data.shape[-1], h, value_dim),
                dtype,
                init=hk.initializers.Constant(0.0),
            )
            g_b = hk.get_parameter(
                "gating_b", (h, value_dim), dtype, init=hk.initializers.Constant(1.0)
            )
            gate = jax.nn.sigmoid(jnp.einsum("bqc,chv->bqhv", q_data, g_w) + g_b)  # [b, q, h, cv]
            weighted_avg *= gate
        o_init = hk.initializers.Constant(0.0) if self.zero_init else glorot
        o_w = hk.get_parameter("output_w", (h, value_dim, self.output_dim), dtype, init=o_init)
        o_b = hk.get_parameter(
            "output_b", (self.output_dim,), dtype, init=hk.initializers.Constant(0.0)
        )
        return jnp.einsum("bqhc,hco->bqo", weighted_avg, o_w) + o_b  # [b, q, o]


class AF2GlobalAttention(hk.Module):
    """AlphaFold 2's GlobalAttention (Suppl. Alg. 19), as AF2 formulates it."""

    def __init__(
        self,
        num_head: int,
        output_dim: int,
        gating: bool = True,
        zero_init: bool = True,
        name: str = "attention",
    ):
        super().__init__(name=name)
        self.num_head, self.output_dim, self.gating, self.zero_init = (
            num_head,
            output_dim,
            gating,
            zero_init,
        )

    def __call__(self, q_data, m_data, q_mask):
        """q_data [b, q, a], m_data [b, k, m], q_mask float [b, q, 1] -> [b, q, o] (or [b, 1, o])."""
        h = self.num_head
        key_dim, value_dim = q_data.shape[-1] // h, m_data.shape[-1] // h
        glorot = hk.initializers.VarianceScaling(1.0, mode="fan_avg", distribution="uniform")
        dtype = q_data.dtype
        q_w = hk.get_parameter("query_w", (q_data.shape[-1], h, key_dim), dtype, init=glorot)
        k_w = hk.get_parameter("key_w", (m_data.shape[-1], key_dim), dtype, init=glorot)
        v_w = hk.get_parameter("value_w", (m_data.shape[-1], value_dim), dtype, init=glorot)
        v = jnp.einsum("bka,ac->bkc", m_data, v_w)  # [b, k, cv]
        q_avg = jnp.sum(q_mask * q_data, axis=1) / (jnp.sum(q_mask, axis=1) + 1e-10)  # [b, a]
        q = jnp.einsum("ba,ahc->bhc", q_avg, q_w) * key_dim ** (-0.5)  # [b, h, c]
        k = jnp.einsum("bka,ac->bkc", m_data, k_w)  # [b, k, c]
        bias = 1e9 * (q_mask[:, None, :, 0] - 1.0)  # [b, 1, k]
        logits = jnp.einsum("bhc,bkc->bhk", q, k) + bias  # [b, h, k]
        weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(logits.dtype)
        weighted_avg = jnp.einsum("bhk,bkc->bhc", weights, v)  # [b, h, cv]
        o_init = hk.initializers.Constant(0.0) if self.zero_init else glorot
        o_w = hk.get_parameter("output_w", (h, value_dim, self.output_dim), dtype, init=o_init)
        o_b = hk.get_parameter(
            "output_b", (self.output_dim,), dtype, init=hk.initializers.Constant(0.0)
        )
        if self.gating:
            g_w = hk.get_parameter(
                "gating_w",
                (q_data.shape[-1], h, value_dim),
                dtype,
                init=hk.initializers.Constant(0.0),
            )
            g_b = hk.get_parameter(
                "gating_b", (h, value_dim), dtype, init=hk.initializers.Constant(1.0)
            )
            gate = jax.nn.sigmoid(jnp.einsum("bqc,chv->bqhv", q_data, g_w) + g_b)  # [b, q, h, cv]
            weighted_avg = weighted_avg[:, None] * gate  # [b, q, h, cv]
            return jnp.einsum("bqhc,hco->bqo", weighted_avg, o_w) + o_b  # [b, q, o]
        return (jnp.einsum("bhc,hco->bo", weighted_avg, o_w) + o_b)[:, None]  # [b, 1, o]


class AF2TriangleAttention(hk.Module):
    """AlphaFold 2's triangle attention around the starting node (Suppl. Alg. 13), as AF2 formulates
    it with the mask as an additive bias: LayerNorm, pair bias, AF2Attention over rows. Parameter
    names as AF2's (query_norm, feat_2d_weights, attention/...)."""

    def __init__(self, num_head: int, name: str = "triangle_attention"):
        super().__init__(name=name)
        self.num_head = num_head

    def __call__(self, pair_act, pair_mask):
        """pair_act [r, r, c_z], pair_mask float [r, r] -> [r, r, c_z]."""
        c = pair_act.shape[-1]
        x = hk.LayerNorm(axis=-1, create_scale=True, create_offset=True, name="query_norm")(
            pair_act
        )
        init = hk.initializers.RandomNormal(stddev=1.0 / c**0.5)
        weights = hk.get_parameter("feat_2d_weights", (c, self.num_head), x.dtype, init=init)
        nonbatched_bias = jnp.einsum("qkc,ch->hqk", x, weights)  # [h, r, r]
        mask_bias = (1e9 * (pair_mask - 1.0))[:, None, None, :]  # [r, 1, 1, r]
        attend = AF2Attention(self.num_head, c, zero_init=False)
        return attend(x, x, None, nonbatched_bias, mask_bias)
