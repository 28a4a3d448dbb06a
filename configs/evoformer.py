"""AlphaFold 2's attention family as in the monomer Evoformer (model_1): one module per preset.

Presets, chosen after the colon (AF2 channels, heads and dropout rates; CPU-sized N_seq x N_res):
  msa_row            MSARowAttentionWithPairBias: c_m=256, c_z=128, 8 heads of 32, dropout 0.15
  msa_column         MSAColumnAttention: c_m=256, 8 heads of 32
  msa_column_global  MSAColumnGlobalAttention on the extra MSA: c_e=64, 8 heads of 8
  triangle_start     TriangleAttention around the starting node (per_row): c_z=128, 4 heads of 32,
                     dropout 0.25
  triangle_end       TriangleAttention around the ending node (per_column), as triangle_start

  python scripts/run_forward.py --config=configs/evoformer.py:msa_row
  python scripts/run_forward.py --config=configs/evoformer.py:triangle_end --config.data.num_queries=256
  python scripts/run_forward.py --config=configs/evoformer.py:msa_row --params=params_model_1.npz \
      --params_prefix=alphafold/alphafold_iteration/evoformer/evoformer_iteration --layer=0

The modules run in inference mode and return the update (dropout_rate is AF2's value, applied by
dropout_update in training, not here). AF2 runs 512 MSA rows (1,024+ extra sequences) x N_res; the
sizes here are kept small for CPU: override data.batch (N_seq) and data.num_queries (N_res).
"""

from gated_attention_tools.experiment import schema

PRESETS = ("msa_row", "msa_column", "msa_column_global", "triangle_start", "triangle_end")


def get_config(preset="msa_row"):
    if preset not in PRESETS:
        raise ValueError(f"configs/evoformer.py preset must be one of {PRESETS}, got {preset!r}")
    cfg = schema.experiment_config()
    cfg.data.batch = 64  # N_seq: MSA sequences (triangle attention ignores it)
    cfg.data.num_queries = cfg.data.num_keys = 128  # N_res: residues
    cfg.data.q_channels = cfg.data.m_channels = cfg.data.output_dim = 256  # c_m
    cfg.data.pair_channels = 128  # c_z
    cfg.data.nonbatched_bias = False  # Attention's input only; the family makes its own bias
    cfg.attention.num_head = 8
    if preset == "msa_row":
        cfg.module = "msa_row_attention_with_pair_bias"
        cfg.attention.orientation = "per_row"
        cfg.attention.dropout_rate = 0.15
    elif preset == "msa_column":
        cfg.module = "msa_column_attention"
        cfg.attention.orientation = "per_column"
    elif preset == "msa_column_global":
        cfg.module = "msa_column_global_attention"
        cfg.attention.orientation = "per_column"
        cfg.data.batch = 256  # extra MSA sequences (AF2: 1,024 at inference, 5,120 in CASP14 mode)
        cfg.data.q_channels = cfg.data.m_channels = cfg.data.output_dim = (
            64  # c_e; 64 / 8 heads = 8
        )
    else:
        cfg.module = "triangle_attention"
        cfg.attention.orientation = "per_row" if preset == "triangle_start" else "per_column"
        cfg.attention.num_head = 4
        cfg.attention.dropout_rate = 0.25
        cfg.data.q_channels = cfg.data.m_channels = cfg.data.output_dim = 128  # c_z
    return cfg
