"""What an attention implementation is: a frozen dataclass that carries its own tuning.

An implementation takes dot_product_attention's validated inputs in the public layout, with the
batch dimensions flattened to one:

  query [B, T, N, H], key [B, S, N, H], value [B, S, N, Hv]   (the compute dtype's caller dtype)
  biases: a tuple of float arrays [B|1, N|1, T|1, S|1]          (added; possibly empty)
  mask: None or bool [B|1, N|1, T|1, S|1]                       (True = attend)

and returns [B, T, N, Hv] in query's dtype. It computes in `compute_dtype` (numerics.py's policy,
resolved by the op), casting inside its own tiles, and makes any layout change there too, so no
whole-array copy of query, key or value is made. Masks follow numerics.py: masked positions never
leak, a fully masked row is the uniform average of the values. `check` raises NotImplementedError
saying why when the implementation cannot take the inputs here; the op calls it before __call__.
Inputs reach an implementation already validated: it asserts, it does not re-check.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import ClassVar

import jax

from gated_attention import mapping


@dataclasses.dataclass(frozen=True)
class Implementation(abc.ABC):
    """Base of the attention implementations (xla.XlaAttention, chunked.ChunkedAttention, ...)."""

    name: ClassVar[str]

    def check(self, query, key, value, biases, mask, *, compute_dtype) -> None:
        """Raises NotImplementedError (with the reason) if these inputs cannot run here.

        Arguments as for __call__ (arrays or jax.ShapeDtypeStructs). The default takes anything.
        """
        del query, key, value, biases, mask, compute_dtype

    @abc.abstractmethod
    def __call__(
        self, query, key, value, biases: tuple, mask, *, scale: float, compute_dtype
    ) -> jax.Array:
        """Attention over validated inputs (module docstring): [B, T, N, Hv] in query's dtype."""


def in_row_tiles(
    fn: Callable[..., jax.Array], rows: int, args: Sequence[jax.Array | None]
) -> jax.Array:
    """fn(*args) run on tiles of `rows` rows of the leading axis, each recomputed in the backward.

    args are arrays whose leading dimension is the batch B (cut into tiles) or 1 (shared by every
    tile, never broadcast), or None. Under differentiation each tile keeps only its inputs
    (jax.checkpoint), so forward+backward memory is bounded by a tile too. rows >= B: one call.
    """
    batch = max(x.shape[0] for x in args if x is not None)
    if rows >= batch:
        return fn(*args)
    batched = [x is not None and x.shape[0] == batch for x in args]
    return mapping.subbatch(jax.checkpoint(fn), args, subbatch_size=rows, batched=batched)
