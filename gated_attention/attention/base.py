"""What an attention implementation is: a frozen dataclass that carries its own tuning.

An implementation takes dot_product_attention's validated inputs in the public layout, with the
batch dimensions flattened to one:

  query [B, T, N, H], key [B, S, K, H], value [B, S, K, Hv]   (the caller's dtype)
  biases: a tuple of float arrays [B|1, N|1, T|1, S|1]          (added; possibly empty)
  mask: None or bool [B|1, N|1, T|1, S|1]                       (True = attend)
  options: `Options`, what jax.nn's and tokamax's further arguments ask: the causal, window and
    length masks as a masking.StructuredMask (never an array of mask), the logits' soft cap, the
    dots' precision, and whether to return the residual

and returns [B, T, N, Hv] in query's dtype, or with options.return_residual the pair (that, the
logsumexp of each query's logits [B, N, T] in the accumulation dtype). K divides N: query head n
uses key/value head n // (N // K) (grouped-query attention, as jax.nn), which `Groups` lays out
without ever repeating a key or value. It computes in `compute_dtype` (numerics.py's policy,
resolved by the op), casting inside its own tiles, and makes any layout change there too, so no
whole-array copy of query, key or value is made. Masks follow numerics.py: masked positions never
leak, a row with no key to attend to is the uniform average of the values. `plan` returns the
call's plan (its static facts: tiles, grid, scratch; None where nothing is planned) or raises
NotImplementedError saying why the implementation cannot take the inputs here; the op asks it once
per call and passes the plan to __call__, so what refuses and what runs are one plan. The default
`plan` asks `check`, which refuses every option not named in `TAKES`. Inputs reach an
implementation already validated: it asserts, it does not re-check.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import jax

from gated_attention.core import masking, platforms
from gated_attention.parallel import row_loop as mapping


@dataclasses.dataclass(frozen=True)
class Options:
    """dot_product_attention's arguments beyond the arrays, for the implementations (a pytree).

    Attributes:
      structure: the causal, window and sequence-length masks (masking.py).
      logits_soft_cap: None or a float > 0: logits -> cap * tanh(logits / cap), applied to the
        scaled logits plus the biases, before any mask (tokamax's definition).
      precision: None or a jax.lax.Precision for the dots.
      return_residual: also return the logsumexp of the logits, [B, N, T].
      residual_gradient: the logsumexp carries its gradient (merging attention over key shards,
        ring.py, differentiates through it); else it is a constant.
      positions_first: query [T, B, N, H], key and value [S, B, K, H], out [T, B, N, Hv]: an
        implementation with "positions_first" in TAKES reads and writes them as they lie (the
        op hands the others the batch-first transposes); biases and mask stay batch-first.
      packed: query, key and value are one array [B, T, P, N, H] ([T, B, P, N, H] positions
        first), slots 0, 1, 2 (packed_dot_product_attention; slots 3.. the caller's, their
        gradient zero): an implementation with "packed" in TAKES reads each slot in place and
        returns the gradient as one array of that shape; the op hands the others the three
        slices (`run`).
    """

    structure: masking.StructuredMask = masking.NONE
    logits_soft_cap: float | None = None
    precision: Any = None
    return_residual: bool = False
    residual_gradient: bool = False
    positions_first: bool = False
    packed: bool = False

    def asked(self, query, key) -> dict[str, str]:
        """What these options and shapes ask beyond plain attention: capability -> description."""
        asked = {}
        if key.shape[2] != query.shape[2]:
            asked["grouped"] = (
                f"grouped-query attention ({query.shape[2]} over {key.shape[2]} heads)"
            )
        s = self.structure
        for name, wanted in (
            ("is_causal", s.is_causal),
            ("local_window_size", s.window is not None),
            ("query_seq_lengths", s.q_lengths is not None),
            ("key_value_seq_lengths", s.kv_lengths is not None),
            ("logits_soft_cap", self.logits_soft_cap is not None),
            ("precision", self.precision is not None),
            ("return_residual", self.return_residual),
            ("residual_gradient", self.residual_gradient),
        ):
            if wanted:
                asked[name] = name
        return asked


jax.tree_util.register_dataclass(
    Options,
    data_fields=["structure"],
    meta_fields=[
        "logits_soft_cap",
        "precision",
        "return_residual",
        "residual_gradient",
        "positions_first",
        "packed",
    ],  # fmt: skip
)

PLAIN = Options()

ALL_OPTIONS = frozenset(
    (
        "grouped",
        "is_causal",
        "local_window_size",
        "query_seq_lengths",
        "key_value_seq_lengths",
        "logits_soft_cap",
        "precision",
        "return_residual",
        "residual_gradient",
    )
)


@dataclasses.dataclass(frozen=True)
class Implementation(abc.ABC):
    """Base of the attention implementations (xla.XlaAttention, chunked.ChunkedAttention, ...).

    Attributes:
      TAKES: the options of `Options.asked` it implements (the default `check` refuses others).
    """

    name: ClassVar[str]
    TAKES: ClassVar[frozenset[str]] = frozenset()
    # The dataclass fields a tuning candidate sets (candidates()), in its name's order, each with
    # the short label its name spells it with (attention/candidates.py: 'pallas:bq64,bk64,...').
    CANDIDATE_FIELDS: ClassVar[dict[str, str]] = {}
    # Those of them that change only the backward: a candidate that sets one differs from its
    # forward twin in a training step alone (the sweep times it there only).
    BACKWARD_FIELDS: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def candidates(
        cls, capability, dtype, head_dim: int, *, bias: str = "shared", mask: str = "key"
    ) -> list[dict[str, Any]]:
        """The tunings a sweep times for this implementation on a GPU of compute `capability`
        ((major, minor)) at inputs of `dtype`, `head_dim` and the kernel form (bias 'shared' |
        'per_row' | 'both' | 'none', mask 'key' | 'full' | 'none'): each a {field: value} of
        CANDIDATE_FIELDS that the implementation's constructor takes, the target's facts applied
        (what cannot run there is left out); [] where none runs. Default: the instance as it is."""
        del capability, dtype, head_dim, bias, mask
        return [{}]

    def check(
        self, query, key, value, biases, mask, *, compute_dtype, options=PLAIN, platform=None
    ) -> None:
        """Raises NotImplementedError (with the reason) if these inputs cannot run here.

        Arguments as for __call__ (arrays or jax.ShapeDtypeStructs), and `platform`: the kind of
        platform the program is compiled for ('cpu', 'gpu', 'tpu'; None: the host's,
        platforms.host()), which is not always the host's (platforms.py). The default: where
        `plan` is overridden, it asks the plan (one place decides); else it takes any arrays on
        any platform and the options in TAKES.
        """
        if type(self).plan is not Implementation.plan:
            self.plan(
                query, key, value, biases, mask, scale=1.0, compute_dtype=compute_dtype,
                options=options, platform=platform,
            )  # fmt: skip
        else:
            self.refuse_options(query, key, options)

    def refuse_options(self, query, key, options) -> None:
        """NotImplementedError naming the options of `Options.asked` not in TAKES."""
        refused = [
            what for name, what in options.asked(query, key).items() if name not in self.TAKES
        ]
        if refused:
            raise NotImplementedError(f"{self.name} does not implement " + ", ".join(refused))

    def plan(
        self,
        query,
        key,
        value,
        biases,
        mask,
        *,
        scale,
        compute_dtype,
        options=PLAIN,
        platform=None,
    ) -> Any:
        """The plan __call__ runs for these inputs (None: nothing planned), or NotImplementedError
        with the reason they cannot run here (arguments as for check and __call__). The default
        asks `check` and plans nothing; a kernel overrides this (and `check` then asks it)."""
        del scale
        self.check(
            query, key, value, biases, mask, compute_dtype=compute_dtype, options=options,
            platform=platform,
        )  # fmt: skip
        return None

    @abc.abstractmethod
    def __call__(
        self,
        query,
        key,
        value,
        biases: tuple,
        mask,
        *,
        scale: float,
        compute_dtype,
        options=PLAIN,
        plan=None,
    ) -> jax.Array | tuple[jax.Array, jax.Array]:
        """Attention over validated inputs (module docstring): [B, T, N, Hv] in query's dtype,
        and with options.return_residual the logsumexp [B, N, T]. `plan`: what `plan` returned
        for these inputs (None: made here, unchecked)."""


def run(impl: Implementation, query, key, value, biases, mask, *, options, **kwargs):
    """impl(query, key, value, biases, mask, options=options, **kwargs) in the options' layout:
    a packed array (Options.packed, given as query, key and value alike) goes whole to an
    implementation with "packed" in TAKES, any other gets its three slots; positions-first
    arrays (Options.positions_first) go as they lie to an implementation with "positions_first"
    in TAKES; any other gets their batch-first transposes, its output turned back. The one place
    that decides it (the op's branches, PerMode's two members)."""
    if options.packed and "packed" not in impl.TAKES:
        query, key, value = unpacked(query)
        options = dataclasses.replace(options, packed=False)
    if not options.positions_first or "positions_first" in impl.TAKES:
        return impl(query, key, value, biases, mask, options=options, **kwargs)
    swap = lambda x: jax.numpy.swapaxes(x, 0, 1)
    batch_first_options = dataclasses.replace(options, positions_first=False)
    out = impl(
        swap(query), swap(key), swap(value), biases, mask, options=batch_first_options, **kwargs
    )
    return (swap(out[0]), out[1]) if options.return_residual else swap(out)


def unpacked(qkv) -> tuple:
    """(query, key, value): slots 0, 1, 2 of a packed [..., T, P, N, H] ([T, B, P, N, H]) array."""
    return tuple(qkv[..., slot, :, :] for slot in range(3))


def slot_shape(x) -> jax.ShapeDtypeStruct:
    """The shape (a jax.ShapeDtypeStruct) of one slot of a packed [..., T, P, N, H] array."""
    return jax.ShapeDtypeStruct((*x.shape[:-3], *x.shape[-2:]), x.dtype)


def unpacked_shapes(query, key, value, options) -> list:
    """[query, key, value] as batch-first unpacked shapes: what a kernel taking Options.packed
    and Options.positions_first plans with."""
    if options.packed:
        query, key, value = slot_shape(query), slot_shape(key), slot_shape(value)
    return [batch_first(x) if options.positions_first else x for x in (query, key, value)]


def values_of(value, options, live_q):
    """The values numerics.finish_rows_without_key averages for rows without a key: the value
    slot of a packed array, sliced only where some row may have no key (live_q not None)."""
    return value[..., 2, :, :] if options.packed and live_q is not None else value


def batch_first(x) -> jax.ShapeDtypeStruct:
    """The [B, L, ...] shape (a jax.ShapeDtypeStruct) of a positions-first [L, B, ...] array."""
    return jax.ShapeDtypeStruct((x.shape[1], x.shape[0], *x.shape[2:]), x.dtype)


def live_shapes(structure, mask, q_len: int, k_len: int):
    """The shapes (jax.ShapeDtypeStructs) of masking.StructuredMask.live's live queries and keys for
    this mask (an array, a jax.ShapeDtypeStruct or None), or (None, None): what a plan needs of
    them, known before they are computed."""
    return jax.eval_shape(lambda s, m: s.live(m, q_len, k_len), structure, mask)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """What every kernel family's Plan holds (each adds its tiles, shapes and launch): static
    facts of one call, hashable (a custom VJP's static argument). `shared` fills these fields."""

    scale: float
    compute_dtype: str
    heads: int
    kv_heads: int
    causal: bool
    window: tuple | None  # (left, right)
    structured: bool  # causal, window or lengths: the kernels read StructuredMask.meta
    soft_cap: float | None
    interpret: Any

    @staticmethod
    def shared(impl, query, key, scale, compute_dtype, options) -> dict[str, Any]:
        """The shared fields' values for a call (keywords for a family's Plan)."""
        import jax.numpy as jnp

        structure = options.structure
        return dict(
            scale=float(scale),
            compute_dtype=jnp.dtype(compute_dtype).name,
            heads=query.shape[2],
            kv_heads=key.shape[2],
            causal=structure.is_causal,
            window=structure.window,
            structured=not structure.trivial,
            soft_cap=options.logits_soft_cap,
            interpret=impl.interpret,
        )

    @property
    def q_heads_per_kv_head(self) -> int:
        """Query heads per key/value head: head n reads key/value head n // q_heads_per_kv_head."""
        return self.heads // self.kv_heads


def check_kernel(
    what: str,
    runs_on: str,
    *,
    impl: Implementation,
    platform,
    compute_dtype,
    dtypes,
    query,
    value,
    max_head_dim: int,
) -> None:
    """The checks each Pallas kernel (attention/pallas_triton/implementation.py, attention/pallas_mosaic_tpu/implementation.py) makes of its inputs: the platform
    it lowers for (unless `impl.interpret`), its compute dtypes and head dims; raises
    NotImplementedError naming `what` and the reason."""
    import jax.numpy as jnp

    platform = platforms.host() if platform is None else platforms.kind(platform)
    if not getattr(impl, "interpret", False) and platform != runs_on:
        raise NotImplementedError(
            f"{what} runs on {runs_on.upper()} only, the program is for {platform!r} "
            f"({type(impl).__name__}(interpret=True) runs it in Pallas's interpreter anywhere)"
        )
    if jnp.dtype(compute_dtype) not in dtypes:
        names = [jnp.dtype(d).name for d in dtypes]
        listed = ", ".join(names[:-1]) + " or " + names[-1]
        raise NotImplementedError(f"{what} computes in {listed}, got {jnp.dtype(compute_dtype)}")
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    if max(head_dim, value_dim) > max_head_dim:
        raise NotImplementedError(
            f"{what} takes head dims <= {max_head_dim}, got {head_dim} (query/key) and "
            f"{value_dim} (value)"
        )


class Groups(NamedTuple):
    """N query heads over K key/value heads, G = N // K query heads per key/value head.

    Head-major arrays of the query side ([B, N, T, ...]: queries, outputs, biases, masks and
    their gradients) get a group axis when G > 1, [B, K, G, T, ...] (a free reshape: query head
    n = k * G + g), while the key side keeps [B, K, S, ...]: the einsums below contract each kv
    head with its G query heads, and no key or value is ever repeated. With G == 1 nothing
    changes shape (the 4-D einsums ran faster on XLA:CPU than 5-D ones with a unit group axis).
    """

    kv_heads: int
    size: int

    @classmethod
    def of(cls, query, key) -> Groups:
        """From query [B, T, N, H] and key [B, S, K, H] (public layout)."""
        return cls(key.shape[2], query.shape[2] // key.shape[2])

    def split(self, x, axis: int = 1):
        """A query-side array's head axis (N or 1) -> (K, G) or (1, 1); unchanged if G == 1."""
        if self.size == 1 or x is None:
            return x
        heads = (self.kv_heads, self.size) if x.shape[axis] != 1 else (1, 1)
        return x.reshape((*x.shape[:axis], *heads, *x.shape[axis + 1 :]))

    def merge(self, x, axis: int = 1):
        """The inverse of split: (K|1, G|1) -> N|1."""
        if self.size == 1 or x is None:
            return x
        return x.reshape((*x.shape[:axis], -1, *x.shape[axis + 2 :]))

    def reduce(self, live, axis: int = 1):
        """A per-query-head bool [B|1, N|1, ...] -> per kv head: any over the group."""
        if self.size == 1 or live is None or live.shape[axis] == 1:
            return live
        return self.split(live, axis).any(axis=axis + 1)

    @property
    def qk(self) -> str:  # query side x key side -> logits
        return "bnqh,bnkh->bnqk" if self.size == 1 else "bngqh,bnkh->bngqk"

    @property
    def pv(self) -> str:  # logits x key side -> query side
        return "bnqk,bnkh->bnqh" if self.size == 1 else "bngqk,bnkh->bngqh"

    @property
    def kv(self) -> str:  # logits x query side -> key side (summed over the group)
        return "bnqk,bnqh->bnkh" if self.size == 1 else "bngqk,bngqh->bnkh"


def in_row_tiles(fn: Callable[..., Any], rows: int, args: Sequence[jax.Array | None]) -> Any:
    """fn(*args) run on tiles of `rows` rows of the leading axis, each recomputed in the backward.

    args are arrays whose leading dimension is the batch B (cut into tiles) or 1 (shared by every
    tile, never broadcast), or None. fn returns an array or a pytree of arrays, each with the
    batch first. Under differentiation each tile keeps only its inputs (jax.checkpoint), so
    forward+backward memory is bounded by a tile too. rows >= B: one call.
    """
    batch = max(x.shape[0] for x in args if x is not None)
    if rows >= batch:
        return fn(*args)
    batched = [x is not None and x.shape[0] == batch for x in args]
    return mapping.subbatch(fn, args, subbatch_size=rows, batched=batched, remat=True)


def kernel_attention(forward: Callable, backward: Callable) -> Callable:
    """attention(plan, q, k, v, biases, extras) -> (out, log-sum-exp) for a kernel pair, as a
    custom VJP: forward(plan, q, k, v, biases, extras) -> (out, lse); backward(plan, residuals,
    (d_out, d_lse)) -> (dq, dk, dv, dbiases, None), residuals (q, k, v, biases, extras, out, lse).
    d_lse is the log-sum-exp's cotangent (zero unless options.residual_gradient); plan is static.

    With plan.packed, q, k and v are one packed array (Options.packed), passed to the kernels
    three times, and the backward's first result is its whole gradient (dk, dv None)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def attention(plan, q, k, v, biases, extras):
        return forward(plan, q, k, v, biases, extras)

    def attention_fwd(plan, q, k, v, biases, extras):
        out, lse = forward(plan, q, k, v, biases, extras)
        return (out, lse), (q, k, v, biases, extras, out, lse)

    attention.defvjp(attention_fwd, backward)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def packed(plan, qkv, biases, extras):
        return forward(plan, qkv, qkv, qkv, biases, extras)

    def packed_fwd(plan, qkv, biases, extras):
        out, lse = forward(plan, qkv, qkv, qkv, biases, extras)
        return (out, lse), (qkv, qkv, qkv, biases, extras, out, lse)

    def packed_bwd(plan, residuals, cotangents):
        d_qkv, _, _, dbiases, d_extras = backward(plan, residuals, cotangents)
        return d_qkv, dbiases, d_extras

    packed.defvjp(packed_fwd, packed_bwd)

    def attend(plan, q, k, v, biases, extras):
        if getattr(plan, "packed", False):
            return packed(plan, q, biases, extras)
        return attention(plan, q, k, v, biases, extras)

    return attend
