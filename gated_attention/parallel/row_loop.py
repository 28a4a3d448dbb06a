"""Inference-time subbatching over a batch axis (AlphaFold 2's `global_config.subbatch_size`).

AF2 bounds the memory of attention over an MSA or pair representation by running it on a few rows
at a time. Here that is a pure function around any batched function, e.g. the (parameter-free)
attention op, with a bias shared over the batch (size 1) passed whole:

    out = subbatch(dot_product_attention, [query, key, value, bias, None], subbatch_size=4)
    # query/key/value [B, T|S, N, H] are cut into [4, ...] pieces; bias [1, N, T, S] is shared.

The full subbatches run as one compiled loop body (a fori_loop that slices each subbatch and
writes its output in place) and a remainder, if any, as one more call: batch 10 with
subbatch_size 4 runs 4, 4 and then 2. Each piece computes exactly what fn computes on those rows,
so results match the single call within 1 ulp (bitwise for the attention op on CPU in float32, in
the tests). It works under jax.jit and jax.grad; the gradient keeps every subbatch's residuals
unless `remat` says otherwise (remat=True: nothing is kept, each subbatch is recomputed, and a
training step's memory is bounded by a subbatch too).

`rows` is the library's one row loop (subbatch's tiles, chunked's blocks of batch rows, the
fused pair-bias backward); `tiled` is that loop with a custom VJP, subbatch's only gradient path,
and knows nothing of sharding: on a mesh with explicit axes, a batch split over devices is
subbatched on each device by sharding.per_device_rows, so every device runs its own rows,
subbatch_size at a time, and no row crosses devices.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from gated_attention.core import checks
from gated_attention.parallel import sharding


def subbatch(
    fn: Callable[..., Any],
    args: Sequence[jax.Array | None],
    *,
    subbatch_size: int | None,
    axis: int = 0,
    batched: Sequence[bool] | None = None,
    remat: Callable[..., bool] | bool = False,
) -> Any:
    """Calls fn(*args) on subbatches along `axis` and concatenates the outputs along `axis`.

    Args:
      fn: function of len(args) positional arguments, returning an array or a pytree of arrays
        that each carry the batch along `axis` (same size as fn's batched inputs).
      args: arrays or None. By default an arg is batched when its size along `axis` equals the
        batch size (the size of the first arg whose size there is not 1); args of size 1 there
        and None args are shared: passed whole to every call, never broadcast in memory.
      subbatch_size: rows per call (per device when the batch is split over devices); None (or
        >= the batch size) makes a single call fn(*args).
      axis: the batch axis of every batched arg and every output leaf (negative counts from the
        end of each array).
      batched: optional explicit flag per arg; True args are cut, False args are passed whole.
      remat: False: differentiation keeps each subbatch's residuals (as jax.lax.map would); True:
        each subbatch keeps nothing and is recomputed in the backward pass; a jax.checkpoint
        policy: each keeps what the policy saves. With True, the memory of a training step is
        bounded by one subbatch too (the subbatch is cut inside the recomputed call, so its slice
        is not kept either).

    Returns:
      fn's output for the whole batch: each leaf [..., batch, ...] with batch at `axis`.

    Raises:
      TypeError: axis is not an int.
      ValueError: subbatch_size not a positive int, an arg with the axis out of range, batched args whose sizes
        along axis disagree, batched of the wrong length or marking a None arg, or an output leaf
        without the subbatch along axis.
    """
    args = tuple(args)
    size = checks.check_int("subbatch_size", subbatch_size, optional=True)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"axis must be an int, got {axis!r}")
    flags = _batched_flags(args, int(axis), batched)
    cut = [i for i, flag in enumerate(flags) if flag]
    batch = np.shape(args[cut[0]])[_axis(axis, args[cut[0]], cut[0])] if cut else 1
    shards = sharding.batch_shards([args[i] for i in cut], axis)
    if remat is True:
        remat = jax.checkpoint_policies.nothing_saveable
    remat = None if remat is False else remat
    if size is None or size >= batch // shards:
        return fn(*args) if remat is None else jax.checkpoint(fn, policy=remat)(*args)
    where = {i: _axis(axis, args[i], i) for i in cut}  # the batch axis of each cut arg

    def checked(*pieces):  # fn, with its outputs checked for the batch along `axis`
        out = fn(*pieces)
        i = cut[0]
        _check_outputs(out, axis, np.shape(pieces[i])[where[i]])
        return out

    loop = lambda fn, args, where, out_axis: tiled(fn, args, where, size, out_axis, remat)
    if shards == 1:
        return loop(checked, args, where, lambda ndim: axis % ndim)
    # The batch split over devices (explicit mesh axes): each device loops over its own rows.
    return sharding.per_device_rows(loop, checked, args, where, axis, shards)


def rows(length: int, size: int, step: Callable[[Any, int, Any], Any], carry: Any) -> Any:
    """The row loop: carry = step(start, rows, carry) over [0, length) in tiles of `size` rows,
    the full tiles as one compiled loop body (start traced) and a remainder as one more call."""
    num_full, remainder = divmod(length, size)
    if num_full == 1:
        carry = step(0, size, carry)
    elif num_full > 1:
        carry = jax.lax.fori_loop(0, num_full, lambda t, c: step(t * size, size, c), carry)
    if remainder:
        carry = step(num_full * size, remainder, carry)
    return carry


def tiled(fn, args, where: dict[int, int], size: int, out_axis, remat=None) -> Any:
    """fn on tiles of `size` rows along where[i] of each cut arg i, outputs written in place along
    out_axis(leaf rank) of one buffer per output leaf, as a custom VJP: its backward pass is a
    row loop of its own, and the only gradient path.

    remat: None keeps each tile's residuals (as autodiff of a scan would); a jax.checkpoint
    policy keeps what it saves; nothing_saveable keeps nothing and recomputes each tile in the
    backward pass. Residuals are kept in buffers stacked over the full tiles, and a closed-over
    value (a parameter) that a tile keeps as it is is kept once, not per tile.

    The backward pass writes each tile's input cotangents into (for shared args and fn's
    closed-over parameters, adds them to) buffers made when it starts, from zeros that XLA can
    neither merge with other zeros of their shape nor create early: autodiff of a loop
    accumulates from zeros that XLA merges (CSE) and creates for the earliest user, and an
    Evoformer training step compiled for an H100 held four pair-sized ones from the forward
    through its peak at N_res 1,024. Nothing here reads a sharding: buffers take the sharding
    of the values they hold (explicit mesh axes), as the rest of the program."""
    loop = _Tiled(fn, args, where, size, out_axis, remat)

    @jax.custom_vjp
    def run(consts, args):
        return loop.forward(consts, args, False)[0]

    run.defvjp(loop.run_fwd, loop.run_bwd)
    return run(loop.consts, list(args))


class _Tiled:
    """tiled's loop for one call (see tiled): fn converted for each tile size, the residual
    layout of a tile, and the custom VJP's forward and backward passes, each a row loop.

    A tile's residuals are laid out from a trace of their own (residual_layout, under
    eval_shape) and kept from the forward pass's trace, in that layout's order: _check_layout
    makes sure the two traces agree, as a different order would mix the residuals up."""

    def __init__(self, fn, args, where: dict[int, int], size: int, out_axis, remat):
        self.where, self.size, self.out_axis, self.remat = where, size, out_axis, remat
        self.first = next(iter(where))
        self.length = np.shape(args[self.first])[where[self.first]]
        self.num_full, remainder = divmod(self.length, size)
        self.keep = remat is not jax.checkpoint_policies.nothing_saveable
        sizes = [r for r in (size, remainder) if r]  # the full tiles' rows, the remainder's
        self.conversions, self.consts = self._converted(fn, args, sizes)
        # Shapes are read from specs, never from the values: a trace given this trace's tracers
        # would keep them (jax's caches) past it.
        self.const_specs = [_spec(c) for c in self.consts]
        self.arg_specs = [_spec(x) for x in args]
        self.out_specs = jax.eval_shape(
            lambda c, a: self.call(c, self.slices(a, 0, size)), self.const_specs, self.arg_specs
        )
        self.pullbacks = {}  # tile rows -> the VJP function, from the forward pass's trace
        self.layouts = {}  # tile rows -> the residual layout, from the forward pass

    def _converted(self, fn, args, sizes: list[int]):
        """({rows: (fn converted for tiles of that many rows, the indices of its consts)},
        consts): fn with its closed-over values (parameters) as explicit inputs, for each tile
        size; a value both conversions close over is one const (its cotangents summed once), so
        that every trace below sees the same distinct inputs."""
        conversions, consts = {}, []
        for n in sizes:
            specs = [self._piece_spec(i, x, n) for i, x in enumerate(args)]
            converted, found = jax.closure_convert(lambda *pieces: fn(*pieces), *specs)
            where_found = []
            for x in found:
                k = next((k for k, c in enumerate(consts) if c is x), None)
                if k is None:
                    k, consts = len(consts), [*consts, x]
                where_found.append(k)
            conversions[n] = (converted, where_found)
        return conversions, tuple(consts)

    def _piece_spec(self, i, x, rows: int):  # a tile's slice of arg i
        if x is None or i not in self.where:
            return x
        shape = list(np.shape(x))
        shape[self.where[i]] = rows
        return _spec(x, tuple(shape))

    def slices(self, xs, start, n: int):
        return [
            jax.lax.dynamic_slice_in_dim(x, start, n, axis=self.where[i]) if i in self.where else x
            for i, x in enumerate(xs)
        ]

    def call(self, consts, pieces):
        n = np.shape(pieces[self.first])[self.where[self.first]]
        converted, where_found = self.conversions[n]
        return converted(*pieces, *(consts[k] for k in where_found))

    def linearized(self, consts, pieces):
        """(the tile's output, its VJP closure) with the policy's residuals."""

        def differentiable(c, p):  # of the inexact consts and pieces only
            return self.call(_fixed(consts, c), _fixed(pieces, p))

        # (a recomputed tile is differentiated once, whole)
        if self.remat is not None and self.keep:
            differentiable = jax.checkpoint(differentiable, policy=self.remat)
        return jax.vjp(differentiable, _diff(consts), _diff(pieces))

    def pullback(self, consts, pieces):
        """(the tile's output, its VJP as a function of (cotangent, *residuals), the
        residuals): the VJP's leaves, so that they can be kept in buffers and the function
        rebuilt in the backward pass's trace."""
        y, vjp = self.linearized(consts, pieces)
        residuals, tree = jax.tree.flatten(vjp)
        return y, lambda g, *kept: jax.tree.unflatten(tree, kept)(g), residuals

    def residual_layout(self, n: int):
        """Per residual of a tile of n rows: where it comes from when it is a const or the
        tile's slice of an arg as it is (kept once, or sliced again: never stacked), else its
        ShapeDtypeStruct (read from a trace of its own)."""
        index = []

        def traced(consts, args):
            pieces = self.slices(args, 0, n)
            _, _, residuals = self.pullback(consts, pieces)
            index[:] = [_source(x, consts, pieces) for x in residuals]
            return [x for x, k in zip(residuals, index, strict=True) if k is None]

        specs = iter(jax.eval_shape(traced, self.const_specs, self.arg_specs))
        return [k if k is not None else next(specs) for k in index]

    def put(self, out, start, piece):
        """The tile's output `piece` written into the whole batch's buffers `out` at start."""
        axis = self.out_axis
        update = lambda o, x: jax.lax.dynamic_update_slice_in_dim(o, x, start, axis(x.ndim))
        return jax.tree.map(update, out, piece)

    def forward(self, consts, args, with_residuals: bool):
        """(fn's output for the whole batch, the tiles' residuals (saved: stacked over the full
        tiles; last: the remainder's), their layouts): no residuals unless with_residuals and
        the policy keeps some."""
        layouts = {}
        if with_residuals and self.keep:
            layouts = {n: self.residual_layout(n) for n in self.conversions}
        after = args[self.first]
        saved = []
        if layouts and self.num_full:  # buffers of the full tiles' residuals
            saved = [
                None if isinstance(x, tuple) else _stacked_zeros(self.num_full, x, after)
                for x in layouts[self.size]
            ]
        last = []
        step = functools.partial(self._forward_step, consts, args, layouts, last)
        out = jax.tree.map(lambda s: self._buffer(s, after), self.out_specs)
        out, saved = rows(self.length, self.size, step, (out, saved))
        return out, (saved, last), layouts

    def _buffer(self, s, after):  # an output leaf for the whole batch, made when `after` is
        shape = list(s.shape)
        shape[self.out_axis(len(shape))] = self.length
        return _fresh_zeros(shape, s.dtype, after, _sharding_of(s))

    def _forward_step(self, consts, args, layouts, last, start, n: int, carry):
        """The tile of n rows at start: its output put in place and (with layouts) its residuals
        kept, a full tile's in its entry of the stacked buffers, the remainder's in `last`."""
        out, saved = carry
        pieces = self.slices(args, start, n)
        if not layouts:
            return self.put(out, start, self.call(consts, pieces)), saved
        y, self.pullbacks[n], residuals = self.pullback(consts, pieces)
        kinds = layouts[n]
        _check_layout(kinds, residuals, {"const": consts, "piece": pieces})
        if n == self.size:
            t = start // self.size
            saved = [
                s if isinstance(k, tuple) else jax.lax.dynamic_update_index_in_dim(s, x, t, 0)
                for s, k, x in zip(saved, kinds, residuals, strict=True)
            ]
        else:  # the remainder's residuals, kept as they are
            last[:] = [
                None if isinstance(k, tuple) else x for k, x in zip(kinds, residuals, strict=True)
            ]
        return self.put(out, start, y), saved

    def run_fwd(self, consts, args):
        """The custom VJP's forward pass: the output, and what the backward pass reads. (Its
        name and run_bwd's are the ones a jaxpr shows: the tests look for them.)"""
        out, residuals, layouts = self.forward(consts, args, True)
        self.layouts.update(layouts)
        return out, (consts, args, residuals)

    def run_bwd(self, res, cotangent):
        """The custom VJP's backward pass: a row loop writing each tile's input cotangents into
        (for shared args and consts, adding them to) fresh zeros made when it starts."""
        consts, args, _ = res
        after = jax.tree.leaves(cotangent)[0]
        zeros = lambda xs: [_fresh_zeros_like(x, after) if _inexact(x) else None for x in xs]
        step = functools.partial(self._backward_step, res, cotangent)
        d_consts, d_args = rows(self.length, self.size, step, (zeros(consts), zeros(args)))
        return tuple(d_consts), list(d_args)

    def _backward_step(self, res, cotangent, start, n: int, grads):
        """The tile of n rows at start: its cotangents added to the consts' and shared args'
        and written in place into the cut args'."""
        d_consts, d_args = grads
        g = jax.tree.map(
            lambda c: jax.lax.dynamic_slice_in_dim(c, start, n, self.out_axis(c.ndim)), cotangent
        )
        dc, dp = self._tile_vjp(res, start, n)(g)
        add = lambda a, b: None if a is None else a + b
        d_consts = [add(a, b) for a, b in zip(d_consts, dc, strict=True)]
        d_args = [
            None
            if a is None
            else jax.lax.dynamic_update_slice_in_dim(a, b, start, self.where[i])
            if i in self.where
            else a + b
            for i, (a, b) in enumerate(zip(d_args, dp, strict=True))
        ]
        return d_consts, d_args

    def _tile_vjp(self, res, start, n: int):
        """The VJP of the tile of n rows at start: the forward's pullback given the tile's kept
        residuals (its entry of the stacked buffers, the remainder's, or the consts and slices
        of args they are), or with nothing kept the tile recomputed and differentiated."""
        consts, args, (saved, last) = res
        if not self.layouts:
            return self.linearized(consts, self.slices(args, start, n))[1]
        kinds = self.layouts[n]
        sources = {"const": consts, "piece": self.slices(args, start, n)}
        if n == self.size:
            t = start // self.size
            own = [
                None if s is None else jax.lax.dynamic_index_in_dim(s, t, 0, keepdims=False)
                for s in saved
            ]
        else:
            own = last
        kept = [
            sources[k[0]][k[1]] if isinstance(k, tuple) else x
            for k, x in zip(kinds, own, strict=True)
        ]
        return lambda g: self.pullbacks[n](g, *kept)


def _inexact(x) -> bool:
    return x is not None and jnp.issubdtype(x.dtype, jnp.inexact)


def _diff(xs):  # the values differentiated: the inexact ones
    return [x if _inexact(x) else None for x in xs]


def _fixed(xs, ds):  # xs with their inexact values replaced by ds's
    return [d if _inexact(x) else x for x, d in zip(xs, ds, strict=True)]


def _check_layout(kinds, residuals, sources) -> None:
    """The residuals of a tile's trace are those its layout (read from another trace) says, in
    order: a wrong order would silently mix residuals up, so a difference is an error."""
    same = len(kinds) == len(residuals) and all(
        residual is sources[k[0]][k[1]]
        if isinstance(k, tuple)
        else (np.shape(residual), residual.dtype) == (k.shape, k.dtype)
        for k, residual in zip(kinds, residuals, strict=False)
    )
    if not same:
        raise RuntimeError(
            "mapping.tiled: a tile's residuals differ from the layout traced for them "
            f"({len(residuals)} against {len(kinds)}); please report this with fn"
        )


def _spec(x, shape=None):
    """x's ShapeDtypeStruct (of `shape` if given; with x's sharding where explicit), or None."""
    if x is None:
        return None
    shape = np.shape(x) if shape is None else shape
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=_sharding_of(x))


def _source(x, consts, pieces) -> tuple[str, int] | None:
    """("const", k) or ("piece", i) when residual x is that value as it is, else None."""
    for name, values in (("const", consts), ("piece", pieces)):
        k = next((k for k, c in enumerate(values) if x is c), None)
        if k is not None:
            return name, k
    return None


def _sharding_of(x):
    """x's sharding where it is part of its type (explicit mesh axes), else None: what a buffer
    holding x's values is made with."""
    if isinstance(x, jax.ShapeDtypeStruct):
        sharding = x.sharding
    else:
        sharding = getattr(jax.typeof(x), "sharding", None)
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return sharding if any(t == jax.sharding.AxisType.Explicit for t in types) else None


def _fresh_zeros(shape, dtype, after: jax.Array, out_sharding) -> jax.Array:
    """Zeros of `shape` that XLA can neither merge with other zeros of that shape nor create
    before `after` exists (see tiled): a loop's buffer made when its input is."""
    # Works around XLA's CSE, which merges zeros of one shape into one made for the earliest user.
    zero = jax.lax.optimization_barrier((jnp.zeros((), dtype), after))[0]
    zeros = jnp.broadcast_to(zero, shape)
    # reshard, not broadcast_to's out_sharding: jax 0.12 drops that outside a mesh context.
    return zeros if out_sharding is None else jax.sharding.reshard(zeros, out_sharding)


def _stacked_zeros(count: int, spec, after: jax.Array) -> jax.Array:
    """_fresh_zeros [count, *spec.shape], each entry sharded as spec."""
    zeros = _fresh_zeros(spec.shape, spec.dtype, after, _sharding_of(spec))
    return jnp.broadcast_to(zeros[None], (count, *spec.shape))


def _fresh_zeros_like(x: jax.Array, after: jax.Array) -> jax.Array:
    """_fresh_zeros of x's shape, dtype and sharding."""
    return _fresh_zeros(x.shape, x.dtype, after, _sharding_of(x))


def subbatch_size_for_budget(batch: int, bytes_per_example: Real, memory_budget_bytes: Real) -> int:
    """The largest subbatch whose working set, subbatch * bytes_per_example, fits the budget.

    bytes_per_example is the caller's estimate of the peak memory one batch row needs inside fn,
    e.g. for dense attention over one MSA row with N heads, T queries and S keys in float32,
    about 2 * N * T * S * 4 bytes (logits and softmax weights). The result is clipped to
    [1, batch]: at least one row always runs, even if it alone exceeds the budget.

    Args:
      batch: the batch size (a positive int).
      bytes_per_example: working-set bytes per batch row (> 0).
      memory_budget_bytes: bytes available for one call's working set (> 0).

    Returns:
      An int in [1, batch], suitable as subbatch(..., subbatch_size=...).
    """
    batch = checks.check_int("batch", batch)
    checks.check_positive_number("bytes_per_example", bytes_per_example)
    checks.check_positive_number("memory_budget_bytes", memory_budget_bytes)
    return max(1, min(batch, int(memory_budget_bytes // bytes_per_example)))


def _axis(axis: int, arg: Any, index: int) -> int:
    """Normalizes `axis` for args[index], raising when the arg has no such axis."""
    ndim = np.ndim(arg)
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"axis={axis} is out of range for args[{index}] of shape {np.shape(arg)} (rank {ndim})"
        )
    return axis % ndim


def _batched_flags(args: tuple, axis: int, batched: Sequence[bool] | None) -> list[bool]:
    """Decides which args are cut, and checks that their sizes along `axis` agree."""
    if batched is None:
        sizes = {i: np.shape(a)[_axis(axis, a, i)] for i, a in enumerate(args) if a is not None}
        source = next((i for i, s in sizes.items() if s != 1), None)
        for i, s in sizes.items():
            if source is not None and s not in (1, sizes[source]):
                raise ValueError(
                    f"args[{i}] has size {s} along axis {axis}, but the batch size is "
                    f"{sizes[source]} (from args[{source}]); expected {sizes[source]}, or 1 to "
                    "share the arg across subbatches"
                )
        return [source is not None and sizes.get(i) == sizes[source] for i in range(len(args))]
    flags = [bool(b) for b in batched]
    if len(flags) != len(args):
        raise ValueError(f"batched has {len(flags)} entries, expected one per arg ({len(args)})")
    sizes = {}
    for i, flag in enumerate(flags):
        if flag and args[i] is None:
            raise ValueError(f"batched[{i}] is True but args[{i}] is None")
        if flag:
            sizes[i] = np.shape(args[i])[_axis(axis, args[i], i)]
    for i, s in sizes.items():
        first = next(iter(sizes))
        if s != sizes[first]:
            raise ValueError(
                f"args[{i}] has size {s} along axis {axis}, but the batch size is "
                f"{sizes[first]} (from args[{first}]); batched args must agree"
            )
    return flags


def _check_outputs(tree: Any, axis: int, size: int) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = np.shape(leaf)
        if not shape or not -len(shape) <= axis < len(shape) or shape[axis] != size:
            raise ValueError(
                f"fn output{jax.tree_util.keystr(path)} has shape {shape}, but subbatch "
                f"concatenates outputs along axis {axis}, so it needs the subbatch size {size} "
                "there"
            )
