"""Config presets, the experiment schema, and scripts/run_forward.py end to end."""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import jax
import ml_collections
import numpy as np
import pytest

from gated_attention.af2 import config as config_lib
from gated_attention.af2 import params as params_lib
from gated_attention_tools import environment
from gated_attention_tools.experiment import run, schema
from gated_attention_tools.family_benchmark import random_params

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRESETS = [("default.py", None), ("long_sequence.py", None)] + [
    ("alphafold.py", p) for p in ("msa_row", "msa_column", "triangle", "extra_msa_global")
]


def _load(file, preset):
    spec = importlib.util.spec_from_file_location("cfg", ROOT / "configs" / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config() if preset is None else module.get_config(preset)


def _shrink(cfg):
    """Keep the preset's module, heads, channels and dtype; make the data tiny."""
    cfg.data.batch, cfg.data.num_queries, cfg.data.num_keys = 2, 8, 8
    cfg.run.steps, cfg.run.warmup = 1, 0
    return cfg


@pytest.mark.parametrize("file,preset", PRESETS)
def test_every_preset_builds_and_runs_a_tiny_forward(file, preset):
    cfg = _load(file, preset)
    schema.check_experiment(cfg)
    report = run.run_forward(_shrink(cfg))
    assert report["output_checksum"]["finite"]
    assert report["output_shape"] == [2, 8, cfg.data.output_dim]
    assert report["dtype"] == cfg.data.dtype and report["implementations"]
    expected_compute = "float32" if cfg.data.dtype in ("bfloat16", "float16") else cfg.data.dtype
    assert report["compute_dtype"] == expected_compute  # CPU: low precision runs in float32
    assert report["output_checksum"]["abs_sum"] > 0  # zero_init off: a real output


def test_alphafold_presets_carry_af2_shapes():
    msa_row = _load("alphafold.py", "msa_row")
    assert (msa_row.attention.num_head, msa_row.data.q_channels) == (8, 256)
    triangle = _load("alphafold.py", "triangle")
    assert (triangle.attention.num_head, triangle.data.q_channels) == (4, 128)
    extra = _load("alphafold.py", "extra_msa_global")
    assert (
        extra.module == "global_attention"
        and extra.data.q_channels // extra.attention.num_head == 8
    )
    with pytest.raises(ValueError, match=r"preset must be one of .*got 'msa_rows'"):
        _load("alphafold.py", "msa_rows")


def test_report_matches_a_direct_forward():
    cfg = _shrink(schema.experiment_config())
    problem = run.build(cfg)
    params = random_params(problem.forward, problem.inputs)
    out = jax.jit(problem.forward.apply)(params, None, *problem.inputs)
    report = run.run_forward(cfg, params=params)
    np.testing.assert_allclose(report["output_checksum"]["sum"], float(np.sum(out)), rtol=1e-5)


EXPERIMENT_ERRORS = {
    "module": (lambda c: setattr(c, "module", "attn"), r"config.module must be one of"),
    "dtype": (
        lambda c: setattr(c.data, "dtype", "float8"),
        r"config.data.dtype must be one of .*got 'float8'",
    ),
    "mask": (lambda c: setattr(c.data, "mask", "causal"), r"config.data.mask must be one of"),
    "batch": (
        lambda c: setattr(c.data, "batch", 0),
        r"config.data.batch must be an int >= 1, got 0",
    ),
    "fraction": (
        lambda c: setattr(c.data, "masked_fraction", 1.0),
        r"masked_fraction must be in \[0, 1\)",
    ),
    "steps": (lambda c: setattr(c.run, "steps", 0), r"config.run.steps must be an int >= 1"),
    "num_head": (
        lambda c: setattr(c.attention, "num_head", -1),
        r"config.num_head must be an int >= 1",
    ),
    "mesh_size": (lambda c: setattr(c.mesh, "data", 0), r"config.mesh.data must be an int >= 1"),
    "mesh_rows": (
        lambda c: setattr(c.mesh, "data", 3),
        r"config.mesh.data=3 devices cannot share config.data.batch=4 rows evenly",
    ),
    "mesh_heads": (
        lambda c: setattr(c.mesh, "heads", 3),
        r"config.mesh.heads=3 devices cannot share config.attention.num_head=4 heads evenly",
    ),
}


@pytest.mark.parametrize("case", list(EXPERIMENT_ERRORS))
def test_experiment_errors(case):
    mutate, match = EXPERIMENT_ERRORS[case]
    cfg = schema.experiment_config()
    mutate(cfg)
    with pytest.raises(ValueError, match=match):
        schema.check_experiment(cfg)


@pytest.mark.parametrize(
    "file,preset",
    [("default.py", None), ("evoformer.py", "triangle_end"), ("evoformer.py", "msa_row")],
)
def test_run_forward_on_a_mesh_matches_one_device(file, preset):
    """data x heads = 2 x 2 of the 8 virtual devices (tests/conftest.py): rows over 'data', heads
    over 'heads', the same output as on one device."""
    cfg = _load(file, preset)
    cfg.data.batch, cfg.data.num_queries, cfg.data.num_keys = 4, 8, 8
    cfg.attention.num_head = 4
    cfg.run.steps, cfg.run.warmup = 1, 0
    one = run.run_forward(cfg)
    cfg.mesh.data, cfg.mesh.heads = 2, 2
    report = run.run_forward(cfg)
    assert one["mesh"] is None and report["mesh"] == {"data": 2, "heads": 2}
    assert report["output_sharding"] == str(jax.sharding.PartitionSpec("data", None, None))
    for key in ("sum", "abs_sum"):
        np.testing.assert_allclose(
            report["output_checksum"][key], one["output_checksum"][key], rtol=1e-5
        )


def test_run_forward_mesh_larger_than_the_devices():
    cfg = _shrink(schema.experiment_config())
    cfg.data.batch, cfg.mesh.data = 16, 16
    with pytest.raises(
        ValueError, match=r"config.mesh asks for data x heads = 16 x 1 = 16 devices, but JAX has 8"
    ):
        run.run_forward(cfg)


def test_global_attention_needs_equal_lengths():
    cfg = _load("alphafold.py", "extra_msa_global")
    cfg.data.num_keys = cfg.data.num_queries + 1
    with pytest.raises(ValueError, match=r"num_keys == num_queries"):
        schema.check_experiment(cfg)


def test_configdict_and_frozen_configdict_are_accepted():
    module = config_lib.module_config(
        ml_collections.FrozenConfigDict(dict(num_head=2, gating=False))
    )
    assert (module.num_head, module.gating, module.key_dim) == (2, False, None)


def _run_script(*args, platforms="cpu"):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env.update({} if platforms is None else dict(JAX_PLATFORMS=platforms))
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "run_forward.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def test_run_forward_script_end_to_end(tmp_path):
    """The script's whole run on a mesh, as a user starts it: JAX_PLATFORMS unset. Without an
    accelerator it prints no plugin errors: with the targets extra, JAX would try to start its
    CUDA plugin and libtpu and print their failures; the script starts the CPU alone instead
    (gated_attention_tools/environment.py)."""
    out = tmp_path / "report.json"
    result = _run_script(
        f"--config={ROOT / 'configs' / 'alphafold.py'}:triangle",
        "--config.data.batch=2",
        "--config.data.num_queries=16",
        "--config.data.num_keys=16",
        "--config.attention.num_head=2",
        "--config.run.steps=2",
        "--config.mesh.data=2",  # the 8 virtual devices of tests/conftest.py's XLA_FLAGS
        "--config.mesh.heads=2",
        f"--output_json={out}",
        "--verbosity=1",  # the library's choices (logged at DEBUG, silent otherwise)
        platforms=None,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if not environment.accelerator_present():
        for noise in ("Traceback", "plugin configuration error", "Unable to initialize backend"):
            assert noise not in result.stderr, result.stderr[-3000:]
        assert "backend: cpu" in result.stdout
    report = json.loads(out.read_text())
    assert report["mesh"] == {"data": 2, "heads": 2} and "mesh" in result.stdout
    assert (
        report["input_shapes"]["q_data"] == [2, 16, 128]
        and report["config"]["attention"]["num_head"] == 2
    )
    assert report["output_checksum"]["finite"] and report["median_step_s"] > 0
    assert report["memory"]["temp_size_in_bytes"] is not None
    assert " implementation: auto -> " in result.stdout and "        compile: " in result.stdout
    assert f"wrote the report, raw values and the config, to {out}" in result.stdout
    assert re.search(r"    median step: \d[\d,.]* ms of 2 steps", result.stdout), result.stdout
    # Each choice logged once (asked for: --verbosity=1), though init and apply both trace the op.
    logged = [line for line in result.stderr.splitlines() if "dot_product_attention: " in line]
    assert len(logged) == len(set(line.split("] ", 1)[-1] for line in logged)) >= 1, logged


def test_cpu_unless_accelerator(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    (tmp_path / "dev").mkdir()
    monkeypatch.setattr(jax.config, "update", lambda *a: None)  # this process keeps its backends
    assert environment.cpu_unless_accelerator(str(tmp_path)) == "cpu"
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    monkeypatch.delenv("JAX_PLATFORMS")
    (tmp_path / "dev" / "nvidiactl").touch()  # a GPU machine: JAX chooses
    assert environment.cpu_unless_accelerator(str(tmp_path)) is None
    assert "JAX_PLATFORMS" not in os.environ
    (tmp_path / "dev" / "nvidiactl").unlink()
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")  # the user's choice stays
    assert environment.cpu_unless_accelerator(str(tmp_path)) is None
    assert os.environ["JAX_PLATFORMS"] == "tpu"


def test_run_forward_rejects_misspelt_override():
    result = _run_script("--config.attention.num_heads=4")
    assert result.returncode != 0
    assert "num_heads" in result.stderr


# --------------------------------------------------------------------------------------------
# configs/evoformer.py: AF2's attention family, with params from an AF2 checkpoint.

EVOFORMER_PRESETS = ("msa_row", "msa_column", "msa_column_global", "triangle_start", "triangle_end")
EVO = "alphafold/alphafold_iteration/evoformer/evoformer_iteration"


def _tiny_evoformer(preset):
    cfg = _load("evoformer.py", preset)
    cfg.data.batch, cfg.data.num_queries = 3, 8  # N_seq, N_res
    cfg.run.steps, cfg.run.warmup = 1, 0
    return cfg


@pytest.mark.parametrize("preset", EVOFORMER_PRESETS)
def test_every_evoformer_preset_runs_a_tiny_forward(preset):
    cfg = _tiny_evoformer(preset)
    report = run.run_forward(cfg)
    rows = 8 if cfg.module == "triangle_attention" else 3
    act = next(iter(report["input_shapes"].values()))
    assert act == [rows, 8, cfg.data.q_channels]
    assert report["output_shape"] == act  # the update has the input's shape
    assert report["output_checksum"]["finite"] and report["output_checksum"]["abs_sum"] > 0


def test_evoformer_presets_carry_af2_shapes():
    shapes = {
        p: (c.module, c.attention.orientation, c.attention.num_head, c.data.q_channels)
        for p, c in ((p, _load("evoformer.py", p)) for p in EVOFORMER_PRESETS)
    }
    assert shapes == {
        "msa_row": ("msa_row_attention_with_pair_bias", "per_row", 8, 256),
        "msa_column": ("msa_column_attention", "per_column", 8, 256),
        "msa_column_global": ("msa_column_global_attention", "per_column", 8, 64),
        "triangle_start": ("triangle_attention", "per_row", 4, 128),
        "triangle_end": ("triangle_attention", "per_column", 4, 128),
    }
    assert _load("evoformer.py", "msa_row").data.pair_channels == 128
    with pytest.raises(
        ValueError, match=r"config.attention.orientation must be one of \('per_column',\)"
    ):
        cfg = _load("evoformer.py", "msa_column")
        cfg.attention.orientation = "per_row"
        schema.check_experiment(cfg)


def _synthetic_checkpoint(path, cfg, layers=2):
    """cfg's module params under AF2's Evoformer prefix, `layers` stacked blocks of random values."""
    problem = run.build(cfg)
    shapes = jax.eval_shape(problem.forward.init, jax.random.PRNGKey(0), *problem.inputs)
    rng = np.random.default_rng(0)
    stacked = jax.tree.map(
        lambda s: rng.normal(0, 0.2, size=(layers, *s.shape)).astype(np.float32), shapes
    )
    params_lib.save_af2_params(stacked, path, prefix=EVO)
    return path


def test_run_forward_script_with_af2_params(tmp_path):
    cfg = _tiny_evoformer("triangle_end")
    ckpt = _synthetic_checkpoint(tmp_path / "params_model_1.npz", cfg)
    out = tmp_path / "report.json"
    result = _run_script(
        f"--config={ROOT / 'configs' / 'evoformer.py'}:triangle_end",
        "--config.data.num_queries=8",
        "--config.run.steps=1",
        f"--params={ckpt}",
        f"--params_prefix={EVO}",
        "--layer=1",
        f"--output_json={out}",
        "--verbosity=1",  # the library's choices (logged at DEBUG, silent otherwise)
        platforms=None,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if not environment.accelerator_present():
        for noise in ("Traceback", "plugin configuration error", "Unable to initialize backend"):
            assert noise not in result.stderr, result.stderr[-3000:]
        assert "backend: cpu" in result.stdout
    report = json.loads(out.read_text())
    assert report["params"] == dict(path=str(ckpt), prefix=EVO, layer=1)
    # The same forward in-process with block 1's params (block 0's give another output).
    sums = [
        run.run_forward(cfg, params=run.load_params(cfg, ckpt, prefix=EVO, layer=layer))[
            "output_checksum"
        ]["sum"]
        for layer in (0, 1)
    ]
    np.testing.assert_allclose(report["output_checksum"]["sum"], sums[1], rtol=1e-5)
    assert abs(sums[0] - sums[1]) > 1e-3


def test_load_params_reports_a_missing_module_and_mis_shaped_params(tmp_path):
    cfg = _tiny_evoformer("triangle_end")
    ckpt = _synthetic_checkpoint(tmp_path / "params.npz", cfg)
    with pytest.raises(
        ValueError, match=r"no params of module 'msa_column_attention'.*scopes found"
    ):
        run.load_params(_tiny_evoformer("msa_column"), ckpt, prefix=EVO, layer=0)
    cfg.attention.num_head = 8  # feat_2d_weights [c_z, 8] expected, the file has [c_z, 4]
    with pytest.raises(
        ValueError, match=r"mis-shaped.*feat_2d_weights: shape \(128, 4\), expected \(128, 8\)"
    ):
        run.load_params(cfg, ckpt, prefix=EVO, layer=0)


def test_run_forward_rejects_layer_without_params():
    result = _run_script("--layer=3")
    assert result.returncode != 0
    assert "--params_prefix and --layer need --params" in result.stderr


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_missing_platform_is_one_line_with_the_install_command(platform):
    if jax.default_backend() == platform:
        pytest.skip(f"{platform} present")
    problem = run.platform_problem(platform)
    assert problem is not None and "\n" not in problem
    assert problem.startswith(f"--platform={platform}: JAX finds no {platform} here")
    assert f"pip install -U 'jax[{'cuda12' if platform == 'gpu' else 'tpu'}]'" in problem
    assert run.platform_problem("cpu") is None
