"""AlphaFold 2's attention family (Jumper et al. 2021, Suppl. Alg. 7, 8, 13, 14 and 19) and dropout.

Einsum letters (AlphaFold 2's): s MSA sequences, r residues, q/k query/key residues, h heads,
c channels (c_m MSA, c_z pair); '...' extra leading batch axes.

The modules take AlphaFold 2's constructor and call signatures, parameter names, shapes and
initializers, so AF2 params apply unchanged and give the same outputs; like AF2's, they return the
*update* (no residual add, no dropout), with the input's shape. The Evoformer adds it back through
dropout; `dropout_wrapper` does that as AF2's Evoformer does:

    update = MSARowAttentionWithPairBias(cfg, gcfg)(msa_act, msa_mask, pair_act, is_training)
    msa_act = msa_act + dropout_update(cfg, gcfg, update, is_training)   # needs an 'rng' key

Parameters (AF2 model_1: c_m 256, c_z 128, 8 MSA heads, 4 triangle heads):

  msa_row_attention_with_pair_bias  query_norm/{scale,offset} [c_m], feat_2d_norm/{scale,offset}
                                    [c_z], feat_2d_weights [c_z, h] ~ N(0, 1/c_z), attention/...
  msa_column_attention              query_norm [c_m], attention/...
  msa_column_global_attention       query_norm [c_m], attention/... (GlobalAttention's)
  triangle_attention                query_norm [c_z], feat_2d_weights [c_z, h], attention/...
  (AF2's Evoformer names the two triangle modules triangle_attention_starting_node / _ending_node.)

LayerNorms are hk.LayerNorm's formula and parameters (axis -1, scale and offset) evaluated, as in
AF2, in float32 for lower-precision inputs: their params are float32 then (AF2's bfloat16 mode),
while feat_2d_weights and the inner attention's params have the activations' dtype. The pair bias is
computed from the float32 LayerNorm output (float64 for float64 inputs) and stays float32: the op
adds it to float32 logits.

Memory: the query LayerNorm runs inside the attention's row tiles (its input_transform) and the pair
bias in tiles of pair rows, each recomputed in the backward pass, so a training step never holds a
normed copy of the MSA or pair, nor its cotangents, whole (global_config.remat_policy says what the
attention's tiles keep; modules.rows_per_tile how many rows a tile holds).

Masks are AF2's float 0/1 masks (bool and integer masks work too) and are turned into a boolean key
mask with `mask.astype(bool)`, i.e. nonzero = attend, which is what AF2's `jnp.where(mask, ...)` does
with a float mask. A fully masked row or column gives a finite update (a uniform average).

Column attention (Alg. 8) and ending-node attention (Alg. 14) are AF2's row algorithm on the
transposed activations, written as that: swap the two position axes, the shared
gated_attention.Attention (LayerNorm inside its tiles), swap back. XLA fuses the swap back into the
output projection's bias add (one loop writes the result transposed), so the only transposed copy is
the one of the input, which the op's batch-leading layout needs once for q, k, v and the gate alike
(projecting into a transposed layout instead would transpose each of them). Column global attention
(Alg. 19) transposes nothing: GlobalAttention(positions_first=True) reads the MSA as it lies.

Extra leading axes ([..., N_seq, N_res, c]) are mapped with hk.vmap (parameters shared), so a batch of
pair representations keeps its [h, r, r] bias per example and never broadcast to [s, h, r, r].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from gated_attention.af2 import config as config_lib
from gated_attention.af2 import modules, pair_bias
from gated_attention.core import checks
from gated_attention.parallel import sharding

# --------------------------------------------------------------------------------------------------
# Checks and small pieces shared by the modules.


def _check_act(name: str, x: Any, expected: str) -> None:
    checks.check_float_array(name, x)  # 8-bit floats refused here, naming the family's argument
    if x.ndim < 3:
        raise ValueError(f"{name} must have rank >= 3 ({expected}), got shape {tuple(x.shape)}")


def _check_mask(name: str, mask: Any, expected: tuple[int, ...], act_name: str) -> None:
    dtype = jnp.result_type(mask)
    if not (
        dtype == jnp.bool_
        or jnp.issubdtype(dtype, jnp.floating)
        or jnp.issubdtype(dtype, jnp.integer)
    ):
        raise TypeError(f"{name} must be a float 0/1 (or bool) mask, got dtype {dtype}")
    if tuple(mask.shape) != expected:
        raise ValueError(
            f"{name} of shape {tuple(mask.shape)} must be {act_name}'s shape without channels, "
            f"{expected}"
        )


def _check_orientation(config: config_lib.ModuleConfig, expected: str, module: str) -> None:
    if config.orientation != expected:
        raise ValueError(
            f"config.orientation must be {expected!r} for {module} (as in AF2's config), got "
            f"{config.orientation!r}"
        )


def _on_rows_with_params(fn, args, placement, row_dims, out_dim, mapper=None):
    """sharding.on_rows (or mapper, of the same arguments) for a module's Haiku code: its
    parameters enter the shard_map as replicated arguments, handed to fn's get_parameter calls
    by a custom getter (a shard_map may not close over values typed on Explicit mesh axes, as
    parameters placed on the mesh are)."""
    prefix = hk.experimental.current_name()
    params = {
        scope: leaves
        for scope, leaves in hk.experimental.get_params().items()
        if scope == prefix or scope.startswith(prefix + "/")
    }

    def body(params, *args):
        def local(next_getter, value, context):
            del value  # the value outside the shard_map: not to be used in here
            return next_getter(params[context.module_name][context.name])

        with hk.custom_getter(local):
            return fn(*args)

    dims = (None, *row_dims)  # the parameters: replicated
    mapper = mapper or sharding.on_rows
    return mapper(body, (params, *args), placement, row_dims=dims, out_dims=out_dim)


def _to_columns(placement, act, mask):
    """act [..., X, Y, c] and mask [..., X, Y] with X split over devices -> Y split instead (one
    all-to-all each); unchanged when nothing is split."""
    if placement is None:
        return act, mask
    axes = placement[1]
    return (
        sharding.rows_to_columns(act, axes, rows=act.ndim - 3, columns=act.ndim - 2),
        sharding.rows_to_columns(mask, axes, rows=mask.ndim - 2, columns=mask.ndim - 1),
    )


def _to_rows(placement, out):
    """_to_columns' way back for an update [..., X, Y, c]: Y split -> X split."""
    if placement is None:
        return out
    return sharding.rows_to_columns(out, placement[1], rows=out.ndim - 2, columns=out.ndim - 3)


def _check_msa(msa_act: Any, msa_mask: Any) -> None:
    _check_act("msa_act", msa_act, "[..., N_seq, N_res, c_m]")
    _check_mask("msa_mask", msa_mask, tuple(msa_act.shape[:-1]), "msa_act")


def _key_mask(mask: jax.Array) -> jax.Array:
    """[..., b, k] 0/1 mask -> bool [..., b, 1, 1, k]: every head and query sees the same keys."""
    return mask.astype(bool)[..., :, None, None, :]


def _map_leading(fn: Callable[..., jax.Array], num_leading: int, *args: jax.Array) -> jax.Array:
    """fn(*args) with `num_leading` extra leading axes on every arg, via hk.vmap (params shared)."""
    for _ in range(num_leading):
        fn = hk.vmap(fn, split_rng=False)
    return fn(*args)


class _FamilyModule(hk.Module):
    """Shared constructor: validated configs, AF2's required orientation (if any)."""

    orientation: str | None = None

    def __init__(self, config: Any, global_config: Any, name: str):
        super().__init__(name=name)
        self.config = config_lib.module_config(config)
        self.global_config = config_lib.global_config(global_config)
        self.resolved = config_lib.resolve(self.config, self.global_config)
        if self.orientation is not None:
            _check_orientation(self.config, self.orientation, type(self).__name__)

    def _subbatch_size(self, is_training: bool) -> int | str | None:
        """AF2 subbatches at inference only (its `low_memory=not is_training`)."""
        return None if is_training else self.global_config.subbatch_size

    def _pair_bias(self, pair_act, norm, dtype) -> jax.Array:
        budget = self.resolved.budget_bytes
        return pair_bias.of_pair(pair_act, norm, self.config.num_head, dtype, budget)

    @hk.transparent
    def _placement(self):
        """(mesh, axes) the rows are split over (global_config.shard_rows_over), or None. Not while
        Haiku initializes: parameters are created outside any shard_map."""
        if hk.running_init():
            return None
        return sharding.mesh_axes(self.global_config.shard_rows_over)

    @hk.transparent
    def _grid(self):
        """(mesh, (rows axes, columns axes)) when global_config tiles the inputs over a 2D grid
        (shard_columns_over with shard_rows_over), else None; None while Haiku initializes
        (parameters are created outside any shard_map)."""
        gc = self.global_config
        if gc.shard_columns_over is None or hk.running_init():
            return None
        what = "global_config.shard_columns_over"
        columns = sharding.mesh_axes(gc.shard_columns_over, what)
        rows = sharding.mesh_axes(gc.shard_rows_over)
        if rows is None or columns is None:
            raise ValueError(
                f"{what}={gc.shard_columns_over!r} tiles the inputs over a 2D grid with "
                f"shard_rows_over, got shard_rows_over={gc.shard_rows_over!r}"
            )
        return rows[0], (rows[1], columns[1])

    @hk.transparent
    def _on_grid(self, update, args, dims, grid):
        """update(*tiles) -> [..., X, Y, c] with each device on its own tile: arg i split along
        dims[i] (over the rows axes) and dims[i] + 1 (the columns axes), in a shard_map over
        both, so update sees both as manual."""
        mesh, axes = grid

        def tiles(fn, args, _, *, row_dims, out_dims):
            return sharding.on_tiles(fn, args, mesh, axes, dims=row_dims, out_dim=out_dims)

        return _on_rows_with_params(update, args, None, dims, args[0].ndim - 3, tiles)

    @hk.transparent  # the parameters keep AF2's names: no '~_on_rows' scope
    def _on_rows(self, update, args, row_dims):
        """update(*args) -> [..., X, Y, c] with each device on its own rows X (row_dims: each
        arg's row dimension), or as it is when no rows are split over devices."""
        placement = self._placement()
        if placement is None:
            return update(*args)
        out_dim = args[0].ndim - 3
        return _on_rows_with_params(update, args, placement, row_dims, out_dim)

    @hk.transparent
    def _attention(
        self, act, norm, mask, bias, is_training, keys_over=None, positions_first=False
    ) -> jax.Array:
        """The inner gated self-attention ('attention') of the layer-normed act: [..., b, q, c] ->
        [..., b, q, c] ([q, b, c] with positions_first: the columns of act as it lies);
        keys_over: the mesh axes its positions are split over (a ring), if any."""
        # This module placed the rows (_on_rows, _on_grid): the attention splits none again.
        placement = sharding.Placement.resolve(None, keys_over, initializing=hk.running_init())
        attention = modules.Attention(
            self.config, self.global_config, act.shape[-1], name="attention", placement=placement
        )
        return attention(
            act,
            act,
            mask,
            bias,
            subbatch_size=self._subbatch_size(is_training),
            input_transform=pair_bias.normalizer(norm),
            positions_first=positions_first,
        )


# --------------------------------------------------------------------------------------------------
# The modules.


class MSARowAttentionWithPairBias(_FamilyModule):
    """MSA row-wise gated self-attention with pair bias (AF2 Suppl. Alg. 7).

    Each MSA row attends over residues; the LayerNorm'ed pair representation, projected to one
    [r, r] bias per head by feat_2d_weights, is shared by all rows.
    """

    orientation = "per_row"

    def __init__(
        self, config: Any, global_config: Any, name: str = "msa_row_attention_with_pair_bias"
    ):
        """Constructs the module.

        Args:
          config: AF2's module config (num_head, gating, orientation='per_row', dropout_rate,
            shared_dropout, optional key_dim/value_dim); see config.ModuleConfig.
          global_config: AF2's global config plus ours; see config.GlobalConfig.
          name: Haiku module name.
        """
        super().__init__(config, global_config, name)

    def __call__(self, msa_act, msa_mask, pair_act, is_training: bool = False) -> jax.Array:
        """The update to msa_act.

        Args:
          msa_act: [..., N_seq, N_res, c_m] MSA representation.
          msa_mask: [..., N_seq, N_res] 0/1 mask of non-padded positions (float, bool or int).
          pair_act: [..., N_res, N_res, c_z] pair representation (same leading axes).
          is_training: training mode: no inference subbatching.

        Returns:
          [..., N_seq, N_res, c_m] in msa_act's dtype.
        """
        _check_msa(msa_act, msa_mask)
        _check_act("pair_act", pair_act, "[..., N_res, N_res, c_z]")
        lead, (num_res, _) = msa_act.shape[:-3], msa_act.shape[-2:]
        expected = (*lead, num_res, num_res)
        if tuple(pair_act.shape[:-1]) != expected:
            raise ValueError(
                f"pair_act of shape {tuple(pair_act.shape)} must be [..., N_res, N_res, c_z] with "
                f"msa_act's leading axes and N_res: {expected} + (c_z,)"
            )

        grid = self._grid()
        placement = None if grid else self._placement()

        def update(msa_act, msa_mask, pair_act):
            norm = pair_bias.norm_params("query_norm", msa_act.shape[-1], msa_act.dtype)
            pair_norm = pair_bias.norm_params("feat_2d_norm", pair_act.shape[-1], pair_act.dtype)
            bias = self._pair_bias(pair_act, pair_norm, msa_act.dtype)  # [h, r, r]
            keys_over = None
            if grid:  # the pair tile's bias: every query of this device's keys, which travel
                rows, keys_over = grid[1]
                bias = jax.lax.all_gather(bias, rows, axis=1, tiled=True)
            elif placement is not None:  # this device's pair rows' bias: every row needs all
                bias = jax.lax.all_gather(bias, placement[1], axis=1, tiled=True)
            mask = _key_mask(msa_mask)
            return self._attention(msa_act, norm, mask, bias, is_training, keys_over)

        if grid:  # the MSA and the pair tiled alike: sequences / residues over rows x columns
            update_all = lambda *a: _map_leading(update, len(lead), *a)
            return self._on_grid(update_all, (msa_act, msa_mask, pair_act), (-3, -2, -3), grid)
        return self._on_rows(
            lambda *a: _map_leading(update, len(lead), *a),
            (msa_act, msa_mask, pair_act),
            row_dims=(-3, -2, -3),
        )


class MSAColumnAttention(_FamilyModule):
    """MSA column-wise gated self-attention (AF2 Suppl. Alg. 8): each column attends over sequences."""

    orientation = "per_column"

    def __init__(self, config: Any, global_config: Any, name: str = "msa_column_attention"):
        """Constructs the module; config.orientation must be 'per_column' (AF2's config)."""
        super().__init__(config, global_config, name)

    def __call__(self, msa_act, msa_mask, is_training: bool = False) -> jax.Array:
        """The update to msa_act.

        Args:
          msa_act: [..., N_seq, N_res, c_m].
          msa_mask: [..., N_seq, N_res] 0/1 mask (float, bool or int).
          is_training: training mode: no inference subbatching.

        Returns:
          [..., N_seq, N_res, c_m] in msa_act's dtype.
        """
        _check_msa(msa_act, msa_mask)
        grid = self._grid()
        placement = None if grid else self._placement()

        def update(msa_act, msa_mask):
            norm = pair_bias.norm_params("query_norm", msa_act.shape[-1], msa_act.dtype)
            mask = _key_mask(jnp.swapaxes(msa_mask, -2, -1))  # [r, 1, 1, s]
            if not grid and placement is None:  # the columns as they lie: [s, r, c_m]
                return self._attention(msa_act, norm, mask, None, is_training, None, True)
            msa_act, msa_mask = _to_columns(placement, msa_act, msa_mask)
            cols = jnp.swapaxes(msa_act, -3, -2)  # [r, s, c_m]
            mask = _key_mask(jnp.swapaxes(msa_mask, -2, -1))  # [r, 1, 1, s]
            keys_over = grid[1][0] if grid else None  # the sequences' axis: a ring over it
            out = self._attention(cols, norm, mask, None, is_training, keys_over)
            return _to_rows(placement, jnp.swapaxes(out, -3, -2))

        if grid:
            update_all = lambda *a: _map_leading(update, msa_act.ndim - 3, *a)
            return self._on_grid(update_all, (msa_act, msa_mask), (-3, -2), grid)
        return self._on_rows(
            lambda *a: _map_leading(update, msa_act.ndim - 3, *a),
            (msa_act, msa_mask),
            row_dims=(-3, -2),
        )


class MSAColumnGlobalAttention(_FamilyModule):
    """MSA column-wise gated global self-attention (AF2 Suppl. Alg. 19), used on the extra MSA."""

    orientation = "per_column"

    def __init__(self, config: Any, global_config: Any, name: str = "msa_column_global_attention"):
        """Constructs the module; config.orientation must be 'per_column' (AF2's config)."""
        super().__init__(config, global_config, name)

    def __call__(self, msa_act, msa_mask, is_training: bool = False) -> jax.Array:
        """The update to msa_act.

        Args:
          msa_act: [..., N_seq, N_res, c_m].
          msa_mask: [..., N_seq, N_res] 0/1 mask (float, bool or int); it also masks the
            sequences averaged into each column's query.
          is_training: training mode: no inference subbatching.

        Returns:
          [..., N_seq, N_res, c_m] in msa_act's dtype.
        """
        _check_msa(msa_act, msa_mask)
        grid = self._grid()
        placement = None if grid else self._placement()

        def update(msa_act, msa_mask):
            norm = pair_bias.norm_params("query_norm", msa_act.shape[-1], msa_act.dtype)
            # On the grid each column's sequences are split over the rows axes: a ring over them.
            keys_over = grid[1][0] if grid else None
            attention = modules.GlobalAttention(
                self.config,
                self.global_config,
                msa_act.shape[-1],
                name="attention",
                # the rows placed here (_on_rows, _on_grid)
                placement=sharding.Placement.resolve(
                    None, keys_over, initializing=hk.running_init()
                ),
            )
            msa_act, msa_mask = _to_columns(placement, msa_act, msa_mask)
            # Each column (residue) attends over the sequences, the MSA as it lies: [s, r, c_m].
            out = attention(
                msa_act,
                msa_act,
                msa_mask.astype(bool),
                subbatch_size=self._subbatch_size(is_training),
                input_transform=pair_bias.normalizer(norm),
                positions_first=True,
            )
            return _to_rows(placement, out)

        update_all = lambda *a: _map_leading(update, msa_act.ndim - 3, *a)
        if grid:
            return self._on_grid(update_all, (msa_act, msa_mask), (-3, -2), grid)
        return self._on_rows(update_all, (msa_act, msa_mask), row_dims=(-3, -2))


class TriangleAttention(_FamilyModule):
    """Triangle gated self-attention (AF2 Suppl. Alg. 13 and 14).

    config.orientation 'per_row': around the starting node (Alg. 13), pair (i, j) attends over
    (i, k) with bias from (j, k); 'per_column': around the ending node (Alg. 14), the same on the
    transposed pair representation, transposed back.
    """

    def __init__(self, config: Any, global_config: Any, name: str = "triangle_attention"):
        """Constructs the module; config.orientation is 'per_row' or 'per_column'."""
        super().__init__(config, global_config, name)

    def __call__(self, pair_act, pair_mask, is_training: bool = False) -> jax.Array:
        """The update to pair_act.

        Args:
          pair_act: [..., N_res, N_res, c_z].
          pair_mask: [..., N_res, N_res] 0/1 mask (float, bool or int).
          is_training: training mode: no inference subbatching.

        Returns:
          [..., N_res, N_res, c_z] in pair_act's dtype.
        """
        _check_act("pair_act", pair_act, "[..., N_res, N_res, c_z]")
        if pair_act.shape[-3] != pair_act.shape[-2]:
            raise ValueError(
                f"pair_act of shape {tuple(pair_act.shape)} must be square, [..., N_res, N_res, c_z]"
            )
        _check_mask("pair_mask", pair_mask, tuple(pair_act.shape[:-1]), "pair_act")
        per_column = self.config.orientation == "per_column"
        if self.global_config.shard_columns_over is not None:
            return self._tiled(pair_act, pair_mask, is_training, per_column, self._grid())
        placement = self._placement()
        gather = None if placement is None else placement[1]
        update = lambda act, mask: self._update(
            act, mask, is_training, per_column, turn=placement, gather=gather
        )
        return self._on_rows(
            lambda *a: _map_leading(update, pair_act.ndim - 3, *a),
            (pair_act, pair_mask),
            row_dims=(-3, -2),
        )

    @hk.transparent
    def _tiled(self, pair_act, pair_mask, is_training, per_column, grid):
        """The pair tiled over a 2D grid (global_config.shard_rows_over x shard_columns_over),
        each device on its own tile. The starting node attends along the columns axis by a
        ring of key blocks (ring.py), the ending node along the rows axis (its batch is the
        columns): no all-to-all turns the pair. Each device computes the bias of its tile and
        gathers it over the other axis only: every query of its own keys, which travel with
        them ([h, N, N / ring devices]); the pair is never gathered."""
        keys_over = gather = None
        if grid is not None:  # the axis attended along, and the other (the bias's gather)
            keys_over, gather = grid[1] if per_column else grid[1][::-1]
        update = lambda act, mask: self._update(
            act, mask, is_training, per_column, gather=gather, keys_over=keys_over
        )
        update_all = lambda *a: _map_leading(update, pair_act.ndim - 3, *a)
        if grid is None:  # Haiku's init
            return update_all(pair_act, pair_mask)
        return self._on_grid(update_all, (pair_act, pair_mask), (-3, -2), grid)

    @hk.transparent
    def _update(
        self, pair_act, pair_mask, is_training, per_column, *, turn=None, gather=None,
        keys_over=None,
    ):  # fmt: skip
        """One device's pair rows (or tile) -> its update. turn: rows over devices, turned to
        columns by one all-to-all for the ending node and back; gather: the axes this device's
        bias rows are all-gathered over (every row needs all of them, or on the grid every
        query of its own keys); keys_over: the axes the positions are split over (a ring)."""
        norm = pair_bias.norm_params("query_norm", pair_act.shape[-1], pair_act.dtype)
        # The ending node on one device attends the pair's columns as they lie (positions
        # first), its bias the transposed one of the pair: [h, r, r], not the pair, turned.
        in_place = per_column and turn is None and gather is None and keys_over is None
        if per_column and not in_place:  # the transposed pair's rows
            pair_act, pair_mask = _to_columns(turn, pair_act, pair_mask)
            pair_act, pair_mask = jnp.swapaxes(pair_act, -3, -2), jnp.swapaxes(pair_mask, -2, -1)
        elif in_place:
            pair_mask = jnp.swapaxes(pair_mask, -2, -1)
        budget = self.resolved.budget_bytes
        # The attention reads the pair that comes back, so the bias's cotangent is added into
        # the attention's in place (pair_bias.with_pair).
        pair_act, bias = pair_bias.with_pair(
            pair_act, norm, self.config.num_head, pair_act.dtype, budget
        )  # [h, this device's rows, r (or its columns)]
        if in_place:
            bias = jnp.swapaxes(bias, -2, -1)
        if gather is not None:
            bias = jax.lax.all_gather(bias, gather, axis=1, tiled=True)
        mask = _key_mask(pair_mask)
        out = self._attention(pair_act, norm, mask, bias, is_training, keys_over, in_place)
        return _to_rows(turn, jnp.swapaxes(out, -3, -2)) if per_column and not in_place else out
