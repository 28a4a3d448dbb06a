"""AlphaFold 2's gated Attention and GlobalAttention as Haiku modules, over one attention op.

Einsum letters (AlphaFold 2's): b batch, q query positions, k key positions, h heads, c per-head
channel, a query input channels, m key/value input channels, o output channels; '...' extra leading
batch axes. Projections are written '...qhc' (a plain matmul on CPU; '...hqc' costs 3-4x), the op's
public layout; implementations change layout inside their own tiles.

Parameter names, shapes and initializers are AlphaFold 2's (params.py), so AF2 params apply unchanged.
The module owns parameters, gate and output projection and calls the op once, passing the
implementation the configs name; it never branches on it nor asks the op what it will do. Its one
tiling rule (rows_per_tile) decides whether the whole forward runs in tiles of batch rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from gated_attention.af2 import config as config_lib
from gated_attention.af2 import inputs
from gated_attention.attention import api as attention
from gated_attention.core import checks, memory, numerics, platforms
from gated_attention.parallel import row_loop as mapping
from gated_attention.parallel import sharding


def _glorot_uniform() -> hk.initializers.Initializer:
    return hk.initializers.VarianceScaling(1.0, mode="fan_avg", distribution="uniform")


class _AttentionModule(hk.Module):
    """What Attention and GlobalAttention share: validated configs, the output width, and the
    steps around the op: parameters in the compute dtype, and the forward in row tiles."""

    def __init__(
        self,
        config: Any,
        global_config: Any,
        output_dim: int,
        name: str = "attention",
        *,
        placement: sharding.Placement | None = None,
    ):
        """Constructs the module.

        Args:
          config: module config (AF2's: num_head, gating, optional key_dim/value_dim, ...); unknown
            keys raise ValueError. See config.ModuleConfig.
          global_config: AF2's global config (zero_init, subbatch_size, ...) plus
            attention_implementation, chunk sizes, memory_budget_mib and compute_dtype. See
            config.GlobalConfig.
          output_dim: o, channels of the output.
          name: Haiku module name.
          placement: where it runs over the mesh, as the module around it resolved it (the
            family modules); None: resolved from global_config at each call.
        """
        super().__init__(name=name)
        self.config = config_lib.module_config(config)
        self.global_config = config_lib.global_config(global_config)
        self.resolved = config_lib.resolve(self.config, self.global_config)
        checks.check_int("output_dim", output_dim)
        self.output_dim = output_dim
        if placement is not None and not isinstance(placement, sharding.Placement):
            raise TypeError(f"placement must be a sharding.Placement or None, got {placement!r}")
        self.placement = placement

    def _placement(self) -> sharding.Placement:
        """The placement given, else global_config's, resolved once per call."""
        if self.placement is not None:
            return self.placement
        gc = self.global_config
        return sharding.Placement.resolve(
            gc.shard_rows_over, gc.shard_columns_over, initializing=hk.running_init()
        )

    def _run(
        self, make_forward, params, dtype, args, subbatch_size, placement, axis=0,
        positions_first=False, packable=False, recompute=False, **row,
    ):  # fmt: skip
        """make_forward(implementation, compute dtype, params cast to it) -> forward,
        called on args in tiles of rows along `axis` (the batch rows) by rows_per_tile(**row).

        positions_first: args[0] and args[1] are [positions, batch, channels] (the rest batch
        first). Compiled for a GPU as one call, forward reads them as they lie
        (make_forward(..., positions_first=True): the kernel reads the columns in place);
        elsewhere, and in tiles, they are transposed to batch first and the output back.
        packable: make_forward also takes packed=True, a forward that projects q, k and v as
        one packed array the kernel reads in place (Attention's self-attention): taken where
        the call is one pass on a GPU, as positions_first's reading in place.
        recompute: an untiled call saves for its backward what a tile would (remat_policy).

        The compute dtype (numerics.compute_dtype), the budget and the tile rule follow the platform the
        program is compiled for, as the op's choice does (platforms.py): decided for every kind
        the call may be compiled for, kinds that decide alike sharing one traced branch.
        args: arrays with the batch along `axis`, or with size 1 there (shared), or None. Under
        differentiation each tile saves what global_config.remat_policy says and recomputes the
        rest in the backward pass (remat_saveable).
        """
        resolved = self.resolved
        implementation, policy = resolved.implementation, resolved.compute_dtype
        lead = lambda i, x: x.shape[1 if positions_first and i < 2 else axis]
        batch = lead(0, args[0])
        batched = [x is not None and lead(i, x) == batch for i, x in enumerate(args)]
        remat = remat_saveable(resolved.remat_policy)
        swap = lambda x: None if x is None else jnp.swapaxes(x, 0, 1)

        @functools.cache
        def branch(compute, rows, in_place):  # kinds deciding alike share one
            def in_tiles(params, *args):
                p = numerics.cast_floats(params, compute)
                if in_place:
                    layout = dict(positions_first=positions_first, packed=packable)
                    return make_forward(implementation, compute, p, **layout)(*args)
                if positions_first:
                    args = (swap(args[0]), swap(args[1]), *args[2:])
                forward = make_forward(implementation, compute, p)
                if rows is None:
                    out = (jax.checkpoint(forward, policy=remat) if recompute else forward)(*args)
                else:
                    out = mapping.subbatch(
                        forward, args, subbatch_size=rows, batched=batched, axis=axis, remat=remat
                    )
                return swap(out) if positions_first else out

            return in_tiles

        rows = placement.rows
        if rows is not None:  # each device its own rows: the tiles' rule sees those
            batch //= math.prod(rows[0].shape[a] for a in rows[1])

        def per_platform(params, *args):
            def plan(kind):
                compute = numerics.compute_dtype(dtype, policy, backend=kind)
                budget, size = resolved.budget_bytes(kind), jnp.dtype(compute).itemsize
                tiles = rows_per_tile(
                    batch, subbatch_size, budget, platform=kind, itemsize=size, **row
                )
                one_pass = positions_first or packable
                return compute, tiles, one_pass and reads_in_place(kind, tiles)

            plans = {kind: plan(kind) for kind in platforms.candidates(args)}
            branches = {kind: branch(*plan) for kind, plan in plans.items()}
            return platforms.dispatch(branches, params, *args)

        if rows is None:
            return per_platform(params, *args)
        # The parameters enter as a (replicated) argument: a shard_map may not close over values
        # typed on Explicit mesh axes, as parameters placed on the mesh are.
        dims = [None, *(axis if flag else None for flag in batched)]
        out_dim = axis % args[0].ndim
        return sharding.on_rows(
            per_platform, (params, *args), rows, row_dims=dims, out_dims=out_dim
        )


# The module's own tiling for speed on CPU, where a tile whose logits stay near TILE_BYTES stays
# in cache (core/memory.py), once a tile holds enough queries for its projections' matmuls to
# gain (scripts/benchmark.py: the triangle shape).
TILE_BYTES = memory.TILE_BYTES
MIN_TILE_QUERIES = 1024


def rows_per_tile(
    batch: int,
    subbatch_size,
    memory_budget_bytes: int,
    *,
    row_bytes: int,
    tile_row_bytes: int,
    row_queries: int,
    row_logits: int | None,
    platform: str | None = None,
    itemsize: int = 4,
) -> int | None:
    """Rows of the leading axis per tile of a module's whole forward, or None (one call).

    The module-side tiling rule, the one place besides an implementation's own tiles. A tile
    holds as many rows as a memory bound allows, at tile_row_bytes each:
      the bound is half of memory_budget_bytes (global_config.memory_budget_mib): the other half
        is for what the tiles assemble (the stacked outputs and input cotangents of the loop);
      with an int subbatch_size (AF2's inference subbatching) it is the larger of that and the
        memory AF2's dense attention takes for subbatch_size rows (subbatch_size * row_bytes):
        AF2's knob is read as the memory bound it exists for, not as a tile of that many rows,
        which would starve the projections' matmuls;
      subbatch_size None or 'auto': the budget alone.
    On CPU a tile is also cut to about TILE_BYTES of float32 logits when such a tile holds at
    least one row and MIN_TILE_QUERIES queries (cache-sized tiles, for speed). On a GPU the
    module is one call whenever all its rows fit the whole budget (one call assembles nothing):
    a row loop there only serializes kernels that fill the device.

    Args:
      batch: rows of the leading axis.
      subbatch_size: None, 'auto' or an int >= 1 (validated by the caller).
      memory_budget_bytes: global_config.memory_budget_mib in bytes.
      row_bytes: AF2's dense working set for one row (float32 logits and weights, projections).
      tile_row_bytes: ours for one row in a training step: activations, projections and their
        cotangents, without the logits, which every implementation holds only a tile of at a
        time (xla: tile_bytes, chunked: its chunks, pallas: its blocks).
      row_queries: query positions in one row.
      row_logits: logits (heads x queries x keys) in one row, or None: too few to tile for.
      platform: the kind the program is compiled for (platforms.py; None: the host's).
      itemsize: bytes of an element of the compute dtype: tile_row_bytes counts float32 ones.
    """
    tile_row_bytes = max(1, tile_row_bytes * itemsize // memory.FLOAT32_BYTES)
    bound = memory.module_tile_budget(memory_budget_bytes, subbatch_size, row_bytes)
    rows = mapping.subbatch_size_for_budget(batch, tile_row_bytes, bound)
    platform = platforms.host() if platform is None else platform
    if memory.one_call(platform, batch * tile_row_bytes, memory_budget_bytes):
        return None
    if row_logits is not None and platform == "cpu":
        cache_rows = memory.logits_rows(TILE_BYTES, row_logits)
        if cache_rows >= 1 and cache_rows * row_queries >= MIN_TILE_QUERIES:
            rows = min(rows, cache_rows)
    return rows if rows < batch else None


def reads_in_place(kind: str, rows: int | None) -> bool:
    """Whether a module call compiled for this platform kind hands the op its data as it lies:
    on a GPU in one call (rows None), where the kernels read positions-first columns and packed
    q/k/v in place; on CPU and TPU, and in row tiles, positions-first data is transposed to
    batch first (XLA's fast layout there, and the tiles' axis) and q, k and v are projected
    apart (XLA:CPU's dots and fusions take them so)."""
    return kind == "gpu" and rows is None


def remat_saveable(policy: str):
    """What a row tile saves for the backward pass (a jax.checkpoint policy), by
    global_config.remat_policy: 'nothing' (the default): only the tile's inputs, the whole tile
    recomputed, the least memory, and on CPU the fastest too (scripts/benchmark.py's family
    suite: saving costs more memory traffic than recomputing the projections); 'projections':
    the matmuls without batch dimensions (q, k, v, gate), attention recomputed; 'everything':
    nothing recomputed."""
    return {
        "nothing": jax.checkpoint_policies.nothing_saveable,
        "projections": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        "everything": jax.checkpoint_policies.everything_saveable,
    }[policy]


class Attention(_AttentionModule):
    """AlphaFold 2's gated multi-head attention (Jumper et al. 2021, Suppl. Alg. 7 and relatives).

    Parameters (a = q_data channels, m = m_data channels, h = num_head, c = key_dim // h,
    cv = value_dim // h, o = output_dim): query_w [a, h, c], key_w [m, h, c], value_w [m, h, cv],
    gating_w [a, h, cv] and gating_b [h, cv] when config.gating, output_w [h, cv, o], output_b [o];
    created in q_data's dtype with AlphaFold 2's initializers. The forward runs in the dtype of
    global_config.compute_dtype's policy (numerics.py: float32 for bfloat16/float16 on CPU by
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
        input_transform: Callable[[jax.Array], jax.Array] | None = None,
        positions_first: bool = False,
    ) -> jax.Array:
        """Attends from q_data to m_data.

        Args:
          q_data: [..., b, q, a] queries (and gate input).
          m_data: [..., b, k, m] keys and values; same dtype as q_data.
          mask: None or bool, broadcastable to [..., b, h, q, k] (AF2 passes [b, 1, 1, k]) or a
            [..., b, q, k] mask applied to every head. False = masked out.
          nonbatched_bias: None, [h, q, k] or [q, k]; shared by the batch, never broadcast to it.
          bias: None or an additive float bias broadcastable like mask (AF2 before 2023, ColabFold).
          subbatch_size: None, 'auto' or an int >= 1 (AF2's global_config.subbatch_size, read as
            a memory bound): how many rows of the leading batch axis a tile holds is
            rows_per_tile's rule. The whole forward (projections, op, gate, output) runs per tile;
            results equal the untiled ones up to float rounding.
          input_transform: None, or a pure function applied to q_data and m_data inside each
            tile before the projections, keeping shape and dtype (the family modules' LayerNorm:
            recomputed per tile in the backward pass instead of saved whole).
          positions_first: q_data [q, b, a], m_data [k, b, m] and the output [q, b, output_dim]
            instead (mask and nonbatched_bias as above): AF2's column-wise attention on the MSA
            or pair as it lies, read in place by the GPU kernel where one call fits (_run).

        Returns:
          [..., b, q, output_dim] in q_data's dtype ([q, b, output_dim] with positions_first).
        """
        inputs.check_subbatch_size(subbatch_size)
        checks.check_bool("positions_first", positions_first)
        placement = self._placement()
        if positions_first:
            batch, q_len, k_len = inputs.positions_first(q_data, m_data, placement)
        else:
            inputs.check_data(q_data, m_data)
            batch, q_len, k_len = q_data.shape[:-2], q_data.shape[-2], m_data.shape[-2]
        a, m = q_data.shape[-1], m_data.shape[-1]
        h = self.config.num_head
        key_dim, value_dim = inputs.head_dims(self.config, a, m)
        mask, biases = inputs.mask_and_biases(
            mask, nonbatched_bias, bias, batch, h, q_len, k_len, placement.ring
        )
        shapes = (a, h, key_dim), (m, h, key_dim), (m, h, value_dim)
        params = _create_params(self, *shapes, q_data.dtype)
        make_forward = functools.partial(
            _attention_forward, input_transform, key_dim**-0.5, placement.keys
        )
        # Per row: AF2's dense working set, and ours in a training step (memory.py).
        queries, keys = math.prod(q_data.shape[1:-1]), math.prod(m_data.shape[1:-1])
        if positions_first:
            queries, keys = q_len, k_len
        dims = dict(heads=h, queries=queries, keys=keys, key_dim=key_dim, value_dim=value_dim)
        row_bytes = memory.attention_row_bytes(k_len=k_len, **dims)
        tile_row_bytes = memory.attention_tile_row_bytes(
            q_channels=a, m_channels=m, output_dim=self.output_dim, **dims
        )
        args = [q_data, None if m_data is q_data else m_data, mask, *biases]
        # Self-attention with one head dim: q, k and v can be one projection (_attention_forward).
        packable = m_data is q_data and key_dim == value_dim and placement.keys is None
        return self._run(
            make_forward,
            params,
            q_data.dtype,
            args,
            subbatch_size,
            placement,
            positions_first=positions_first,
            packable=packable,
            row_bytes=row_bytes,
            tile_row_bytes=tile_row_bytes,
            row_queries=queries,
            row_logits=h * queries * k_len,
        )


def _attention_forward(
    input_transform, scale, keys_over, implementation, compute, p, positions_first=False,
    packed=False,
):  # fmt: skip
    """Attention's forward over one tile, parameters p closed over (a pure function);
    positions_first: q_data and m_data [positions, batch, channels], as the op takes them;
    packed: self-attention (m_data None) whose q, k and v are one product with AF2's three
    weights stacked [a, 3, h, c], read by the op in place (packed_dot_product_attention)."""

    def forward(q_data, m_data, mask, *biases):
        q_data, m_data = _transformed(input_transform, q_data, m_data)
        out_dtype = q_data.dtype
        q_data, m_data = numerics.cast_floats((q_data, m_data), compute)
        common = dict(
            scale=scale,
            implementation=implementation,
            compute_dtype="input",  # cast to `compute` above: the policy is decided once
            positions_first=positions_first,
        )
        if packed:
            stacked = jnp.stack([p["query_w"], p["key_w"], p["value_w"]], axis=1)
            qkv = _project(q_data, stacked)  # [..., b, q, 3, h, c]
            weighted_avg = attention.packed_dot_product_attention(
                qkv, biases or None, mask, **common
            )
            # The gate's product after the kernel's: XLA would merge it with q, k and v's (then
            # slice the kernel's operand out), and it would live through the kernel (4 slots
            # packed took up to 25% more peak memory: benchmark_results/module_passes).
            q_data, weighted_avg = jax.lax.optimization_barrier((q_data, weighted_avg))
        else:
            q = _project(q_data, p["query_w"])  # [..., b, q, h, c]
            k, v = _project(m_data, p["key_w"]), _project(m_data, p["value_w"])  # [.., k, h, c]
            weighted_avg = attention.dot_product_attention(
                q, k, v, biases or None, mask, shard_keys_over=keys_over, **common
            )  # [..., b, q, h, cv]
        return _gated_output(weighted_avg, q_data, p).astype(out_dtype)  # [..., b, q, o]

    return forward


def _transformed(transform, q_data, m_data):
    """(q_data, m_data) after input_transform; m_data None stands for q_data (self-attention:
    one slice per tile, transformed once)."""
    if transform is not None:
        q_data = transform(q_data)
        m_data = None if m_data is None else transform(m_data)
    return q_data, q_data if m_data is None else m_data


def _project(x, weights):
    """'...qa,ahc->...qhc' (or '...ka,ac->...kc' for GlobalAttention's single key/value head)."""
    return jnp.tensordot(x, weights, axes=1)


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
    # '...qhc,hco->...qo' as one matmul over the flattened (h, c), so XLA:CPU need not transpose
    # the activations to (c, h) order; unsharded, over the flattened rows too, so the weight
    # gradient has one contracting dimension (XLA:CPU's fast dot). With heads sharded over
    # devices, the sum over them is an all-reduce into the batch's sharding.
    *lead, h, c = weighted_avg.shape
    output_w = params["output_w"].reshape(h * c, -1)  # [h * cv, o]
    placed = sharding.out_sharding(weighted_avg, keep=weighted_avg.ndim - 2)
    if placed is None:
        out = weighted_avg.reshape(-1, h * c) @ output_w  # [rows, o]
    else:
        out = jnp.einsum(
            "...k,ko->...o", weighted_avg.reshape(*lead, h * c), output_w, out_sharding=placed
        )
    out = out.reshape(*lead, output_w.shape[-1])  # [..., b, q, o]
    return out + params["output_b"]


class GlobalAttention(_AttentionModule):
    """AlphaFold 2's global attention (Suppl. Alg. 19): one averaged query per head, shared key/value.

    Parameters: query_w [a, h, c], key_w [m, c], value_w [m, cv], gating_w [a, h, cv], gating_b
    [h, cv] (config.gating), output_w [h, cv, o], output_b [o].
    """

    def __call__(
        self,
        q_data,
        m_data,
        q_mask,
        *,
        subbatch_size: int | str | None = None,
        input_transform: Callable[[jax.Array], jax.Array] | None = None,
        positions_first: bool = False,
    ) -> jax.Array:
        """Global attention from the masked mean of q_data to m_data.

        Args:
          q_data: [..., b, q, a].
          m_data: [..., b, k, m] with k == q (the positions q_mask also masks as keys).
          q_mask: [..., b, q, 1] (or [..., b, q]), bool or float 0/1 as AF2 passes it.
          subbatch_size: inference subbatching over the leading batch axis, as for Attention.
          input_transform: applied to q_data and m_data inside each tile, as for Attention.
          positions_first: q_data [q, b, a], m_data [k, b, m] and q_mask [q, b, 1] (or [q, b])
            instead, and the output [q, b, o]: an MSA [s, r, c] attended along its columns as it
            lies. Nothing of width a, m or o is transposed then (only k and v, [k, b, c]), where
            transposing the MSA in and the update out would move it twice.

        Returns:
          [..., b, q, output_dim] in q_data's dtype ([q, b, output_dim] with positions_first).
        """
        placement = self._placement()
        pos = self._check_global(q_data, m_data, subbatch_size, positions_first, placement)
        batch = q_data.shape[:-3] + (q_data.shape[-2 if positions_first else -3],)
        (q_len, a), (k_len, m) = (
            (q_data.shape[pos], q_data.shape[-1]),
            (m_data.shape[pos], m_data.shape[-1]),
        )
        q_mask = inputs.global_mask(q_mask, batch, q_len, positions_first)
        h = self.config.num_head
        key_dim, value_dim = inputs.head_dims(self.config, a, m)
        params = _create_params(self, (a, h, key_dim), (m, key_dim), (m, value_dim), q_data.dtype)
        make_forward = functools.partial(
            _global_forward, input_transform, key_dim**-0.5, pos, self.output_dim, placement
        )
        # Per row: gate and gated average per query, k and v per key; in a training step also
        # the inputs, and the cotangents (memory.py).
        if positions_first:
            queries, keys = q_len, k_len
        else:
            queries, keys = math.prod(q_data.shape[1:-1]), math.prod(m_data.shape[1:-1])
        dims = dict(heads=h, queries=queries, keys=keys, key_dim=key_dim, value_dim=value_dim)
        row_bytes = memory.global_attention_row_bytes(output_dim=self.output_dim, **dims)
        tile_row_bytes = memory.global_attention_tile_row_bytes(
            q_channels=a, m_channels=m, output_dim=self.output_dim, **dims
        )
        args = [q_data, None if m_data is q_data else m_data, q_mask]
        return self._run(
            make_forward,
            params,
            q_data.dtype,
            args,
            subbatch_size,
            placement,
            axis=1 if positions_first else 0,
            # Over a ring, saved whole, its float32 temporaries doubled an H100 training peak.
            recompute=placement.keys is not None,
            row_bytes=row_bytes,
            tile_row_bytes=tile_row_bytes,
            row_queries=queries,
            row_logits=None,
        )

    def _check_global(self, q_data, m_data, subbatch_size, positions_first, placement) -> int:
        """Validates the call; returns the positions' axis (-3 with positions_first, else -2)."""
        inputs.check_data(q_data, m_data)
        inputs.check_subbatch_size(subbatch_size)
        checks.check_bool("positions_first", positions_first)
        if placement.keys is not None and placement.ring == 1:  # the ring splits the heads
            mesh, axes = _ring_axes(placement.keys)
            devices = math.prod(mesh.shape[a] for a in axes)
            if self.config.num_head % devices:
                raise ValueError(
                    f"global_config.shard_columns_over={placement.keys!r} splits GlobalAttention's "
                    f"heads (its queries) over {devices} devices, but num_head is "
                    f"{self.config.num_head}: give a multiple of {devices}, or call it inside a "
                    "shard_map over the axis (each device on its own positions)"
                )
        if positions_first and (q_data.ndim != 3 or m_data.ndim != 3):
            raise ValueError(
                f"positions_first takes q_data [q, b, a] and m_data [k, b, m], got shapes "
                f"{tuple(q_data.shape)} and {tuple(m_data.shape)}"
            )
        pos = -3 if positions_first else -2  # the positions' axis; the batch's is the other one
        if m_data.shape[pos] != q_data.shape[pos]:
            raise ValueError(
                f"m_data has {m_data.shape[pos]} positions but q_data has {q_data.shape[pos]}; "
                "global attention masks keys with q_mask, so they must be equal"
            )
        return pos


def _ring_axes(keys_over):
    """(mesh, axes) that GlobalAttention's positions are split over (shard_columns_over)."""
    return sharding.mesh_axes(keys_over, "global_config.shard_columns_over", manual=True)


def _global_forward(
    input_transform, scale, pos, output_dim, placement, implementation, compute, p
):  # fmt: skip
    """GlobalAttention's forward over one tile (positions along `pos`), p closed over. Positions
    split over placement.keys: inside a shard_map over them (ring > 1) the masked mean's sums are
    summed over the devices, each attending its copy of the queries to all keys by the op's ring;
    outside one, the op's ring splits the keys and the queries (the heads) itself."""
    positions_first = pos == -3
    axes = () if placement.keys is None else _ring_axes(placement.keys)[1]
    over = (lambda x: jax.lax.psum(x, axes)) if placement.ring > 1 else (lambda x: x)

    def forward(q_data, m_data, q_mask):
        q_data, m_data = _transformed(input_transform, q_data, m_data)
        out_dtype = q_data.dtype
        q_data, m_data = numerics.cast_floats((q_data, m_data), compute)
        q = _project(_masked_mean(q_data, q_mask, pos, over), p["query_w"])  # [..., b, h, c]
        k, v = _project(m_data, p["key_w"]), _project(m_data, p["value_w"])  # positions, c
        mask = q_mask.astype(bool)
        if positions_first:  # [k, b, c] -> [b, k, c]: the narrow projections, not the data
            k, v, mask = (jnp.swapaxes(x, -3, -2) for x in (k, v, mask))
        key_mask = jnp.swapaxes(mask, -1, -2)[..., None, :, :]  # [..., b, 1, 1, k]
        # The h heads attend as h query positions of one head (the shared key/value head).
        avg = attention.dot_product_attention(
            q[..., None, :],
            k[..., None, :],
            v[..., None, :],
            None,
            key_mask,
            scale=scale,
            implementation=implementation,
            compute_dtype="input",  # cast to `compute` above: the policy is decided once
            shard_keys_over=placement.keys,
        )  # [..., b, h, 1, cv]
        avg = sharding.without_axes(avg, axes)  # outside a shard_map the ring split the heads
        avg = jnp.swapaxes(avg, -3, -2)  # [..., b, 1, h, cv]
        if positions_first:
            avg = jnp.swapaxes(avg, -4, -3)  # [1, b, h, cv]
        out = _gated_output(avg, q_data, p)  # [..., b, q|1, o] ([q|1, b, o])
        out = jnp.broadcast_to(out, (*q_data.shape[:-1], output_dim))
        return out.astype(out_dtype)

    return forward


def _masked_mean(q_data, q_mask, axis=-2, over=lambda x: x):
    """AF2's mean of q_data [..., b, q, a] over the positions (`axis`) q_mask [..., b, q, 1]
    weights (eps 1e-10); masked positions are zeroed first, so whatever they hold does not reach
    the mean. over: the sum over the devices the positions are split over, if they are."""
    weights = q_mask.astype(q_data.dtype)
    kept = jnp.where(q_mask.astype(bool), q_data, jnp.zeros((), q_data.dtype))
    total = over(jnp.sum(weights, axis=axis)) + 1e-10
    return over(jnp.sum(weights * kept, axis=axis)) / total  # [..., b, a]
