"""Long-sequence self-attention in bfloat16: 1 x 4,096 tokens, c=256, 8 heads of 32, key mask.

'auto' chooses the memory-efficient implementation when the dense logits exceed the memory budget.

  python scripts/run_forward.py --config=configs/long_sequence.py
  python scripts/run_forward.py --config=configs/long_sequence.py --config.data.num_queries=16384 \
      --config.data.num_keys=16384
"""

from gated_attention_tools.experiment import schema


def get_config():
    cfg = schema.experiment_config()
    cfg.attention.num_head = 8
    cfg.data.batch = 1
    cfg.data.num_queries = cfg.data.num_keys = 4096
    cfg.data.q_channels = cfg.data.m_channels = cfg.data.output_dim = 256
    cfg.data.dtype = "bfloat16"
    cfg.data.nonbatched_bias = False
    cfg.run.steps = 3
    return cfg
