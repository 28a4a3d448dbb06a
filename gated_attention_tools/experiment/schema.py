"""The experiment schema of configs/*.py and scripts/: every key, its default and its validation.

Also the table of modules an experiment can run (cfg.module), so that the names, the AF2 family's
classes and orientations, and the Haiku names `build` gives them live in one place.
"""

from __future__ import annotations

import ml_collections

from gated_attention.af2 import config as config_lib
from gated_attention.af2 import family as alphafold
from gated_attention.af2.config import ORIENTATIONS
from gated_attention.core import checks

# cfg.module -> AF2 family module class.
FAMILY = {
    "msa_row_attention_with_pair_bias": alphafold.MSARowAttentionWithPairBias,
    "msa_column_attention": alphafold.MSAColumnAttention,
    "msa_column_global_attention": alphafold.MSAColumnGlobalAttention,
    "triangle_attention": alphafold.TriangleAttention,
}
# The orientation AF2's config gives each family module (TriangleAttention takes either: per_row =
# starting node, per_column = ending node).
FAMILY_ORIENTATIONS = {
    "msa_row_attention_with_pair_bias": ("per_row",),
    "msa_column_attention": ("per_column",),
    "msa_column_global_attention": ("per_column",),
    "triangle_attention": ORIENTATIONS,
}
MODULES = ("attention", "global_attention", *FAMILY_ORIENTATIONS)
DTYPES = ("float32", "bfloat16", "float16", "float64")
MASKS = ("none", "key", "query_key")


def module_name(cfg: ml_collections.ConfigDict) -> str:
    """The Haiku name `run.build` gives cfg.module's module: AF2's, as its checkpoints spell it.

    triangle_attention is named as in AF2's Evoformer block: triangle_attention_starting_node
    (per_row) or triangle_attention_ending_node (per_column).
    """
    if cfg.module in ("attention", "global_attention"):
        return "attention"
    if cfg.module == "triangle_attention":
        node = "starting" if cfg.attention.orientation == "per_row" else "ending"
        return f"triangle_attention_{node}_node"
    return cfg.module


def num_rows(cfg: ml_collections.ConfigDict) -> int:
    """The input's leading axis, the one config.mesh.data splits: the pair's rows (num_queries) for
    triangle_attention, else the batch (the MSA's sequences)."""
    return cfg.data.num_queries if cfg.module == "triangle_attention" else cfg.data.batch


def experiment_config() -> ml_collections.ConfigDict:
    """The default experiment: one Attention forward on small random inputs (a few ms on CPU).

    configs/*.py start from this and set attributes; scripts validate with `check_experiment`.
    """
    cfg = ml_collections.ConfigDict()
    cfg.module = "attention"  # one of MODULES

    # Module config, AF2's keys plus our per-module overrides (ModuleConfig).
    cfg.attention = ml_collections.ConfigDict()
    cfg.attention.num_head = 4
    cfg.attention.gating = True
    cfg.attention.key_dim = ml_collections.config_dict.placeholder(int)  # None: q_channels
    cfg.attention.value_dim = ml_collections.config_dict.placeholder(int)  # None: m_channels
    cfg.attention.orientation = "per_row"
    cfg.attention.dropout_rate = 0.0
    cfg.attention.shared_dropout = True
    cfg.attention.attention_implementation = ml_collections.config_dict.placeholder(str)
    cfg.attention.query_chunk_size = ml_collections.config_dict.placeholder(int)
    cfg.attention.key_chunk_size = ml_collections.config_dict.placeholder(int)
    cfg.attention.memory_budget_mib = ml_collections.config_dict.placeholder(float)

    # Global config (GlobalConfig); AF2 keys we ignore may be added freely.
    cfg.global_config = ml_collections.ConfigDict()
    cfg.global_config.zero_init = False  # random output_w, so the output checksum means something
    cfg.global_config.subbatch_size = ml_collections.config_dict.placeholder(int)  # None: off
    cfg.global_config.deterministic = True
    cfg.global_config.eval_dropout = False
    cfg.global_config.attention_implementation = "auto"
    cfg.global_config.query_chunk_size = ml_collections.config_dict.placeholder(int)
    cfg.global_config.key_chunk_size = ml_collections.config_dict.placeholder(int)
    # None: per platform (DEFAULT_MEMORY_BUDGET_MIB on CPU and TPU, a share of a GPU's memory).
    cfg.global_config.memory_budget_mib = ml_collections.config_dict.placeholder(float)
    cfg.global_config.gpu_memory_fraction = 0.1
    cfg.global_config.compute_dtype = "auto"  # numerics.POLICIES: float32 for bf16/f16 on CPU

    # Input sizes: q_data [batch, num_queries, q_channels], m_data [batch, num_keys, m_channels].
    # The AF2 family modules (self-attention, update of the input's shape) read only batch as
    # N_seq, num_queries as N_res, q_channels as c_m (c_z for triangle_attention, whose input is
    # [N_res, N_res, c_z] and which ignores batch) and pair_channels; their mask is AF2's float 0/1
    # mask over positions ('key' and 'query_key' alike; 'none' = all ones).
    cfg.data = ml_collections.ConfigDict()
    cfg.data.batch = 4
    cfg.data.num_queries = 64
    cfg.data.num_keys = 64
    cfg.data.q_channels = 64
    cfg.data.m_channels = 64
    cfg.data.output_dim = 64
    cfg.data.pair_channels = (
        128  # c_z of pair_act, msa_row_attention_with_pair_bias only (AF2: 128)
    )
    cfg.data.dtype = "float32"  # one of DTYPES
    cfg.data.mask = "key"  # one of MASKS: none, key [b, 1, 1, k], query_key [b, 1, q, k]
    cfg.data.masked_fraction = 0.1  # fraction of keys masked out at random
    cfg.data.nonbatched_bias = True  # a [h, q, k] bias shared by the batch (Attention only)

    # Devices: a mesh of data x heads devices with explicit axes ('data', 'heads'); 1 x 1 runs on
    # one device. The batch rows (the MSA's sequences, the pair's rows) are split over 'data', the
    # heads over 'heads' (sharding.head_parallel_specs). On CPU, more devices than cores come from
    # XLA_FLAGS=--xla_force_host_platform_device_count=N, set before JAX starts.
    cfg.mesh = ml_collections.ConfigDict()
    cfg.mesh.data = 1
    cfg.mesh.heads = 1

    cfg.run = ml_collections.ConfigDict()
    cfg.run.seed = 0
    cfg.run.steps = 10  # timed steps after the compiling call
    cfg.run.warmup = 1  # untimed steps after the compiling call
    return cfg


def check_experiment(cfg: ml_collections.ConfigDict) -> None:
    """Validates an experiment config; raises ValueError naming the key, its value and what it expects."""
    if cfg.module not in MODULES:
        raise ValueError(f"config.module must be one of {MODULES}, got {cfg.module!r}")
    config_lib.module_config(cfg.attention)
    config_lib.global_config(cfg.global_config)
    data = cfg.data
    for key in (
        "batch",
        "num_queries",
        "num_keys",
        "q_channels",
        "m_channels",
        "output_dim",
        "pair_channels",
    ):
        checks.check_int(f"config.data.{key}", data[key], minimum=1)
    orientations = FAMILY_ORIENTATIONS.get(cfg.module, ORIENTATIONS)
    if cfg.attention.orientation not in orientations:
        raise ValueError(
            f"config.attention.orientation must be one of {orientations} for module "
            f"{cfg.module!r}, got {cfg.attention.orientation!r}"
        )
    if data.dtype not in DTYPES:
        raise ValueError(f"config.data.dtype must be one of {DTYPES}, got {data.dtype!r}")
    if data.mask not in MASKS:
        raise ValueError(f"config.data.mask must be one of {MASKS}, got {data.mask!r}")
    if not 0.0 <= data.masked_fraction < 1.0:
        raise ValueError(
            f"config.data.masked_fraction must be in [0, 1), got {data.masked_fraction!r}"
        )
    if cfg.module == "global_attention" and data.num_keys != data.num_queries:
        raise ValueError(
            f"global_attention needs config.data.num_keys == num_queries, got "
            f"{data.num_keys} and {data.num_queries}"
        )
    checks.check_int("config.mesh.data", cfg.mesh.data, minimum=1)
    checks.check_int("config.mesh.heads", cfg.mesh.heads, minimum=1)
    rows = num_rows(cfg)
    if rows % cfg.mesh.data:
        what = "num_queries (the pair's rows)" if cfg.module == "triangle_attention" else "batch"
        raise ValueError(
            f"config.mesh.data={cfg.mesh.data} devices cannot share config.data.{what}={rows} "
            "rows evenly; expected a divisor of it"
        )
    num_head = cfg.attention.num_head
    if num_head % cfg.mesh.heads:
        raise ValueError(
            f"config.mesh.heads={cfg.mesh.heads} devices cannot share config.attention.num_head="
            f"{num_head} heads evenly; expected a divisor of it"
        )
    checks.check_int("config.run.steps", cfg.run.steps, minimum=1)
    checks.check_int("config.run.warmup", cfg.run.warmup, minimum=0)
