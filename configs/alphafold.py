"""AlphaFold 2 monomer attention shapes (channels and heads as in AF2's model config).

Presets, chosen after the colon:
  msa_row          MSA row attention core: c_m=256, 8 heads of 32, pair (nonbatched) bias, key mask
  msa_column       MSA column attention core: c_m=256, 8 heads of 32, key mask
  triangle         triangle attention core: c_z=128, 4 heads of 32, nonbatched bias, key mask
  extra_msa_global extra-MSA column global attention: c_e=64, 8 heads of 8

  python scripts/run_forward.py --config=configs/alphafold.py:msa_row
  python scripts/run_forward.py --config=configs/alphafold.py:triangle --config.data.batch=64

Sequence counts and lengths are kept CPU-sized (AF2 runs 512 MSA rows x N_res); override them.
"""

from gated_attention_tools.experiment import schema

PRESETS = ("msa_row", "msa_column", "triangle", "extra_msa_global")


def get_config(preset="msa_row"):
    if preset not in PRESETS:
        raise ValueError(f"configs/alphafold.py preset must be one of {PRESETS}, got {preset!r}")
    cfg = schema.experiment_config()
    if preset == "msa_row":
        cfg.attention.num_head = 8
        cfg.data.batch = 64  # MSA sequences: each row attends over residues
        cfg.data.num_queries = cfg.data.num_keys = 256  # residues
        cfg.data.q_channels = cfg.data.m_channels = cfg.data.output_dim = 256  # c_m
        cfg.data.nonbatched_bias = True  # projected pair representation, [h, r, r]
    elif preset == "msa_column":
        cfg.attention.num_head = 8
        cfg.data.batch = 256  # residues: each column attends over sequences
        cfg.data.num_queries = cfg.data.num_keys = 64  # MSA sequences
        cfg.data.q_channels = cfg.data.m_channels = cfg.data.output_dim = 256  # c_m
        cfg.data.nonbatched_bias = False
    elif preset == "triangle":
        cfg.attention.num_head = 4
        cfg.data.batch = 128  # residues i: row i attends over j
        cfg.data.num_queries = cfg.data.num_keys = 128
        cfg.data.q_channels = cfg.data.m_channels = cfg.data.output_dim = 128  # c_z
        cfg.data.nonbatched_bias = True  # projected pair representation, [h, r, r]
    else:
        cfg.module = "global_attention"
        cfg.attention.num_head = 8  # 8 heads of 8 channels: key_dim = value_dim = c_e = 64
        cfg.data.batch = 256  # residues: each column attends over extra sequences
        cfg.data.num_queries = cfg.data.num_keys = 1024  # extra MSA sequences
        cfg.data.q_channels = cfg.data.m_channels = cfg.data.output_dim = 64  # c_e
        cfg.data.nonbatched_bias = False
    return cfg
