"""Attention over keys split across devices: a ring of key blocks, merged by log-sum-exp.

Context parallelism (dot_product_attention's `shard_keys_over`). The query positions T and the
key/value positions S are split in contiguous blocks over a mesh axis of P devices. Device d
attends its queries to key block d, then passes its keys and values (and what travels with them)
to device d - 1 and receives block d + 1's, P steps in all; the partial outputs merge exactly by
their log-sum-exps (o = sum_s exp(lse_s - lse) o_s, lse = logsumexp_s lse_s). Nothing of K or V is
gathered: a device holds its own block and the one in flight, and the next block's transfer is
issued before this block's attention so that XLA can overlap them.

Biases and masks ([..., N|1, T|1, S|1]): one with a query axis is split with the queries and stays
(each step slices its key block, as the logits it is added to are laid out); one with a key axis
only travels with the keys; one with neither is replicated. Causal, window and length masks are
shifted to each block's positions (masking.Structure's q_offset), and a block that the causal or
window mask hides from all of a device's queries is skipped (lax.cond).

Gradients: a custom VJP runs the ring again backwards. Each step recomputes its block's
attention and differentiates it with the merged output's cotangent weighted by exp(lse_s - lse),
the log-sum-exp's cotangent carrying the rest (the implementations' residual_gradient); dK, dV
and the travelling biases' gradients travel with their blocks and are home after P steps. So the
backward holds one block's residuals at a time, never the P blocks a plain autodiff would keep.

Whatever implementation 'auto' (or the caller) picks runs each block: xla, chunked, the Pallas
kernels; cudnn's residual has no gradient, so it is refused inside the ring and 'auto' moves on.
A query with no key to attend to anywhere gets an average of values (never NaN), not necessarily
the single-device uniform average (which counts every key that some query attends).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gated_attention import masking, sharding

_SKIPPED = -2e9  # a skipped block's log-sum-exp: below a keyless row's (-1e9 + log S), weight 0


def _kind(x, rank: int) -> str:
    """'stay' (split with the queries), 'travel' (with the keys) or 'shared', for a bias/mask."""
    if x is None:
        return "shared"
    if x.shape[rank - 2] != 1:
        return "stay"
    return "travel" if x.shape[rank - 1] != 1 else "shared"


def attend(
    attend_block: Callable[..., tuple[jax.Array, jax.Array]],
    placement: tuple[Any, tuple[str, ...]],
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    biases: tuple,
    mask: jax.Array | None,
    structure: masking.Structure,
    *,
    residual: bool,
):
    """The attention of all keys, with T and S split over placement's axes (module docstring).

    attend_block(q, k, v, biases, mask, structure) -> (out [..., t, N, Hv], lse [..., t, N]) is
    one block's attention, its log-sum-exp differentiable; structure's lengths and q_offset are
    the block's. Returns out (and lse with residual) with the queries' split.
    """
    mesh, axes = placement
    devices = math.prod(mesh.shape[a] for a in axes)
    rank = query.ndim
    for name, x in (("query", query), ("key", key)):
        if x.shape[-3] % devices:
            raise ValueError(
                f"shard_keys_over={axes}: {name} of shape {tuple(x.shape)} has "
                f"{x.shape[-3]} positions, which do not split over its {devices} devices"
            )
    kinds = [_kind(b, rank) for b in biases]
    mask_kind = _kind(mask, rank)
    dim = {"stay": rank - 2, "travel": rank - 1, "shared": None}
    lengths = (structure.q_lengths, structure.kv_lengths)
    static = dataclasses.replace(structure, q_lengths=None, kv_lengths=None, q_offset=None)
    ring = _ring(attend_block, axes, devices, tuple(kinds), mask_kind, static)

    def local(query, key, value, mask, q_lengths, kv_lengths, *biases):
        out, lse = ring(query, key, value, biases, mask, (q_lengths, kv_lengths))
        return (out, jax.lax.stop_gradient(lse)) if residual else out

    args = (query, key, value, mask, *lengths, *biases)
    dims = [rank - 3, rank - 3, rank - 3, dim[mask_kind], None, None]
    dims += [dim[k] for k in kinds]
    out_dims = (rank - 3, rank - 3) if residual else rank - 3
    return sharding.on_rows(
        local, args, placement, row_dims=dims, out_dims=out_dims, what="shard_keys_over"
    )


def _ring(attend_block, axes, devices: int, kinds: tuple, mask_kind: str, static):
    """The per-device ring (inside the shard_map), as a custom VJP."""
    shift = [(i, (i - 1) % devices) for i in range(devices)]  # block d + 1 -> device d
    send = functools.partial(jax.lax.ppermute, axis_name=axes, perm=shift)
    skips = static.is_causal or static.window is not None

    def block_inputs(c, q, key, value, biases, mask, lengths):
        """Block c's (biases, mask, structure) for this device's queries."""
        t, s = q.shape[-3], key.shape[-3]
        q_offset = jax.lax.axis_index(axes) * t
        k_offset = c * s

        def cut(x, kind):  # a 'stay' bias holds every key: slice block c's
            if kind != "stay" or x.shape[-1] == 1:
                return x
            return jax.lax.dynamic_slice_in_dim(x, k_offset, s, axis=x.ndim - 1)

        q_lengths, kv_lengths = (None if n is None else n - k_offset for n in lengths)
        structure = dataclasses.replace(
            static, q_offset=q_offset - k_offset, q_lengths=q_lengths, kv_lengths=kv_lengths
        )  # positions relative to the block's first key: the masks depend on i - j
        hidden = False
        if skips:
            lo, hi = dataclasses.replace(static, q_offset=q_offset).key_range(0, t, s * devices)
            hidden = (k_offset >= hi) | (k_offset + s <= lo)
        blocks = tuple(cut(b, kind) for b, kind in zip(biases, kinds, strict=True))
        return blocks, None if mask is None else cut(mask, mask_kind), structure, hidden

    def travelling(k, v, biases, mask):
        moving = [b for b, kind in zip(biases, kinds, strict=True) if kind == "travel"]
        return k, v, moving, mask if mask_kind == "travel" else None

    def place(biases, moving):
        moving = iter(moving)
        return tuple(
            next(moving) if kind == "travel" else b for b, kind in zip(biases, kinds, strict=True)
        )

    def forward(q, k, v, biases, mask, lengths):
        d = jax.lax.axis_index(axes)
        acc = jnp.promote_types(q.dtype, jnp.float32)

        def step(i, state, last=False):
            carry, (m, num, den) = state
            following = carry if last else send(carry)  # in flight during this step's attention
            k_c, v_c, moving, mask_c = carry
            mask_c = mask if mask_kind != "travel" else mask_c
            b_c, mask_c, structure, hidden = block_inputs(
                (d + i) % devices, q, k_c, v_c, place(biases, moving), mask_c, lengths
            )
            out_c, lse_c = _unless(hidden, attend_block, q, k_c, v_c, b_c, mask_c, structure)
            out_c, lse_c = out_c.astype(acc), lse_c.astype(acc)
            new = jnp.maximum(m, lse_c)
            old_w, w = jnp.exp(m - new), jnp.exp(lse_c - new)
            num = num * old_w[..., None] + out_c * w[..., None]
            return following, (new, num, den * old_w + w)

        # A loop, not unrolled steps: XLA would run the chain of sends ahead of the attention and
        # hold every block at once.
        shape = (*q.shape[:-1], v.shape[-1])
        stats = (
            jnp.full(q.shape[:-1], -jnp.inf, acc),
            jnp.zeros(shape, acc),
            jnp.zeros(q.shape[:-1], acc),
        )
        state = jax.lax.fori_loop(0, devices - 1, step, (travelling(k, v, biases, mask), stats))
        _, (m, num, den) = step(devices - 1, state, last=True)
        return (num / den[..., None]).astype(q.dtype), m + jnp.log(den)

    @jax.custom_vjp
    def ring(q, k, v, biases, mask, lengths):
        return forward(q, k, v, biases, mask, lengths)

    def ring_fwd(q, k, v, biases, mask, lengths):
        out, lse = forward(q, k, v, biases, mask, lengths)
        return (out, lse), (q, k, v, biases, mask, lengths, out, lse)

    def ring_bwd(res, cotangents):
        q, k, v, biases, mask, lengths, out, lse = res
        g, g_lse = cotangents
        d = jax.lax.axis_index(axes)
        acc = lse.dtype
        g32, out32 = g.astype(acc), out.astype(acc)
        zeros = lambda x: jnp.zeros(x.shape, acc)
        moving0 = travelling(k, v, biases, mask)
        grads = (zeros(k), zeros(v), [zeros(b) for b in moving0[2]])
        d_stay = [
            zeros(b) if kind != "travel" else None for b, kind in zip(biases, kinds, strict=True)
        ]

        def block_grads(q, k, v, b, mask_c, structure):
            f = lambda q, k, v, b: attend_block(q, k, v, b, mask_c, structure)
            (out_c, lse_c), vjp = jax.vjp(f, q, k, v, b)
            w = jnp.exp(lse_c.astype(acc) - lse)  # this block's share of each row
            g_out = (g32 * w[..., None]).astype(out_c.dtype)
            g_res = w * (jnp.sum(g32 * (out_c.astype(acc) - out32), axis=-1) + g_lse)
            return jax.tree.map(lambda x: x.astype(acc), vjp((g_out, g_res.astype(lse_c.dtype))))

        def step(i, state, last=False):
            carry, grads, dq, d_stay = state
            following = carry if last else send(carry)
            k_c, v_c, moving, mask_c = carry
            mask_c = mask if mask_kind != "travel" else mask_c
            c = (d + i) % devices
            b_c, mask_c, structure, hidden = block_inputs(
                c, q, k_c, v_c, place(biases, moving), mask_c, lengths
            )
            dq_c, dk_c, dv_c, db_c = _unless(
                hidden, block_grads, q, k_c, v_c, b_c, mask_c, structure, zero=True
            )
            dk, dv, d_moving = grads
            d_moving, moved, d_stay = iter(d_moving), [], list(d_stay)
            for j, (db, kind) in enumerate(zip(db_c, kinds, strict=True)):
                if kind == "travel":
                    moved.append(next(d_moving) + db)
                elif kind == "stay" and biases[j].shape[-1] != 1:
                    s, axis = k.shape[-3], d_stay[j].ndim - 1
                    old = jax.lax.dynamic_slice_in_dim(d_stay[j], c * s, s, axis)
                    d_stay[j] = jax.lax.dynamic_update_slice_in_dim(
                        d_stay[j], old + db, c * s, axis
                    )
                else:
                    d_stay[j] = d_stay[j] + db
            grads = send((dk + dk_c, dv + dv_c, moved))  # after P sends, each block is home
            return following, grads, dq + dq_c, d_stay

        state = (moving0, grads, zeros(q), d_stay)
        state = jax.lax.fori_loop(0, devices - 1, step, state)
        _, grads, dq, d_stay = step(devices - 1, state, last=True)
        dk, dv, d_moving = grads
        d_moving = iter(d_moving)
        d_biases = tuple(
            (next(d_moving) if kind == "travel" else d_stay[i]).astype(b.dtype)
            for i, (b, kind) in enumerate(zip(biases, kinds, strict=True))
        )
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_biases, None, None

    ring.defvjp(ring_fwd, ring_bwd)
    return ring


def _unless(hidden, fn, q, k, v, biases, mask, structure, *, zero: bool = False):
    """fn(...) unless the block is hidden (a traced bool, or False): then zeros (the
    gradients, zero=True) or a zero output with a log-sum-exp of _SKIPPED."""
    if hidden is False:
        return fn(q, k, v, biases, mask, structure)
    shapes = jax.eval_shape(fn, q, k, v, biases, mask, structure)

    def skipped(*_):
        if zero:
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        out, lse = shapes
        return jnp.zeros(out.shape, out.dtype), jnp.full(lse.shape, _SKIPPED, lse.dtype)

    return jax.lax.cond(hidden, skipped, fn, q, k, v, biases, mask, structure)
