"""Test-wide settings: 8 virtual CPU devices (for the multi-device tests; single-device tests run on
the first), float64 available (the reference and float64 inputs need it), hypothesis."""

import importlib.metadata
import os

from gated_attention_tools import environment


def _add_xla_flag(flag: str, value: str) -> None:
    if flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}={value}".strip()


# The CPU alone where no GPU or TPU is, as the scripts start (no CUDA or libtpu traceback from the
# targets extra's plugins, which stay registered for the deviceless compiles); children inherit.
environment.cpu_unless_accelerator()
# Before jax is imported (XLA reads XLA_FLAGS once, at backend start-up; child processes inherit).
_add_xla_flag("--xla_force_host_platform_device_count", "8")
# On a GPU each pytest-xdist worker is a process of its own: none may take 75 % of the memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# jaxlib 0.10 (the Python 3.11 stack): XLA:CPU's legacy fusion emitter, whose compiles take ~20 %
# less of this suite's time (compiling is most of it: 270 s against 305-339 s cold, 2 cores). Results
# are HLO's either way; XLA's current emitter is what the Python 3.12 stack's jaxlib (0.12: no such
# flag, an unknown one is fatal) compiles every test with, and what users and the benchmarks run.
# And LLVM at -O0 for its code (in this process only, below: ptxas reads the level too, and the
# children that compile for GPUs must compile as users do): compiling small programs is most of
# the suite's time, running them little. Cold, 2 cores: the Python 3.12 stack's pytest 352 s at
# XLA's -O3 against 271 s; 3.11's ~290 s at -O1 against 230 s. LLVM's level leaves HLO's passes
# (fusion, buffers) as users get them. The float64 reference's programs compile at XLA's own level
# (helpers.jit_reference): at -O0 XLA:CPU computes its gradient wrong.
_jaxlib = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
# On a machine with a GPU or TPU (the device tests) its kernels compile as users get them.
_PROCESS_ONLY = "" if environment.accelerator_present() else "--xla_backend_optimization_level=0"
if _jaxlib < (0, 11):
    _add_xla_flag("--xla_cpu_use_fusion_emitters", "false")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_PROCESS_ONLY}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_enable_x64", True)
# One compilation cache for both pytest-xdist workers: the float64 reference programs and the
# harness's programs of a shape are compiled once, not once per worker (compile time is the cost).
jax.config.update(
    "jax_compilation_cache_dir", os.path.join(os.path.dirname(__file__), ".jax_cache")
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.devices()  # the backend starts now, with the flags above; then the children's flags
if _PROCESS_ONLY:
    os.environ["XLA_FLAGS"] = os.environ["XLA_FLAGS"].replace(_PROCESS_ONLY, "").strip()

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")


@pytest.fixture
def cudnn_loadable(monkeypatch):
    """cuDNN's library as on a GPU machine, for tests of choices made for a GPU from this host
    (gated_attention.core.compat.cudnn_version; the CUDA plugin alone has none)."""
    from gated_attention.core import compat

    monkeypatch.setattr(compat, "cudnn_version", lambda: 91000)


# The longest tests, by node id prefix (every test it names moves as one unit: a module fixture
# stays on one worker), with their seconds on 2 cores (Python 3.12's cold run of 2026-11-28, 3
# workers, divided by 1.5 for the third worker's share of the cores). They run first, dealt over
# the workers largest first: in the collection's order one of them could start last and run
# alone while the other workers idle.
LONG_TESTS = {
    "tests/af2/test_colabdesign.py::test_binder_multimer_as_bindcraft_runs_it_float32_and_bfloat16": 60,
    "tests/af2/test_colabdesign.py::test_design_step_matches_colabdesigns_own_attention[hallucination_multimer]": 40,
    "tests/af2/test_colabdesign.py::test_design_step_matches_colabdesigns_own_attention[binder]": 30,
    "tests/af2/test_colabdesign.py::test_hallucination_matches_and_a_one_percent_logit_error_fails": 30,
    "tests/af2/test_colabdesign.py::test_design_step_matches_colabdesigns_own_attention[fixbb]": 25,
    "tests/test_docs.py::test_python_blocks_run": 48,
    "tests/attention/test_pallas_mosaic_gpu.py::TestMosaicInterpreted::test_reference_and_mask_contract": 37,
    "tests/tools/test_targets.py::test_auto_chooses_for_the_target_not_the_host": 30,
    "tests/af2/test_af2_package.py::test_whole_model": 30,
    "tests/attention/test_pallas_mosaic_tpu.py::TestPallasTpuInterpreted::test_reference_and_mask_contract": 20,
    "tests/parallel/test_row_parallel.py::test_two_processes_match_one": 19,
    "tests/test_docs.py::test_alphafold3_block_runs": 19,
    "tests/tools/test_module_passes.py::test_the_modules_compile_for_a_gpu_as_one_call": 17,
    "tests/attention/test_kernel_compiles.py::test_mosaic_kernels_compile_for_hopper_without_spills_on_wgmma": 17,
    "tests/attention/test_conformance.py::test_matches_jax_nn_or_the_reference[mosaic-float32]": 16,
    "tests/tools/test_targets.py::test_tpu_kernels_compile_within_vmem": 16,
    "tests/tools/test_benchmarking.py::test_benchmark_script_smoke": 14,
    "tests/attention/test_pallas_triton.py::TestPallasInterpreted::test_reference_and_mask_contract": 13,
    "tests/tools/test_device_check.py::test_device_check_runs_end_to_end_on_cpu": 13,
    "tests/attention/test_pallas_mosaic_gpu.py::test_several_uneven_tiles_against_the_reference": 12,
    "tests/attention/test_conformance.py::test_matches_jax_nn_or_the_reference[chunked-float32]": 11,
    "tests/attention/test_kernel_compiles.py::test_kernels_compile_without_spills_and_use_the_tensor_cores": 10,
    "tests/attention/test_pallas_mosaic_gpu.py::test_half_precision_against_the_reference": 10,
    "tests/parallel/test_ring.py::test_af2_extra_msa_evoformer_on_the_grid_through_the_swap": 9,
    "tests/tools/test_sweep.py::test_the_smoke_run_writes_results_and_the_table": 8,
    "tests/attention/test_pallas_mosaic_tpu.py::test_bfloat16_against_the_reference": 8,
    "tests/parallel/test_row_parallel.py::test_each_device_computes_its_own_rows": 8,
}


def pytest_collection_modifyitems(config, items):
    """In each pytest-xdist worker (all order alike): LONG_TESTS first in each worker's share of
    the collection (the work-stealing scheduler hands worker i the i-th contiguous share, then
    moves the tails of queues), the rest in their order."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers < 2:
        return
    units, rest = {}, []
    for item in items:
        prefix = next((p for p in LONG_TESTS if item.nodeid.startswith(p)), None)
        (units.setdefault(prefix, []) if prefix else rest).append(item)
    bins = [[0, []] for _ in range(workers)]
    for prefix in sorted(units, key=LONG_TESTS.get, reverse=True):
        lightest = min(bins, key=lambda b: b[0])
        lightest[0] += LONG_TESTS[prefix]
        lightest[1].extend(units[prefix])
    ordered, remaining = [], len(items)
    for i, (_, long_items) in enumerate(bins):
        share = remaining // (workers - i)  # the scheduler's first split (xdist's worksteal)
        if len(long_items) > share:
            return  # a tiny selection: keep the collection's order
        take = share - len(long_items)
        ordered += long_items + rest[:take]
        rest, remaining = rest[take:], remaining - share
    items[:] = ordered + rest
