"""AlphaFold 3's inline self attention on this library's op: `diffusion_transformer.
self_attention`, which AF3's single transformer (PairFormerIteration's single attention) and its
diffusion transformer call with the pair's logits as a bias, writes its logits, softmax and
weighted average out in place. Here the same function computes them with
gated_attention.dot_product_attention, between AF3's own layers: its adaptive LayerNorm, its
projections (hm.Linear under AF3's names, so AF3's parameters apply unchanged), its gate and its
adaptive zero-init output. Calls with AF3's query/key LayerNorm or rotary embedding (RF3's,
HelixFold 3's) go to AF3's own function.

Einsum letters as AF3's: q/k token positions, h heads, c per-head channels.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import jax

from gated_attention.attention import api


def self_attention(
    original: Callable,
    implementation: Any,
    x,
    mask,
    pair_logits,
    config,
    global_config,
    single_cond=None,
    name: str = "",
    kq_norm: bool = False,
    gate_bias: float = 0.0,
    use_gating_query: bool = True,
    project_output: bool = True,
    rope=None,
):
    """AF3's self_attention(x, mask, pair_logits, config, global_config, ...) with our op.

    Args:
      original: AF3's own function, for the calls this one does not take (kq_norm, rope).
      implementation: our op's implementation argument.
      x: [..., q, c] activations.
      mask: [..., q] token mask (0 = padding: no query attends to it).
      pair_logits: None or [h, q, k], added to the logits.
      config, global_config, single_cond, name, kq_norm, gate_bias, use_gating_query,
        project_output, rope: AF3's.

    Returns:
      [..., q, c] in x's dtype, as AF3's.
    """
    if kq_norm or rope is not None:
        return original(
            x, mask, pair_logits, config, global_config, single_cond, name=name,
            kq_norm=kq_norm, gate_bias=gate_bias, use_gating_query=use_gating_query,
            project_output=project_output, rope=rope,
        )  # fmt: skip
    dt = importlib.import_module("alphafold3.model.network.diffusion_transformer")
    hm = importlib.import_module("alphafold3.model.components.haiku_modules")
    x = dt.adaptive_layernorm(x, single_cond, name=name, global_config=global_config)
    channels = x.shape[-1]
    heads = config.num_head
    key_dim = (config.key_dim or channels) // heads
    value_dim = (config.value_dim or channels) // heads
    q = hm.Linear((heads, key_dim), use_bias=True, name=f"{name}q_projection")(x)  # [..., q, h, c]
    k = hm.Linear((heads, key_dim), use_bias=False, name=f"{name}k_projection")(x)  # [..., k, h, c]
    v = hm.Linear((heads, value_dim), use_bias=False, name=f"{name}v_projection")(x)
    keys = (mask != 0)[..., None, None, :]  # [..., 1, 1, k]: the padded tokens masked as keys
    out = api.dot_product_attention(q, k, v, pair_logits, keys, implementation=implementation)
    out = out.reshape(out.shape[:-2] + (heads * value_dim,))  # [..., q, h * c]
    if use_gating_query:
        gate = hm.Linear(
            heads * value_dim, bias_init=1.0, initializer="zeros", name=f"{name}gating_query"
        )(x)
        out = out * jax.nn.sigmoid(gate + gate_bias)
    return dt.adaptive_zero_init(
        out, channels, single_cond, global_config, name, project=project_output
    )
