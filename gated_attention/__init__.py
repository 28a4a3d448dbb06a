"""gated_attention: AlphaFold-style gated multi-head attention for JAX and Haiku.

Public API:
  Attention, GlobalAttention            Haiku modules with AlphaFold 2's parameters.
  MSARowAttentionWithPairBias, MSAColumnAttention, MSAColumnGlobalAttention, TriangleAttention
                                         AlphaFold 2's attention family (they return the update).
  apply_dropout, dropout_update, dropout_wrapper
                                         dropout on those updates, as AlphaFold 2's Evoformer.
  dot_product_attention                  the attention op, over several implementations.
  AttentionOptions, implementation_names, choose_implementation, record_implementation_choices
  ModuleConfig, GlobalConfig             validated configs (modules also take AF2's ConfigDicts).
"""

from gated_attention.alphafold import (
    MSAColumnAttention,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    TriangleAttention,
    apply_dropout,
    dropout_update,
    dropout_wrapper,
)
from gated_attention.attention import (
    AttentionOptions,
    choose_implementation,
    dot_product_attention,
    implementation_names,
    record_implementation_choices,
)
from gated_attention.config import GlobalConfig, ModuleConfig
from gated_attention.modules import Attention, GlobalAttention

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionOptions",
    "GlobalAttention",
    "GlobalConfig",
    "MSAColumnAttention",
    "MSAColumnGlobalAttention",
    "MSARowAttentionWithPairBias",
    "ModuleConfig",
    "TriangleAttention",
    "apply_dropout",
    "choose_implementation",
    "dot_product_attention",
    "dropout_update",
    "dropout_wrapper",
    "implementation_names",
    "record_implementation_choices",
]
