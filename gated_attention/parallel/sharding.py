"""Many devices: shardings read at trace time, per-shard execution, and parameter specs.

JAX's explicit sharding mode (mesh axes of type Explicit, `jax.make_mesh`'s default; arrays placed with
`jax.device_put(x, P(...))` under `jax.set_mesh(mesh)`, or with a NamedSharding) puts every array's
sharding in its type, so the library can see it while tracing and keep the work where the data is:

* `dot_product_attention` runs its implementation under `jax.shard_map` over the mesh axes that
  shard the query's batch, head and query-position dimensions (`shard_attention`). Each device
  attends for its own rows, heads and queries; attention needs no communication along those. What
  attention cannot split is gathered first: keys and values sharded along key positions or
  channels, and any dimension of a bias or mask shared by the batch (size 1 there).
* `mapping.subbatch` (the row tiles of the op and of the modules, AlphaFold 2's subbatch_size)
  loops over each device's own rows when the batch axis is sharded (`batch_shards`): it views the
  batch as [shards, rows per device], which keeps the batch's sharding on the first dimension, and
  loops over the second. A loop over the sharded axis itself would be an error (explicit axes) or
  gather the whole batch onto every device. (A shard_map over the batch axes alone would not do:
  in jax 0.10 its boundary replicates the other axes, so head-sharded parameters were gathered.)
* `head_parallel_specs` gives PartitionSpecs that shard AlphaFold 2's attention parameters by
  head, for tensor parallelism; the modules then ask for the output projection's sum over heads
  (`out_sharding`), which XLA makes one all-reduce.

Under mesh axes of type Auto, shardings are not visible while tracing, and nothing here applies:
XLA's partitioner then sees the row loops over a sharded batch and all-gathers it, so that every
device computes every row. Use Explicit axes (the default of `jax.make_mesh`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

Axes = tuple[str, ...]  # the mesh axes that shard one array dimension (empty: not sharded)


def explicit_axes(x: Any) -> tuple[Any, tuple[Axes, ...]]:
    """The explicit sharding of x at trace time: (mesh, mesh axes per dimension).

    Works on arrays and tracers. Axes that are not of type Explicit are left out (Auto axes are
    invisible at trace time; Manual ones are already split by an enclosing shard_map).

    Returns:
      (mesh, axes): mesh is the array's (abstract) mesh, or None when no dimension is sharded
      over an explicit axis; axes has one tuple of axis names per dimension of x.
    """
    ndim = len(x.shape)
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not mesh.axis_names:
        return None, ((),) * ndim
    explicit = {
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if kind == AxisType.Explicit
    }
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    axes = tuple(tuple(a for a in _entry_axes(entry) if a in explicit) for entry in spec)
    return (mesh if any(axes) else None), axes


def typed_sharded(*arrays: Any) -> bool:
    """Whether any of the arrays (None skipped, a list or tuple looked into) has a type naming
    mesh axes (explicit, or manual inside a shard_map): Pallas refs of such arrays take no
    integer index."""
    for x in arrays:
        if isinstance(x, (list, tuple)):
            if typed_sharded(*x):
                return True
        elif x is not None:
            spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", ())
            if any(entry is not None for entry in spec):
                return True
    return False


def _entry_axes(entry: Any) -> Axes:
    if entry is None or entry is P.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def spec(axes: Sequence[Axes]) -> P:
    """Axes per dimension -> PartitionSpec, without trailing Nones (P(None, 'x') == its spec)."""
    entries = [None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in axes]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _mesh_and_axes(arrays: Sequence[Any]) -> tuple[Any, set[str]]:
    """The mesh of the first explicitly sharded array (None if none is) and all its explicit
    axes: every one becomes manual, those no input uses too (the inputs are replicated along
    them), so that the body sees no explicit axis (a kernel's scratch would be typed unsharded
    beside values typed explicit: Pallas's interpreter refuses that)."""
    for x in arrays:
        if x is not None:
            mesh, _ = explicit_axes(x)
            if mesh is not None:
                kinds = zip(mesh.axis_names, mesh.axis_types, strict=True)
                return mesh, {name for name, kind in kinds if kind == AxisType.Explicit}
    return None, set()


def conform(x: Any, mesh: Any, wanted: Sequence[Axes]) -> Any:
    """x resharded to `wanted` (mesh axes per dimension) unless it is sharded so already: a
    shard_map takes its inputs only as its in_specs say. This is where a key sharded along S is
    gathered, or a shared bias replicated."""
    if explicit_axes(x)[1] == tuple(wanted):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, spec(wanted)))


def without_axes(x: Any, names: Axes) -> Any:
    """x resharded so that no dimension is split over the explicit mesh axes `names` (gathered
    along them); as it is when it has no explicit sharding."""
    mesh, axes = explicit_axes(x)
    if mesh is None:
        return x
    return conform(x, mesh, [tuple(a for a in dim if a not in names) for dim in axes])


def batch_shards(batched: Sequence[Any], axis: int) -> int:
    """Over how many devices the batch axis of these arrays is split (explicit mesh axes; 1 if
    none): the first array whose `axis` is sharded decides."""
    for x in batched:
        mesh, axes = explicit_axes(x)
        batch_axes = axes[axis % len(x.shape)]
        if batch_axes:
            return math.prod(mesh.shape[a] for a in batch_axes)
    return 1


def per_device_rows(
    loop: Callable[..., Any], fn, args, where: dict[int, int], axis: int, shards: int
):
    """A row loop over each device's own rows of a batch split over `shards` devices.

    loop(fn, args, where, out_axis) is mapping.subbatch's loop (where[i]: the batch axis of cut
    arg i; out_axis(ndim): the batch axis of an output leaf). Here it runs on the args viewed
    as [..., shards, batch // shards, ...], along the second: the first keeps the batch's
    sharding, so no row crosses devices and no loop slices a sharded dimension (refused under
    explicit axes, or a gather of the whole batch onto every device)."""

    def per_shard(*split_args):
        full = [_merge(x, where[i]) if i in where else x for i, x in enumerate(split_args)]
        return jax.tree.map(lambda x: _split(x, axis % x.ndim, shards), fn(*full))

    split = [_split(x, where[i], shards) if i in where else x for i, x in enumerate(args)]
    inner = {i: w + 1 for i, w in where.items()}
    out = loop(per_shard, split, inner, lambda ndim: axis % (ndim - 1) + 1)
    return jax.tree.map(lambda x: _merge(x, axis % (x.ndim - 1)), out)


def _split(x, axis: int, shards: int):
    """[..., batch, ...] -> [..., shards, batch // shards, ...] (axis: the batch's index)."""
    shape = x.shape
    return x.reshape(shape[:axis] + (shards, shape[axis] // shards) + shape[axis + 1 :])


def _merge(x, axis: int):
    """[..., shards, rows, ...] (shards at `axis`) -> [..., shards * rows, ...], inverting _split."""
    shape = x.shape
    return x.reshape(shape[:axis] + (shape[axis] * shape[axis + 1],) + shape[axis + 2 :])


def shard_attention(
    attend: Callable[..., Any],
    query: Any,
    key: Any,
    value: Any,
    biases: Sequence[Any],
    mask: Any,
    structure: Any = None,
    *,
    residual: bool = False,
) -> Any:
    """Runs attend(query, key, value, biases, mask, structure) on each device's own rows, heads
    and queries.

    The arrays are dot_product_attention's validated inputs: query [*batch, T, N, H], key/value
    [*batch, S, K, H]; each bias and the mask [*batch|1, N|1, T|1, S|1]; structure a
    masking.StructuredMask with lengths [*batch] (or None). The mesh axes sharding query's batch, head
    and position dimensions become manual: every input is brought to query's layout over them
    (keys and values replicated along S and the channels, and along heads when K == 1; biases and
    mask along their size-1 and S dimensions; lengths along the batch) and the output comes back
    with query's sharding. With queries split along T, each device's structure carries the
    position of its first query (q_offset). Every other explicit axis of the mesh is made manual
    too, with every input replicated along it, so that no contraction inside runs over a sharded
    dimension.

    Args:
      residual: attend returns (output, residual [*batch, T, N]) rather than the output.

    Returns:
      attend's output [*batch, T, N, Hv] (and residual), or None when no input is sharded over an
      explicit mesh axis (the caller then calls attend itself).

    Raises:
      NotImplementedError: query heads split over more devices than the K > 1 key/value heads
        can follow.
    """
    lengths = [] if structure is None else [structure.q_lengths, structure.kv_lengths]
    mesh, manual = _mesh_and_axes([query, key, value, *biases, mask, *lengths])
    if mesh is None:
        return None
    axes = _QueryAxes.of(query, key, mesh)
    present = [x for x in (mask, *lengths) if x is not None]
    wanted = [axes.qkv(query, True), axes.qkv(key, False), axes.qkv(value, False)]
    wanted += [axes.pair(b) for b in biases]
    wanted += [axes.pair(mask)] if mask is not None else []
    wanted += [axes.lengths(x) for x in lengths if x is not None]
    inputs = [
        conform(x, mesh, w)
        for x, w in zip([query, key, value, *biases, *present], wanted, strict=True)
    ]
    num_biases = len(biases)
    local_q_len = query.shape[-3] // math.prod(mesh.shape[a] for a in axes.t)

    def attend_local(query, key, value, *rest):
        biases, rest = rest[:num_biases], list(rest[num_biases:])
        local_mask = rest.pop(0) if mask is not None else None
        local = structure
        if structure is not None:
            q_len, kv_len = (rest.pop(0) if x is not None else None for x in lengths)
            local = _local_structure(structure, q_len, kv_len, axes.t, local_q_len)
        return attend(query, key, value, tuple(biases), local_mask, local)

    out_specs = spec([*axes.batch, axes.t, axes.n, ()])
    if residual:
        out_specs = (out_specs, spec([*axes.batch, axes.t, axes.n]))
    return jax.shard_map(
        attend_local,
        mesh=mesh,
        in_specs=tuple(spec(w) for w in wanted),
        out_specs=out_specs,
        axis_names=manual,
        check_vma=False,  # the implementations (loops, custom_vjp) are not typed for varying axes
    )(*inputs)


@dataclasses.dataclass(frozen=True)
class _QueryAxes:
    """The mesh axes sharding query's batch dimensions, positions (T) and heads (N): those
    shard_attention makes manual, and each input's layout over them (mesh axes per dimension,
    none along a dimension of size 1)."""

    batch: tuple[Axes, ...]
    t: Axes
    n: Axes

    @classmethod
    def of(cls, query: Any, key: Any, mesh: Any) -> _QueryAxes:
        """query's axes; raises NotImplementedError when the key/value heads cannot follow the
        query heads' split."""
        rank = len(query.shape)
        _, q_axes = explicit_axes(query)
        n_axes = q_axes[rank - 2]
        kv_heads = key.shape[rank - 2]
        head_shards = math.prod(mesh.shape[a] for a in n_axes)
        if kv_heads > 1 and kv_heads % head_shards:
            raise NotImplementedError(
                f"query heads split over {head_shards} devices ({n_axes}) need a number of "
                f"key/value heads they divide, got K={kv_heads}"
            )
        return cls(batch=q_axes[: rank - 3], t=q_axes[rank - 3], n=n_axes)

    def qkv(self, x: Any, is_query: bool) -> list[Axes]:  # [*batch, T|S, N|K, H]
        return _skip_size_one(x, [*self.batch, self.t if is_query else (), self.n, ()])

    def pair(self, x: Any) -> list[Axes]:  # [*batch|1, N|1, T|1, S|1]
        return _skip_size_one(x, [*self.batch, self.n, self.t, ()])

    def lengths(self, x: Any) -> list[Axes]:  # [*batch] (or [1] for unbatched inputs)
        return _skip_size_one(x, self.batch[: len(x.shape)])


def _skip_size_one(x: Any, axes: Sequence[Axes]) -> list[Axes]:
    """axes per dimension of x, none along a dimension of size 1 (shared: replicated)."""
    return [a if x.shape[d] != 1 else () for d, a in enumerate(axes)]


def _local_structure(structure: Any, q_len, kv_len, t_axes: Axes, local_q_len: int) -> Any:
    """A device's structure: its lengths and, with queries split along T and a mask that reads
    positions, the position of its first query (q_offset)."""
    offset = None
    if t_axes and (structure.is_causal or structure.window or q_len is not None):
        offset = jax.lax.axis_index(tuple(t_axes)) * local_q_len
    return dataclasses.replace(structure, q_lengths=q_len, kv_lengths=kv_len, q_offset=offset)


def map_rows(
    fn: Callable[..., Any], args: Sequence[Any], *, rows: Sequence[bool], sums: Sequence[bool]
) -> Any:
    """fn(*args) with each device computing its own rows, or None when no row arg is sharded
    along its first dimension over an explicit mesh axis (the caller then calls fn itself).

    The args flagged in `rows` are split along their first dimension as the first of them is (the
    others brought to that), every other arg replicated; fn returns a tuple whose entries are
    rows, sharded so, or (`sums`) sums over rows, added up over the devices (one all-reduce each).
    For a loop of its own over rows (a custom backward): under explicit axes a dynamic slice of a
    sharded dimension is refused, and a loop over it would gather the rows onto every device."""
    flagged = [x for x, r in zip(args, rows, strict=True) if r and x is not None]
    mesh, axes = next(
        ((m, a[0]) for m, a in map(explicit_axes, flagged) if m is not None and a[0]), (None, ())
    )
    if mesh is None:
        return None
    _, manual = _mesh_and_axes(flagged)
    wanted = [[axes if (r and d == 0) else () for d in range(len(x.shape))] for x, r in
              zip(args, rows, strict=True)]  # fmt: skip
    inputs = [conform(x, mesh, w) for x, w in zip(args, wanted, strict=True)]

    def local(*args):
        out = fn(*args)
        return tuple(
            jax.lax.psum(o, tuple(axes)) if s else o for o, s in zip(out, sums, strict=True)
        )

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=tuple(spec(w) for w in wanted),
        out_specs=tuple(P() if s else P(axes if len(axes) > 1 else axes[0]) for s in sums),
        axis_names=manual,
        check_vma=False,  # the implementations (loops, custom_vjp) are not typed for varying axes
    )(*inputs)


def mesh_axes(
    names: str | Sequence[str] | None,
    what: str = "global_config.shard_rows_over",
    *,
    manual: bool = False,
) -> tuple[Any, Axes] | None:
    """(the context mesh, the axes) for global_config.shard_rows_over, or None when it names none
    or (unless manual) when every named axis is already manual (inside a shard_map over them: a
    family module's, around the attention it calls).

    Raises:
      ValueError: axes named but no mesh set (jax.set_mesh), or an axis the mesh lacks.
    """
    if names is None:
        return None
    axes = (names,) if isinstance(names, str) else tuple(names)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        raise ValueError(
            f"{what}={names!r} names mesh axes, but no mesh is set: call it under "
            "`with jax.set_mesh(mesh):`"
        )
    unknown = [a for a in axes if a not in mesh.axis_names]
    if unknown:
        raise ValueError(f"{what} names {unknown}, which the mesh {mesh.axis_names} lacks")
    if not manual and manual_axes(mesh, axes):
        return None
    return mesh, axes


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a module's attention runs over the context mesh: resolved once, by the outermost
    module, and passed down (an inner module never re-derives it).

    Attributes:
      rows: (mesh, axes) the module's rows are split over, each device on its own (a shard_map),
        or None (not split, or split already by the module around it).
      keys: the mesh axes the attended positions are split over (the op's shard_keys_over: a
        ring of key blocks), or None.
      ring: the ring's device count when the arrays are already its blocks (inside a shard_map
        over `keys`), else 1.
    """

    rows: tuple[Any, Axes] | None = None
    keys: str | tuple[str, ...] | None = None
    ring: int = 1

    @classmethod
    def resolve(cls, rows_over, keys_over=None, *, initializing: bool = False) -> Placement:
        """From global_config's shard_rows_over and shard_columns_over (as the op's
        shard_keys_over). Nothing while Haiku initializes: parameters are created outside any
        shard_map."""
        if initializing:
            return cls()
        rows = mesh_axes(rows_over)
        if keys_over is None:
            return cls(rows)
        keys = mesh_axes(keys_over, "global_config.shard_columns_over", manual=True)
        return cls(rows, keys_over, ring_blocks(keys))


def ring_blocks(keys: tuple[Any, Axes] | None) -> int:
    """Inside a shard_map over the ring's axes ((mesh, axes), mesh_axes'): its device count, each
    array a device's block; else 1."""
    if keys is None or not manual_axes(*keys):
        return 1
    return math.prod(keys[0].shape[a] for a in keys[1])


def manual_axes(mesh: Any, axes: Axes) -> bool:
    """Whether every one of axes is manual (inside a shard_map over them)."""
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return all(kinds[a] == AxisType.Manual for a in axes)


def on_rows(
    fn: Callable[..., Any],
    args: Sequence[Any],
    placement: tuple[Any, Axes],
    *,
    row_dims: Sequence[int | None],
    out_dims: Any,
    what: str = "global_config.shard_rows_over",
) -> Any:
    """fn(*args) with each device computing its own rows: a shard_map over placement's axes,
    arg i split along its dimension row_dims[i] (None: replicated, e.g. a bias shared by the
    rows), each output leaf along out_dims (its own pytree of dimensions), every other mesh axis
    replicated. Args arrive where they are: split so already, no communication; else XLA moves
    them there. What fn closes over (Haiku parameters) is replicated."""
    mesh, axes = placement
    entry = axes[0] if len(axes) == 1 else tuple(axes)

    def spec(x, dim):
        if x is None or dim is None:
            return P()
        dim %= len(x.shape)
        shards = math.prod(mesh.shape[a] for a in axes)
        if x.shape[dim] % shards:
            raise ValueError(
                f"{what}={axes}: dimension {dim} of an input of shape "
                f"{tuple(x.shape)} does not split over its {shards} devices"
            )
        return P(*([None] * dim), entry)

    in_specs = tuple(spec(x, d) for x, d in zip(args, row_dims, strict=True))
    out_specs = jax.tree.map(lambda d: P(*([None] * d), entry), out_dims)
    return jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes),
        check_vma=False,  # the implementations (loops, custom_vjp) are not typed for varying axes
    )(*args)  # fmt: skip


def on_tiles(
    fn: Callable[..., Any],
    args: Sequence[Any],
    mesh: Any,
    axes: Sequence[Axes],
    *,
    dims: Sequence[int | None],
    out_dim: int,
) -> Any:
    """fn(*args) with each device on its own tile: arg i's dimensions dims[i] and dims[i] + 1
    split over axes[0] and axes[1] (None: replicated), the output's out_dim and out_dim + 1
    likewise; a shard_map over all of axes, so fn sees every split axis as manual."""
    entry = lambda a: a[0] if len(a) == 1 else tuple(a)

    def spec(x, dim):
        if x is None or dim is None:
            return P()
        dim %= len(x.shape)
        for a, size in zip(axes, (x.shape[dim], x.shape[dim + 1]), strict=True):
            shards = math.prod(mesh.shape[n] for n in a)
            if size % shards:
                raise ValueError(
                    f"an input of shape {tuple(x.shape)} does not split into tiles over the mesh "
                    f"axes {tuple(axes)}: {size} over {shards} devices"
                )
        return P(*([None] * dim), *(entry(a) for a in axes))

    in_specs = tuple(spec(x, d) for x, d in zip(args, dims, strict=True))
    out_specs = P(*([None] * out_dim), *(entry(a) for a in axes))
    names = {n for a in axes for n in a}
    return jax.shard_map(  # check_vma off: the implementations' loops and custom_vjps are untyped
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=names, check_vma=False
    )(*args)


def split_along(x: Any, placement: tuple[Any, Axes], dim: int) -> Any:
    """x constrained to be split along `dim` over placement's axes (a layout for XLA's partitioner
    under Auto axes, a reshard under Explicit ones); the context mesh (jax.set_mesh) is used."""
    mesh, axes = placement
    entry = axes[0] if len(axes) == 1 else tuple(axes)
    spec = P(*([None] * (dim % len(x.shape))), entry)
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if any(kinds[a] == AxisType.Explicit for a in axes):
        return jax.sharding.reshard(x, spec)
    return jax.lax.with_sharding_constraint(x, spec)


def rows_to_columns(x: Any, axes: Axes, *, rows: int, columns: int) -> Any:
    """Inside on_rows: x split along `rows` -> split along `columns` instead, one all-to-all."""
    return jax.lax.all_to_all(x, tuple(axes), columns, rows, tiled=True)


def out_sharding(x: Any, keep: int) -> NamedSharding | None:
    """The sharding for a contraction's output that keeps x's first `keep` dimensions as they are
    sharded and leaves the new last dimension replicated, or None when x has no explicit sharding.

    For einsums that sum over a dimension that may be sharded (the output projection over heads):
    explicit mode asks for the output's sharding there, and XLA then adds the all-reduce.
    """
    mesh, axes = explicit_axes(x)
    if mesh is None:
        return None
    return NamedSharding(mesh, spec([*axes[:keep], ()]))


# AlphaFold 2's attention parameters sharded by head: name -> (rank, index of the head dimension).
_HEAD_DIMS = {
    "query_w": (3, 1),  # [a, h, c]
    "key_w": (3, 1),  # [m, h, c] (GlobalAttention's [m, c] has no head dimension)
    "value_w": (3, 1),  # [m, h, cv]
    "gating_w": (3, 1),  # [a, h, cv]
    "gating_b": (2, 0),  # [h, cv]
    "output_w": (3, 0),  # [h, cv, o]
    "feat_2d_weights": (2, 1),  # [c_z, h]: the pair bias's projection
}


def head_parallel_specs(params: Any, head_axis: str | Sequence[str], mesh: Any = None) -> Any:
    """PartitionSpecs that shard AlphaFold 2 attention parameters by head over `head_axis`.

    The parameters of AF2's attention modules with a head dimension (query_w, key_w, value_w,
    gating_w, gating_b, output_w, and feat_2d_weights of the pair bias) are sharded along it;
    everything else (output_b, LayerNorm scales and offsets, GlobalAttention's single key/value
    head, parameters of other modules) is replicated. A leading stacked-layer axis (AF2
    checkpoints stack 48 Evoformer blocks) is read off query_w's rank in the same scope or the
    scope below it, and left unsharded.

    Args:
      params: Haiku params {module: {name: array}} (arrays or ShapeDtypeStructs).
      head_axis: the mesh axis name (or names) to shard heads over.
      mesh: optional Mesh; when given, every head count must be divisible by the axis size.

    Returns:
      {module: {name: PartitionSpec}}, for jax.device_put or jit shardings.

    Raises:
      TypeError: params is not a {module: {name: array}} mapping.
      ValueError: a head_axis that is not an axis of mesh, or a head count the axis size does not
        divide.
    """
    axes = (head_axis,) if isinstance(head_axis, str) else tuple(head_axis)
    size = None
    if mesh is not None:
        unknown = [a for a in axes if a not in mesh.axis_names]
        if unknown:
            raise ValueError(f"head_axis {unknown} is not an axis of the mesh {mesh.axis_names}")
        size = math.prod(mesh.shape[a] for a in axes)
    if not isinstance(params, Mapping) or not all(isinstance(v, Mapping) for v in params.values()):
        raise TypeError(
            f"params must be Haiku params {{module: {{name: array}}}}, got {type(params).__name__}"
        )

    def stacked(module: str) -> int | None:  # leading stacked-layer axes of module's parameters
        for scope in (module, *sorted(m for m in params if m.startswith(module + "/"))):
            query_w = params[scope].get("query_w")
            if query_w is not None:
                return len(query_w.shape) - 3
        return None

    specs = {}
    for module, leaves in params.items():
        lead = stacked(module)
        specs[module] = {}
        for name, leaf in leaves.items():
            shape = tuple(leaf.shape)
            rank, head_dim = _HEAD_DIMS.get(name, (None, None))
            if rank is not None and lead is None and len(shape) in (rank, rank + 1):
                lead_here = len(shape) - rank  # no query_w to tell: read it off this rank
            else:
                lead_here = lead
            if rank is None or len(shape) != rank + (lead_here or 0):
                specs[module][name] = P()  # no head dimension (e.g. GlobalAttention's key_w)
                continue
            head_dim += lead_here or 0
            if size is not None and shape[head_dim] % size:
                raise ValueError(
                    f"params[{module!r}][{name!r}] of shape {shape} has {shape[head_dim]} "
                    f"heads, which the {size} devices of mesh axes {axes} cannot share evenly"
                )
            specs[module][name] = spec([axes if d == head_dim else () for d in range(len(shape))])
    return specs
