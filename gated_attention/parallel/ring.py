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
shifted to each block's positions (masking.StructuredMask's q_offset), and a block that the causal or
window mask hides from all of a device's queries is skipped (lax.cond): it gives what a block
without keys gives (_keyless), so a query with no key anywhere gets the uniform average of all
values, as on one device.

Gradients: a custom VJP runs the ring again backwards. Each step recomputes its block's
attention and differentiates it with the merged output's cotangent weighted by the block's share
(exp(lse_s - max) / sum, the forward's statistics), the log-sum-exp's cotangent carrying the rest (the implementations' residual_gradient); dK, dV
and the travelling biases' gradients travel with their blocks and are home after P steps. So the
backward holds one block's residuals at a time, never the P blocks a plain autodiff would keep.

Whatever implementation 'auto' (or the caller) picks runs each block: xla, chunked, the Pallas
kernels; cudnn's residual has no gradient, so it is refused inside the ring and 'auto' moves on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from gated_attention.core import masking, numerics
from gated_attention.parallel import sharding


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How one device's bias or mask [..., N|1, T?, S?] meets a block (the module docstring):
    travels: its key axis is the device's own keys (passed around with them); queries: its
    query axis holds every device's queries (this device slices its own); keys: its key axis
    holds every key (it stays, sliced per block)."""

    travels: bool = False
    queries: bool = False
    keys: bool = False


def _layout(x, t: int, s: int, devices: int) -> _Layout:
    """The layout of a device's bias or mask from its shape against the local t queries and s
    keys; raises ValueError for any other size."""
    if x is None:
        return _Layout()
    q_dim, k_dim = x.shape[-2], x.shape[-1]
    if q_dim not in (1, t, t * devices) or k_dim not in (1, s, s * devices):
        raise ValueError(
            f"shard_keys_over: a bias or mask of shape {tuple(x.shape)} on one device must have "
            f"1, {t} (its queries) or {t * devices} (all) queries and 1, {s} (its keys) or "
            f"{s * devices} (all) keys"
        )
    whole = devices > 1
    return _Layout(
        travels=k_dim == s and whole,
        queries=whole and q_dim == t * devices and q_dim != t,
        keys=whole and k_dim == s * devices and k_dim != s,
    )


def _split_dim(x, rank: int):
    """The dimension a whole bias or mask is split along over the ring's devices: its queries
    (it then stays), else its keys (it travels), else none (replicated)."""
    if x is None:
        return None
    if x.shape[rank - 2] != 1:
        return rank - 2
    return rank - 1 if x.shape[rank - 1] != 1 else None


def attend(
    attend_block: Callable[..., tuple[jax.Array, jax.Array]],
    placement: tuple[Any, tuple[str, ...]],
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    biases: tuple,
    mask: jax.Array | None,
    structure: masking.StructuredMask,
    *,
    residual: bool,
    manual: bool = False,
):
    """The attention of all keys, with T and S split over placement's axes (module docstring).

    attend_block(q, k, v, biases, mask, structure) -> (out [..., t, N, Hv], lse [..., t, N]) is
    one block's attention, its log-sum-exp differentiable; structure's lengths and q_offset are
    the block's. manual: the axes are already manual (inside a shard_map over them): the
    arrays are this device's blocks, each bias and mask laid out as _layout reads it. Returns
    out (and lse with residual) with the queries' split.
    """
    mesh, axes = placement
    devices = math.prod(mesh.shape[a] for a in axes)
    rank = query.ndim
    lengths = (structure.q_lengths, structure.kv_lengths)
    static = dataclasses.replace(structure, q_lengths=None, kv_lengths=None, q_offset=None)
    ring = _ring(attend_block, axes, devices, static)

    def local(query, key, value, mask, q_lengths, kv_lengths, *biases):
        out, lse = ring(query, key, value, biases, mask, (q_lengths, kv_lengths))
        return (out, jax.lax.stop_gradient(lse)) if residual else out

    args = (query, key, value, mask, *lengths, *biases)
    if manual:
        return local(*args)
    for name, x in (("query", query), ("key", key)):
        if x.shape[-3] % devices:
            raise ValueError(
                f"shard_keys_over={axes}: {name} of shape {tuple(x.shape)} has "
                f"{x.shape[-3]} positions, which do not split over its {devices} devices"
            )
    dims = [rank - 3, rank - 3, rank - 3, _split_dim(mask, rank), None, None]
    dims += [_split_dim(b, rank) for b in biases]
    out_dims = (rank - 3, rank - 3) if residual else rank - 3
    if _other_explicit_axes(mesh, axes):
        return _with_explicit_axes(local, args, mesh, axes, dims, residual)
    return sharding.on_rows(
        local, args, placement, row_dims=dims, out_dims=out_dims, what="shard_keys_over"
    )


def _other_explicit_axes(mesh, axes) -> set[str]:
    kinds = zip(mesh.axis_names, mesh.axis_types, strict=True)
    return {n for n, k in kinds if k == jax.sharding.AxisType.Explicit and n not in axes}


def _with_explicit_axes(local, args, mesh, axes, dims, residual: bool):
    """local(*args) in a shard_map over the ring's axes and every other explicit axis, each
    array split as its type says along the others (a batch split over 'rows' stays so) and over
    the ring's axes along dims: no axis is left typed on the arrays inside, where the kernels'
    bodies would meet it. The lengths split as the query's batch dimensions."""
    query = args[0]
    batch = sharding.explicit_axes(query)[1][:-3]
    ring = tuple(axes)

    def wanted(x, dim, lengths=False):
        if x is None:
            return None
        if lengths:
            return batch[-x.ndim :] if x.ndim else ()
        own = sharding.explicit_axes(x)[1]
        got = [  # batch dimensions as the query's (a mask's too), the others as x's type says
            batch[i]
            if i < len(batch) and x.shape[i] != 1
            else tuple(a for a in own[i] if a not in ring)
            for i in range(x.ndim)
        ]
        if dim is not None:
            got[dim] = (*got[dim], *ring)
        return tuple(got)

    specs = [
        wanted(x, d, lengths=i in (4, 5)) for i, (x, d) in enumerate(zip(args, dims, strict=True))
    ]
    args = [
        x if w is None else sharding.conform(x, mesh, w) for x, w in zip(args, specs, strict=True)
    ]
    in_specs = tuple(jax.sharding.PartitionSpec() if w is None else sharding.spec(w) for w in specs)
    out = sharding.spec(specs[0])
    lse = sharding.spec(specs[0][:-1])  # [..., T, N]: the query's without its head dim
    names = set(ring) | _other_explicit_axes(mesh, ring)
    return jax.shard_map(
        local, mesh=mesh, in_specs=in_specs, out_specs=(out, lse) if residual else out,
        axis_names=names, check_vma=False,  # the implementations' loops are untyped for it
    )(*args)  # fmt: skip


def _ring(attend_block, axes, devices: int, static):
    """The per-device ring (inside the shard_map), as a custom VJP."""
    steps = _Ring(attend_block, axes, devices, static)

    @jax.custom_vjp
    def ring(q, k, v, biases, mask, lengths):
        return steps.forward(q, k, v, biases, mask, lengths)[:2]

    ring.defvjp(steps.ring_fwd, steps.ring_bwd)
    return ring


@dataclasses.dataclass(frozen=True)
class _Ring:
    """The ring's steps on one device: attend_block over the key blocks passed around the
    devices of `axes`, forward and backward (the module docstring). static: the structure
    without lengths or q_offset."""

    attend_block: Callable[..., tuple[jax.Array, jax.Array]]
    axes: Any
    devices: int
    static: masking.StructuredMask

    def send(self, carry):
        """carry passed on round the ring: block d + 1 -> device d."""
        shift = [(i, (i - 1) % self.devices) for i in range(self.devices)]
        return jax.lax.ppermute(carry, axis_name=self.axes, perm=shift)

    def cut(self, x, layout: _Layout, c, t, s):
        """Block c's part of a bias or mask for this device's t queries."""
        if x is None:
            return None
        if layout.queries:
            x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.axes) * t, t, x.ndim - 2)
        if layout.keys:
            x = jax.lax.dynamic_slice_in_dim(x, c * s, s, x.ndim - 1)
        return x

    def add_cut(self, total, part, layout: _Layout, c, t, s):
        """cut's transpose: part added into total where cut took it."""
        starts = [jnp.zeros((), jnp.int32)] * total.ndim
        if layout.queries:
            starts[-2] = jax.lax.axis_index(self.axes) * t
        if layout.keys:
            starts[-1] = c * s
        if not (layout.queries or layout.keys):
            return total + part
        old = jax.lax.dynamic_slice(total, starts, part.shape)
        return jax.lax.dynamic_update_slice(total, old + part, starts)

    def block(self, c, q, carry, biases, mask, lengths, layouts):
        """Block c's (k, v, biases, mask, structure, hidden) for this device's queries."""
        static, devices = self.static, self.devices
        k, v, moving, moving_mask = carry
        t, s = q.shape[-3], k.shape[-3]
        q_offset = jax.lax.axis_index(self.axes) * t
        k_offset = c * s
        moving = iter(moving)
        biases = tuple(
            next(moving) if lay.travels else b for b, lay in zip(biases, layouts[0], strict=True)
        )
        mask = moving_mask if layouts[1].travels else mask
        biases = tuple(self.cut(b, lay, c, t, s) for b, lay in zip(biases, layouts[0], strict=True))
        mask = self.cut(mask, layouts[1], c, t, s)
        q_lengths, kv_lengths = (None if n is None else n - k_offset for n in lengths)
        structure = dataclasses.replace(
            static, q_offset=q_offset - k_offset, q_lengths=q_lengths, kv_lengths=kv_lengths
        )  # positions relative to the block's first key: the masks depend on i - j
        hidden = False
        if static.is_causal or static.window is not None:  # a block may be hidden: skipped
            lo, hi = dataclasses.replace(static, q_offset=q_offset).key_range(0, t, s * devices)
            hidden = (k_offset >= hi) | (k_offset + s <= lo)
        return k, v, biases, mask, structure, hidden

    def layouts_of(self, q, k, biases, mask):
        t, s, devices = q.shape[-3], k.shape[-3], self.devices
        return tuple(_layout(b, t, s, devices) for b in biases), _layout(mask, t, s, devices)

    def travelling(self, k, v, biases, mask, layouts):
        moving = [b for b, lay in zip(biases, layouts[0], strict=True) if lay.travels]
        return k, v, moving, mask if layouts[1].travels else None

    def forward(self, q, k, v, biases, mask, lengths):
        """(out, lse, (max, sum)): each block's attention merged into the running statistics
        by log-sum-exp (_forward_step), P steps."""
        d = jax.lax.axis_index(self.axes)
        acc = jnp.promote_types(q.dtype, jnp.float32)
        layouts = self.layouts_of(q, k, biases, mask)
        step = functools.partial(self._forward_step, d, q, biases, mask, lengths, layouts)
        # A loop, not unrolled steps: XLA would run the chain of sends ahead of the attention and
        # hold every block at once.
        shape = (*q.shape[:-1], v.shape[-1])
        stats = (
            jnp.full(q.shape[:-1], -jnp.inf, acc),
            jnp.zeros(shape, acc),
            jnp.zeros(q.shape[:-1], acc),
        )
        carry = self.travelling(k, v, biases, mask, layouts)
        state = jax.lax.fori_loop(0, self.devices - 1, step, (carry, stats))
        _, (m, num, den) = step(self.devices - 1, state, last=True)
        return (num / den[..., None]).astype(q.dtype), m + jnp.log(den), (m, den)

    def _forward_step(self, d, q, biases, mask, lengths, layouts, i, state, last=False):
        """Step i: block d + i's attention merged into (max, numerator, denominator), the next
        block in flight meanwhile."""
        carry, (m, num, den) = state
        following = carry if last else self.send(carry)  # in flight during this step's attention
        k_c, v_c, b_c, mask_c, structure, hidden = self.block(
            (d + i) % self.devices, q, carry, biases, mask, lengths, layouts
        )
        out_c, lse_c = _unless(hidden, self.attend_block, q, k_c, v_c, b_c, mask_c, structure)
        # (a hidden block gives what a block without keys gives: _keyless)
        out_c, lse_c = out_c.astype(num.dtype), lse_c.astype(num.dtype)
        new = jnp.maximum(m, lse_c)
        old_w, w = jnp.exp(m - new), jnp.exp(lse_c - new)
        num = num * old_w[..., None] + out_c * w[..., None]
        return following, (new, num, den * old_w + w)

    def ring_fwd(self, q, k, v, biases, mask, lengths):
        """The custom VJP's forward pass: (out, lse), and what the backward pass reads."""
        out, lse, stats = self.forward(q, k, v, biases, mask, lengths)
        return (out, lse), (q, k, v, biases, mask, lengths, out, stats)

    def ring_bwd(self, res, cotangents):
        """The custom VJP's backward pass: the ring run again (_backward_step), dK, dV and the
        travelling biases' gradients travelling with their blocks, home after P steps."""
        q, k, v, biases, mask, lengths, out, (m, den) = res
        g, g_lse = cotangents
        d = jax.lax.axis_index(self.axes)
        acc = m.dtype
        merged = (m, den, g.astype(acc), out.astype(acc), g_lse)  # what a block's share reads
        layouts = self.layouts_of(q, k, biases, mask)
        zeros = lambda x: jnp.zeros(x.shape, acc)
        carry = self.travelling(k, v, biases, mask, layouts)
        grads = (zeros(k), zeros(v), [zeros(b) for b in carry[2]])
        d_stay = [
            None if lay.travels else zeros(b) for b, lay in zip(biases, layouts[0], strict=True)
        ]
        step = functools.partial(self._backward_step, d, q, biases, mask, lengths, layouts, merged)
        state = (carry, grads, zeros(q), d_stay)
        state = jax.lax.fori_loop(0, self.devices - 1, step, state)
        _, grads, dq, d_stay = step(self.devices - 1, state, last=True)
        dk, dv, d_moving = grads
        d_moving = iter(d_moving)
        d_biases = tuple(
            (next(d_moving) if lay.travels else d_stay[i]).astype(b.dtype)
            for i, (b, lay) in enumerate(zip(biases, layouts[0], strict=True))
        )
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_biases, None, None

    def _backward_step(self, d, q, biases, mask, lengths, layouts, merged, i, state, last=False):
        """Step i: block c = d + i's gradients (_block_grads); dq's summed here, dK's, dV's and
        the travelling biases' sent on with the block, the staying biases' added in place."""
        carry, grads, dq, d_stay = state
        following = carry if last else self.send(carry)
        c = (d + i) % self.devices
        k_c, v_c, b_c, mask_c, structure, hidden = self.block(
            c, q, carry, biases, mask, lengths, layouts
        )
        block_grads = functools.partial(self._block_grads, self.attend_block, merged)
        keyless = functools.partial(self._block_grads, _keyless, merged)
        dq_c, dk_c, dv_c, db_c = _unless(
            hidden, block_grads, q, k_c, v_c, b_c, mask_c, structure, instead=keyless
        )
        t, s = q.shape[-3], k_c.shape[-3]
        dk, dv, d_moving = grads
        d_moving, moved, d_stay = iter(d_moving), [], list(d_stay)
        for j, (db, lay) in enumerate(zip(db_c, layouts[0], strict=True)):
            if lay.travels:
                moved.append(self.add_cut(next(d_moving), db, lay, c, t, s))
            else:
                d_stay[j] = self.add_cut(d_stay[j], db, lay, c, t, s)
        grads = self.send((dk + dk_c, dv + dv_c, moved))  # after P sends, each block is home
        return following, grads, dq + dq_c, d_stay

    @staticmethod
    def _block_grads(block, merged, q, k, v, b, mask_c, structure):
        """(dq, dk, dv, dbiases) of one block, block recomputed and differentiated with the
        merged output's cotangent weighted by the block's share, the rest by its lse's."""
        m, den, g32, out32, g_lse = merged
        acc = m.dtype
        f = lambda q, k, v, b: block(q, k, v, b, mask_c, structure)
        (out_c, lse_c), vjp = jax.vjp(f, q, k, v, b)
        # This block's share of each row, from the forward's max and sum: exp(lse_c - lse)
        # would round to 1 in rows without a key (lse = -1e9 + log(P s) is -1e9 in float32).
        w = jnp.exp(lse_c.astype(acc) - m) / den
        g_out = (g32 * w[..., None]).astype(out_c.dtype)
        g_res = w * (jnp.sum(g32 * (out_c.astype(acc) - out32), axis=-1) + g_lse)
        return jax.tree.map(lambda x: x.astype(acc), vjp((g_out, g_res.astype(lse_c.dtype))))


def _unless(hidden, fn, q, k, v, biases, mask, structure, *, instead=None):
    """fn(...) unless the block is hidden (a traced bool, or False), then instead(...)
    (default _keyless): a lax.cond, so a hidden block costs a mean over its values."""
    args = (q, k, v, biases, mask, structure)
    if hidden is False:
        return fn(*args)
    return jax.lax.cond(hidden, instead or _keyless, fn, *args)


def _keyless(q, k, v, biases, mask, structure):
    """(out, lse) of a block none of whose keys a query may attend, as an implementation gives
    them for rows without a key: the uniform average of the block's values as given (query head
    n reads kv head n // (N / K)) and the log-sum-exp MASK_VALUE + log(s), queries beyond their
    length zero. So a query without a key anywhere averages every block alike: the uniform
    average over all keys, as on one device; a query with one weighs this block exp(-1e9)."""
    del k, biases, mask
    acc = jnp.promote_types(v.dtype, jnp.float32)
    mean = jnp.mean(v.astype(acc), axis=-3)  # [..., K, Hv]
    mean = jnp.repeat(mean, q.shape[-2] // v.shape[-2], axis=-2)  # [..., N, Hv]
    out = jnp.broadcast_to(mean[..., None, :, :], (*q.shape[:-1], v.shape[-1]))
    if structure.q_lengths is not None:
        i = structure.q_offset + jnp.arange(q.shape[-3], dtype=jnp.int32)  # [t]
        valid = i < structure.q_lengths[..., None]  # [..., t]
        out = jnp.where(valid[..., None, None], out, jnp.zeros((), out.dtype))
    lse = jnp.full(q.shape[:-1], numerics.MASK_VALUE + math.log(v.shape[-3]), acc)
    return out.astype(q.dtype), lse
