"""gated_attention: AlphaFold-style gated multi-head attention for JAX and Haiku.

Public API (everything else is internal):
  Attention, GlobalAttention            Haiku modules with AlphaFold 2's parameters.
  MSARowAttentionWithPairBias, MSAColumnAttention, MSAColumnGlobalAttention, TriangleAttention
                                         AlphaFold 2's attention family (they return the update).
  apply_dropout, dropout_update, dropout_wrapper
                                         dropout on those updates, as AlphaFold 2's Evoformer.
  ModuleConfig, GlobalConfig             validated configs (modules also take AF2's ConfigDicts).
  dot_product_attention                  the attention op in jax.nn's layout.
  packed_dot_product_attention           the same over one packed [..., T, 3, N, H] q/k/v array.
  Implementation, XlaAttention, ChunkedAttention, CudnnAttention, MosaicAttention,
  PallasAttention, PallasTpuAttention, Auto, IMPLEMENTATIONS
                                         its implementations (instances carry their tuning).
  TokamaxAttention, ColabFoldAttention   tokamax's and ColabFold's kernels behind its contract,
                                         where installed (the GPU's tuning table may name them).
  record_implementation_choices          what the op chose, per call.
  load_af2_params, save_af2_params, check_params, diff_params
                                         AlphaFold 2 .npz checkpoints <-> Haiku params.
  head_parallel_specs                    partition specs sharding AF2's params by head.
  af2_package.use_gated_attention        AlphaFold 2's own model (alphafold-colabfold) built with
                                         these attention modules.
  colabdesign.use_gated_attention        ColabDesign's AlphaFold 2 (protein design; BindCraft's) built
                                         with them; colabdesign.adapt_colabdesign: it on this JAX.
  af3.use_gated_attention                AlphaFold 3's own model (alphafold3-colabfold, Python >= 3.12)
                                         with its pair attention on this op.
"""

import jax as _jax

from gated_attention.core import compat as _compat

_compat.check_jax(_jax)  # before any module touches what an older jax lacks
_compat.import_pallas()  # before any trace: a setting it registers would change jit cache keys

from gated_attention import af3
from gated_attention.af2 import af2_package, colabdesign
from gated_attention.af2.config import GlobalConfig, ModuleConfig
from gated_attention.af2.dropout import apply_dropout, dropout_update, dropout_wrapper
from gated_attention.af2.family import (
    MSAColumnAttention,
    MSAColumnGlobalAttention,
    MSARowAttentionWithPairBias,
    TriangleAttention,
)
from gated_attention.af2.modules import Attention, GlobalAttention
from gated_attention.af2.params import check_params, diff_params, load_af2_params, save_af2_params
from gated_attention.attention.api import (
    IMPLEMENTATIONS,
    Auto,
    dot_product_attention,
    packed_dot_product_attention,
    record_implementation_choices,
)
from gated_attention.attention.base import Implementation
from gated_attention.attention.cudnn import CudnnAttention
from gated_attention.attention.pallas_mosaic_gpu.implementation import MosaicAttention
from gated_attention.attention.pallas_mosaic_tpu.implementation import PallasTpuAttention
from gated_attention.attention.pallas_triton.implementation import PallasAttention
from gated_attention.attention.peers import ColabFoldAttention, TokamaxAttention
from gated_attention.attention.xla import XlaAttention
from gated_attention.attention.xla_chunked.implementation import ChunkedAttention
from gated_attention.parallel.sharding import head_parallel_specs

__version__ = "0.2.0"

__all__ = [
    "IMPLEMENTATIONS",
    "Attention",
    "Auto",
    "ChunkedAttention",
    "ColabFoldAttention",
    "CudnnAttention",
    "GlobalAttention",
    "GlobalConfig",
    "Implementation",
    "MSAColumnAttention",
    "MSAColumnGlobalAttention",
    "MSARowAttentionWithPairBias",
    "ModuleConfig",
    "MosaicAttention",
    "PallasAttention",
    "PallasTpuAttention",
    "TokamaxAttention",
    "TriangleAttention",
    "XlaAttention",
    "af2_package",
    "af3",
    "apply_dropout",
    "colabdesign",
    "check_params",
    "diff_params",
    "dot_product_attention",
    "dropout_update",
    "dropout_wrapper",
    "head_parallel_specs",
    "load_af2_params",
    "packed_dot_product_attention",
    "record_implementation_choices",
    "save_af2_params",
]
