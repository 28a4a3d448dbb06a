r"""Runs one jit-compiled forward pass of a config's module on random inputs and reports it.

  python scripts/run_forward.py                                   # configs/default.py on CPU
  python scripts/run_forward.py --config=configs/alphafold.py:msa_row --config.attention.num_head=4
  python scripts/run_forward.py --platform=gpu --output_json=/tmp/report.json
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python scripts/run_forward.py \
      --config=configs/alphafold.py:msa_row --config.mesh.data=4 --config.mesh.heads=2
  python scripts/run_forward.py --config=configs/evoformer.py:triangle_end --params=params_model_1.npz \
      --params_prefix=alphafold/alphafold_iteration/evoformer/evoformer_iteration --layer=47

With --params, the module's params come from an AlphaFold 2 .npz checkpoint instead of a random init:
--params_prefix selects the parent scope of the module (AF2's name for it, e.g.
msa_row_attention_with_pair_bias), --layer one block of stacked params; every missing, unexpected or
mis-shaped param is reported.

With config.mesh larger than 1 x 1, the rows are split over the mesh's 'data' axis and the heads
(parameters and pair bias) over its 'heads' axis (explicit axes; docs/many_devices.md).

Prints the report: devices, the mesh and the output's sharding, shapes, dtype, the implementation
chosen, compile time, median and fastest step (ms, three significant figures), GFLOP/s, XLA's
compiled memory analysis and an output checksum. Writes nothing unless --output_json names a file
(the report with raw values and the config), and then prints its path. About 4 s on 2 CPU cores with
the default config, most of it importing JAX.
"""

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

# The tooling (gated_attention_tools) runs from this checkout, not the wheel: its root on the path.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    os.path.join(os.path.dirname(__file__), "..", "configs", "default.py"),
    "Experiment config file (configs/<file>.py[:preset]); override keys with --config.<key>=<value>.",
    lock_config=True,
)
_PLATFORM = flags.DEFINE_enum(
    "platform",
    None,
    ["cpu", "gpu", "tpu"],
    "JAX platform (default: JAX_PLATFORMS or JAX's choice).",
)
_OUTPUT_JSON = flags.DEFINE_string(
    "output_json", None, "Also write the report as JSON to this path."
)
_PARAMS = flags.DEFINE_string("params", None, "AlphaFold 2 .npz checkpoint to take params from.")
_PARAMS_PREFIX = flags.DEFINE_string(
    "params_prefix",
    None,
    "Scope prefix in --params under which the module's scope lies, e.g. "
    "alphafold/alphafold_iteration/evoformer/evoformer_iteration.",
)
_LAYER = flags.DEFINE_integer(
    "layer",
    None,
    "Index of the stacked layer to take from --params (e.g. 0..47 for the Evoformer).",
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import jax  # imported after flags so that --platform and x64 take effect

    from gated_attention_tools import environment
    from gated_attention_tools.experiment import run

    if not _PLATFORM.value:
        environment.cpu_unless_accelerator()  # no GPU/TPU plugin tracebacks on a CPU machine
    if _PLATFORM.value:
        jax.config.update("jax_platforms", _PLATFORM.value)
        problem = run.platform_problem(_PLATFORM.value)
        if problem:
            sys.exit(problem)
    if _CONFIG.value.data.dtype == "float64":
        jax.config.update("jax_enable_x64", True)

    params = None
    if _PARAMS.value:
        params = run.load_params(
            _CONFIG.value, _PARAMS.value, prefix=_PARAMS_PREFIX.value, layer=_LAYER.value
        )
    elif _PARAMS_PREFIX.value is not None or _LAYER.value is not None:
        raise app.UsageError("--params_prefix and --layer need --params")
    report = run.run_forward(_CONFIG.value, params=params)
    report["params"] = dict(path=_PARAMS.value, prefix=_PARAMS_PREFIX.value, layer=_LAYER.value)
    report["config"] = _CONFIG.value.to_dict()
    print("\n".join(run.summary(report)))
    if _OUTPUT_JSON.value:
        with open(_OUTPUT_JSON.value, "w") as f:
            json.dump(report, f, indent=2)
        print(
            f"wrote the report, raw values and the config, to {os.path.abspath(_OUTPUT_JSON.value)}"
        )
    else:
        print("wrote no file (--output_json=PATH writes the report as JSON)")
    if not report["output_checksum"]["finite"]:
        sys.exit("output is not finite")


if __name__ == "__main__":
    app.run(main)
