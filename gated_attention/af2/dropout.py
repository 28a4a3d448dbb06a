"""Dropout as AlphaFold 2's Evoformer applies it to the attention modules' updates: inverted
dropout, its mask shared along one axis per orientation (config.shared_dropout), off when
deterministic or not training (AF2's global_config).
"""

from __future__ import annotations

from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp

from gated_attention.af2 import config as config_lib
from gated_attention.core import checks

# Axis whose dropout mask is shared when config.shared_dropout, per orientation (AF2: per_row -> 0,
# per_column -> 1 of [N_seq|N_res, N_res, c]); counted from the end so leading axes may be added.
_SHARED_DROPOUT_AXIS = {"per_row": -3, "per_column": -2}


def apply_dropout(
    tensor: jax.Array,
    rate: float,
    is_training: bool,
    *,
    broadcast_dim: int | None = None,
    rng: jax.Array | None = None,
) -> jax.Array:
    """Inverted dropout: zeroes each entry with probability `rate`, scales the rest by 1/(1-rate).

    Args:
      tensor: any shape, floating point.
      rate: drop probability in [0, 1).
      is_training: when False (or rate == 0) the tensor is returned unchanged.
      broadcast_dim: an axis along which one mask value is shared (the mask has size 1 there), e.g.
        -3 to drop whole [r, c] entries alike for every MSA row; None: independent entries.
      rng: a PRNG key; None draws one with hk.next_rng_key() (inside hk.transform with an rng).

    Returns:
      tensor's shape and dtype.
    """
    checks.check_rate("rate", rate)
    if not is_training or rate == 0.0:
        return tensor
    shape = list(tensor.shape)
    if broadcast_dim is not None:
        if not -tensor.ndim <= broadcast_dim < tensor.ndim:
            raise ValueError(
                f"broadcast_dim={broadcast_dim} is out of range for a tensor of shape "
                f"{tuple(tensor.shape)}"
            )
        shape[broadcast_dim] = 1
    rng = hk.next_rng_key() if rng is None else rng
    keep_rate = 1.0 - rate
    keep = jax.random.bernoulli(rng, keep_rate, shape)
    return jnp.where(
        keep, tensor / jnp.asarray(keep_rate, tensor.dtype), jnp.zeros((), tensor.dtype)
    )


def dropout_update(
    config: Any,
    global_config: Any,
    update: jax.Array,
    is_training: bool,
    *,
    rng: jax.Array | None = None,
) -> jax.Array:
    """Dropout on a family module's update with AF2's rules (its dropout_wrapper).

    The rate is config.dropout_rate, or 0 when global_config.deterministic. Dropout runs when
    is_training, or always when global_config.eval_dropout. With config.shared_dropout one mask value
    is shared along the orientation's axis: 'per_row' -> axis -3 (every row of [s|r, r, c] alike),
    'per_column' -> axis -2 (every column alike).

    Args:
      config: the module's config (ModuleConfig or AF2's ConfigDict).
      global_config: the global config.
      update: [..., N, N_res, c], the module's output.
      is_training: training mode.
      rng: a PRNG key; None uses hk.next_rng_key().

    Returns:
      update with dropout applied, same shape and dtype.
    """
    config = config_lib.module_config(config)
    global_config = config_lib.global_config(global_config)
    rate = 0.0 if global_config.deterministic else config.dropout_rate
    broadcast_dim = _SHARED_DROPOUT_AXIS[config.orientation] if config.shared_dropout else None
    return apply_dropout(
        update,
        rate,
        is_training or global_config.eval_dropout,
        broadcast_dim=broadcast_dim,
        rng=rng,
    )


def dropout_wrapper(
    module: Any,
    input_act: jax.Array,
    mask: jax.Array,
    *args: Any,
    is_training: bool = False,
    output_act: jax.Array | None = None,
    rng: jax.Array | None = None,
    **kwargs: Any,
) -> jax.Array:
    """The residual update AF2's Evoformer makes: output_act + dropout(module(input_act, mask, ...)).

    Args:
      module: a family module instance (its config and global_config set the dropout).
      input_act: the module's activations input, e.g. msa_act or pair_act.
      mask: the module's mask input.
      *args: further positional inputs (MSARowAttentionWithPairBias: pair_act).
      is_training: training mode.
      output_act: the activations the update is added to (default input_act).
      rng: a PRNG key for dropout; None uses hk.next_rng_key().
      **kwargs: further keyword inputs of the module.

    Returns:
      output_act + dropout(update), output_act's shape.
    """
    update = module(input_act, mask, *args, is_training=is_training, **kwargs)
    update = dropout_update(module.config, module.global_config, update, is_training, rng=rng)
    return (input_act if output_act is None else output_act) + update
