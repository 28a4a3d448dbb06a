"""Default experiment: one small Attention forward (a few ms on CPU).

python scripts/run_forward.py --config=configs/default.py --config.data.batch=8
"""

from gated_attention_tools.experiment import schema


def get_config():
    return schema.experiment_config()
