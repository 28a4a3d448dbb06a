"""Benchmark sweep for scripts/benchmark.py: AF2-sized goal shapes, a length sweep, memory cases.

  python scripts/benchmark.py                                   # everything below (~40 min on 2 cores)
  python scripts/benchmark.py --config=configs/benchmark.py:quick   # goal shapes, float32 forward only
  python scripts/benchmark.py --config=configs/benchmark.py:smoke   # ~1 min on 2 cores (see below)
  python scripts/benchmark.py --config.rounds=3 --config.dtypes='("float32",)'
  python scripts/benchmark.py --config=configs/benchmark.py:device  # a GPU/TPU, ~5 min: the issue shapes
  python scripts/benchmark.py --config=configs/benchmark.py:gpu     # on a GPU: every shape below
  python scripts/benchmark.py --config=configs/benchmark.py:peers   # a GPU: AF2's shapes, every peer
  python scripts/benchmark.py --config=configs/benchmark.py:sweep   # a GPU: every tuning candidate
  python scripts/benchmark.py --config=configs/benchmark.py:family  # AF2's modules and Evoformer
  python scripts/benchmark.py --config=configs/benchmark.py:family_remat  # training: save or recompute
  python scripts/benchmark.py --config=configs/benchmark.py:device_memory  # compiled for H100/v5e
  python scripts/benchmark.py --config=configs/benchmark.py:mesh_memory    # rows over 8 devices
  python scripts/benchmark.py --config=configs/benchmark.py:context_memory # keys over 8 devices
  python scripts/benchmark.py --config=configs/benchmark.py:options # causal time, GQA memory

Each writes results.json (raw numbers), results.md (the tables, times in ms to three significant
figures) and the suite's pictures to --config.output_dir (default: the preset's folder under
benchmark_results/; the folders a documented run fills that hold no committed results are in
.gitignore) and prints the paths it wrote.

The *_smoke presets (smoke, family_smoke, options_smoke, device_smoke, device_memory_smoke, ...)
check that a suite runs end to end, not how fast anything is: tiny shapes, one round, goals of
100x AF2's time and a baseline check within 11x (SMOKE_GOAL, SMOKE_TOLERANCE), written to a fresh
temporary folder unless --config.output_dir names one. `smoke` runs three cells (a tiny attention,
a 32-token sweep point and a 16-residue TriangleAttention, float32 forward), each in two fresh
processes (ours beside AF2, then AF2 alone): about a minute on 2 CPU cores (31 s and 54 s in two
runs on a shared machine).

Shapes are (name, batch, length, channels, num_head, nonbatched_bias, mask[, module]).
"""

import ml_collections

# The smoke presets' goals and baseline check, loose on purpose: at their tiny shapes and one round
# the times are noise (a cell can run 3x AF2's time, or AF2 in the harness 2x its time alone), so
# they pass whenever the harness works and fail only when it does not.
SMOKE_GOAL = 100.0  # ours / AF2 at most
SMOKE_TOLERANCE = 10.0  # AF2 in the harness within 11x of AF2 alone

GOAL_SHAPES = (
    # MSA row attention: 64 sequences x 256 residues, c=64, 8 heads of 8, pair bias.
    ("msa_row 64x256 c64 h8", 64, 256, 64, 8, True, "key"),
    # Triangle attention: 128 x 128 residues, c=128, 4 heads of 32, pair bias.
    ("triangle 128x128 c128 h4", 128, 128, 128, 4, True, "key"),
    # Long self-attention: 1 x 4,096 tokens, c=256, 8 heads of 32, key mask.
    ("long 1x4096 c256 h8", 1, 4096, 256, 8, False, "key"),
)
# Forward goals: Attention's time ('auto') / AF2's Attention's (alphafold-colabfold), at most, in
# every dtype swept.
GOALS = (
    ("msa_row 64x256 c64 h8", 0.12),
    ("triangle 128x128 c128 h4", 0.30),
    ("long 1x4096 c256 h8", 0.22),
)
# The family module TriangleAttention (starting node, c_z=128, 4 heads) at N_res 256 and 512.
TRIANGLE_SHAPES = (
    ("TriangleAttention 256", 256, 256, 128, 4, True, "key", "triangle_attention"),
    ("TriangleAttention 512", 512, 512, 128, 4, True, "key", "triangle_attention"),
)
SWEEP_LENGTHS = (512, 1024, 2048, 4096)  # self-attention 1 x L, c=256, 8 heads of 32: the plot


# The device presets' shapes (device_benchmark.OpShape): q, k, v [batch, length, heads, head dim],
# a bias shared over the batch, a key mask; the module level projects from [batch, length,
# heads * head dim]. The device preset's, in priority order (a time budget cuts from the end):
DEVICE_SHAPES = (
    ("msa_row 512x384 h8x32", 512, 384, 8, 32),  # MSA row attention with pair bias
    ("triangle 1024 h4x32", 1024, 1024, 4, 32),  # triangle attention at N_res 1,024
    ("triangle 512 h4x32", 512, 512, 4, 32),
    ("long 1x16384 h8x32", 1, 16384, 8, 32),  # one sequence of 16,384 tokens, shared bias
)
_OURS = ("auto", "mosaic", "pallas", "cudnn", "xla", "chunked", "pallas_tpu")
DEVICE_VARIANTS = (*_OURS, "jax_nn_xla", "jax_nn_cudnn", "af2_colabfold", "ours", "af2")
# (level, shape, dtype, mode, variant, against, largest ratio): ours ('auto') against jax.nn;
# the Mosaic GPU kernel against the Triton one and cuDNN (issue 37).
DEVICE_GOALS = (
    tuple(
        ("op", shape, "bfloat16", "forward_backward", "auto", against, limit)
        for shape in ("msa_row 512x384 h8x32", "triangle 1024 h4x32")
        for against, limit in (("jax_nn_cudnn", 1.0), ("jax_nn_xla", 0.5))
    )
    + tuple(("op", s[0], "float32", "forward", "auto", "jax_nn_xla", 0.7) for s in DEVICE_SHAPES)
    + tuple(
        ("op", shape, "bfloat16", "forward_backward", "mosaic", against, 1.0)
        for shape in ("msa_row 512x384 h8x32", "triangle 1024 h4x32")
        for against in ("pallas", "jax_nn_cudnn")
    )
)
# The peers preset's: AF2's attention shapes (model_1, N_res 384 unless named), ours against every
# peer a user would pick (issue 44); q, k, v [rows, length, heads, head dim] as in DEVICE_SHAPES.
PEER_SHAPES = (
    ("msa_row 512x384 h8x32", 512, 384, 8, 32),  # MSA row with pair bias (512 clusters)
    ("triangle 1024 h4x32", 1024, 1024, 4, 32),  # triangle attention at N_res 1,024
    ("extra_msa 1024x384 h8x8", 1024, 384, 8, 8),  # extra-MSA row: c_e 64 in 8 heads of 8
    ("msa_column 384x512 h8x32", 384, 512, 8, 32, False),  # down the 512 sequences, no bias
    ("triangle 512 h4x32", 512, 512, 4, 32),
    ("triangle 2048 h4x32", 2048, 2048, 4, 32),
    ("template 384 h4x16", 384, 384, 4, 16),  # the template pair stack's triangle: c_t 64
    ("long 1x16384 h8x32", 1, 16384, 8, 32),  # one sequence of 16,384 tokens, shared bias
)
PEER_VARIANTS = (
    "auto", "mosaic", "pallas", "packed", "jax_nn_xla", "jax_nn_cudnn", "af2_colabfold",
    "af2_colabfold_packed", "tokamax_mosaic", "tokamax_triton", "tokamax_cudnn",
    "tokamax_xla_chunked", "cuequivariance",
)  # fmt: skip
# The peers the sweep times beside ours: gated_attention.attention.dispatch.PEERS, spelled out (a
# config imports no JAX; tests/tools/test_sweep.py checks they agree).
PEERS = (
    "tokamax_mosaic", "tokamax_triton", "tokamax_cudnn", "tokamax_xla_chunked", "tokamax_xla",
    "colabfold", "colabfold_packed",
)  # fmt: skip
# The sweep preset's (gated_attention_tools/sweep.py): AF2's attention cells (model_1, N_res 384
# unless named), in priority order (a time budget cuts from the end), as in PEER_SHAPES.
SWEEP_SHAPES = (
    ("msa_row 512x384 h8x32", 512, 384, 8, 32),  # MSA row with pair bias (512 clusters)
    ("triangle 1024 h4x32", 1024, 1024, 4, 32),
    ("triangle 512 h4x32", 512, 512, 4, 32),
    # The extra MSA stack's row attention (c_e 64 in 8 heads of 8) over the 5,120 extra sequences
    # model_1 to model_5 take at inference (their data.common.max_extra_msa; training crops 1,024).
    ("extra_msa 5120x384 h8x8", 5120, 384, 8, 8),
    ("msa_column 384x512 h8x32", 384, 512, 8, 32, False),  # down the 512 sequences, no bias
    ("template 384 h4x16", 384, 384, 4, 16),  # the template pair stack's triangle: c_t 64
    ("triangle 2048 h4x32", 2048, 2048, 4, 32),  # last: the longest to compile and run
)
# The gpu preset's, a longer sweep:
GPU_SHAPES = (
    ("msa_row 512x384 h8x32", 512, 384, 8, 32),  # MSA row attention with pair bias
    ("extra_msa 1024x384 h8x8", 1024, 384, 8, 8),  # extra MSA row attention (training crop)
    ("triangle 384 h4x32", 384, 384, 4, 32),  # triangle attention at N_res 384
    ("triangle 768 h4x32", 768, 768, 4, 32),
    ("triangle 1024 h4x32", 1024, 1024, 4, 32),
    ("long 1x16384 h8x32", 1, 16384, 8, 32),  # one long sequence, shared bias
)

# The family suite (gated_attention_tools/family_benchmark.py): AF2's own modules and
# EvoformerIteration (alphafold-colabfold, model_1's configs) against them with our attention.
# (what, N_seq, N_res): MSA 128 x 256 residues, extra MSA 1,024 x 256, pair 256^2; a block at
# N_seq 128, N_res 128; AF2's whole monomer model (float32 inference, templates and the extra MSA on:
# 32 clusters, 128 extra rows, 4 templates, 1 recycle) at N_res 96.
FAMILY_SHAPES = (
    ("msa_row", 128, 256),
    ("msa_column", 128, 256),
    ("msa_column_global", 1024, 256),
    ("triangle_start", 1, 256),
    ("triangle_end", 1, 256),
    ("evoformer", 128, 128),
    ("model", 32, 96),
)
# The family_gpu preset's: model_1 at N_res 384 (512 clusters, 1,024 extra rows) and the
# Evoformer at 1,024, each in bfloat16 as AF2 runs on a GPU.
FAMILY_GPU_SHAPES = (
    ("evoformer", 512, 384),
    ("msa_row", 512, 384),
    ("triangle_start", 1, 384),
    ("msa_column_global", 1024, 384),
    ("evoformer", 512, 1024),
    ("model", 512, 384),
)
_INFERENCE_GOALS = dict(evoformer=0.62, model=0.70)
_TRAINING_GOALS = dict(evoformer=0.75)
FAMILY_GOALS = tuple(
    ("time", what, mode, "float32", goals.get(what, default))
    for what, _, _ in FAMILY_SHAPES
    for mode, goals, default in (
        ("inference", _INFERENCE_GOALS, 0.50),
        ("training", _TRAINING_GOALS, 0.60),
    )
    if what != "model" or mode == "inference"
) + (
    ("memory", "triangle_start", 1, 512, 600),
    ("memory", "triangle_start", 1, 1024, 2048),
    ("memory", "msa_row", 128, 384, 512),
)
# Training-step memory against the crop: (what, N_seq, N_res, variants). AF2's is compiled (XLA
# temp) at every size, but run (resident memory) only up to FAMILY_RESIDENT_MAX_N_RES.
FAMILY_MEMORY_SCALING = tuple(
    ("triangle_start", 1, n, ("ours", "af2")) for n in (256, 512, 768, 1024, 1536, 2048)
) + tuple(("msa_row", 128, n, ("ours", "af2")) for n in (256, 384, 512, 1024))
FAMILY_RESIDENT_MAX_N_RES = dict(ours=1024, af2=512)

PRESETS = (
    "full",
    "quick",
    "smoke",
    "device",
    "device_smoke",
    "gpu",
    "peers",
    "sweep",
    "sweep_smoke",
    "family",
    "family_smoke",
    "family_remat",
    "family_gpu",
    "device_memory",
    "device_memory_smoke",
    "options",
    "options_smoke",
    "mesh_memory",
    "mesh_memory_smoke",
    "context_memory",
    "context_memory_smoke",
    "design_memory",
    "design_time",
    "design_smoke",
)


def get_config(preset="full"):
    if preset not in PRESETS:
        raise ValueError(f"configs/benchmark.py preset must be one of {PRESETS}, got {preset!r}")
    cfg = _config(preset)
    # A *_smoke preset checks that its suite runs end to end; scripts/benchmark.py says so in its
    # output. Its output_dir "" is a fresh temporary folder (the script prints its path).
    cfg.smoke = preset.endswith("smoke")
    return cfg


def _config(preset):
    if preset in ("sweep", "sweep_smoke"):
        return _sweep_config(preset)
    if preset in ("device", "device_smoke", "gpu", "peers"):
        return _device_config(preset)
    if preset in ("family", "family_smoke", "family_remat", "family_gpu"):
        return _family_config(preset)
    if preset.removesuffix("_smoke") in COMPILE_MEMORY:
        return _compile_memory_config(preset)
    if preset in ("options", "options_smoke"):
        return _options_config(preset)
    if preset.startswith("design"):
        return _design_config(preset)
    if preset == "smoke":  # tiny shapes: checks that the script runs end to end (module docstring)
        cfg = _config("full")
        cfg.shapes = (("tiny 2x32 c16 h2", 2, 32, 16, 2, True, "key"),)
        cfg.goals = (("tiny 2x32 c16 h2", SMOKE_GOAL),)
        cfg.sweep_lengths = (32,)  # one length: the picture is drawn
        cfg.dtypes, cfg.modes = ("float32",), ("forward",)
        cfg.rounds, cfg.steps, cfg.memory_cases = 1, 1, False
        cfg.triangle_shapes = (
            ("TriangleAttention 16", 16, 16, 8, 2, True, "key", "triangle_attention"),
        )
        cfg.baseline_tolerance = SMOKE_TOLERANCE
        cfg.output_dir = ""
        return cfg
    cfg = ml_collections.ConfigDict()
    cfg.suite = "modules"  # Attention against AF2's own Attention (gated_attention_tools.benchmark)
    cfg.shapes = GOAL_SHAPES
    cfg.goals = GOALS  # (shape name, largest forward ratio to AF2): a table above the results
    cfg.sweep_lengths = SWEEP_LENGTHS if preset == "full" else ()
    cfg.implementations = ("auto", "xla", "chunked")  # 'cudnn' joins on GPU via 'auto'
    cfg.dtypes = ("float32", "bfloat16") if preset == "full" else ("float32",)
    cfg.modes = ("forward", "forward_backward") if preset == "full" else ("forward",)
    cfg.rounds = 5  # interleaved rounds; the reported time is the median over rounds
    cfg.steps = 3  # calls per round per variant; a round keeps their median
    # Op-level memory (XLA temp and resident) at 16k tokens and a 1024^2 triangle.
    cfg.memory_cases = preset == "full"
    # Float32 forward only: forward+backward at 512 takes minutes per call of AF2's module on
    # 2 CPU cores.
    cfg.triangle_shapes = TRIANGLE_SHAPES if preset == "full" else ()
    cfg.output_dir = "benchmark_results"
    cfg.allocator = "steady"  # malloc policy of every child (measure.ALLOCATOR_POLICIES)
    cfg.baseline_tolerance = 0.10  # AF2 in the harness against AF2 alone: flagged beyond this
    return cfg


def _device_config(preset):
    """The op and the Attention module on a GPU or TPU against jax.nn (XLA and cuDNN), ColabFold's
    kernels and AF2's Attention as installed (device_benchmark.py); scripts/device_check.py runs the
    device preset after the device tests."""
    cfg = ml_collections.ConfigDict()
    cfg.suite = "device"
    cfg.levels = ("op", "module")
    cfg.op_shapes = DEVICE_SHAPES
    cfg.variants = DEVICE_VARIANTS
    cfg.goals = DEVICE_GOALS
    cfg.dtypes = ("bfloat16", "float32")
    cfg.modes = ("forward_backward", "forward")
    cfg.rounds = 3  # interleaved; the time is the median over rounds
    cfg.steps = 3  # calls per round per variant; a round keeps their median
    cfg.device_memory = True  # each call's peak memory, in fresh processes
    cfg.memory_share = 0.25  # of a time budget, kept for the peak memory after the timed cells
    cfg.time_budget_s = 300.0  # no cell starts past it (0: no budget)
    cfg.compile_workers = 8  # threads compiling a cell's variants
    cfg.interpret_pallas = False  # run the Pallas kernels interpreted (CPU smoke runs)
    # Shared by the timing process and the peak-memory children: they load, not recompile.
    cfg.compilation_cache_dir = "/tmp/gated_attention_device_jax_cache"
    cfg.output_dir = "benchmark_results/device"
    if preset == "peers":  # the op at AF2's shapes against every peer, within a device call
        cfg.levels = ("op",)
        cfg.op_shapes = PEER_SHAPES
        cfg.variants = PEER_VARIANTS
        cfg.goals = ()
        cfg.dtypes = ("bfloat16",)
        cfg.output_dir = "benchmark_results/device/peers"
    if preset == "gpu":  # every GPU shape, the peers too, no budget
        cfg.op_shapes = GPU_SHAPES
        cfg.variants = DEVICE_VARIANTS + tuple(v for v in PEER_VARIANTS if v not in DEVICE_VARIANTS)
        cfg.goals = DEVICE_GOALS[:4]
        cfg.rounds = cfg.steps = 5
        cfg.time_budget_s = 0.0
        cfg.output_dir = "benchmark_results/gpu"
    if (
        preset == "device_smoke"
    ):  # on CPU, about a minute (kernels interpreted): checks the pipeline
        cfg.op_shapes = (("tiny 2x32 h2x16", 2, 32, 2, 16),)
        cfg.goals = (
            (
                "op",
                "tiny 2x32 h2x16",
                "float32",
                "forward_backward",
                "auto",
                "jax_nn_xla",
                SMOKE_GOAL,
            ),
        )
        cfg.dtypes = ("float32",)
        cfg.rounds, cfg.steps = 1, 1
        cfg.compile_workers = 2
        cfg.interpret_pallas = True
        cfg.time_budget_s = 0.0
        cfg.output_dir = ""
    return cfg


def _sweep_config(preset):
    """Every tuning candidate the GPU takes at AF2's cells (sweep.py), within 5 minutes on an
    H100 (benchmark_results/device/README.md: the estimate); its table is tuning.json's entries
    for that device. scripts/device_check.py --preset=sweep runs it."""
    cfg = ml_collections.ConfigDict()
    cfg.suite = "sweep"
    cfg.op_shapes = SWEEP_SHAPES
    cfg.dtypes = ("bfloat16", "float32")  # in priority order: AF2 runs bfloat16 on a GPU
    cfg.modes = ("forward_backward", "forward")
    # Whose candidates are timed: ours, then the peers behind our contract (tokamax's and
    # ColabFold's kernels, gated_attention/attention/peers.py; a row with the reason where absent).
    cfg.implementations = ("mosaic", "pallas", "cudnn", "xla", *PEERS)
    cfg.candidates_per_implementation = 0  # the first that many of each (0: every one)
    # Candidates left out by name or field, e.g. ('c2',): the two-consumer Mosaic forwards until
    # a device's tests have run them (a kernel that hangs a GPU would take the sweep with it).
    cfg.skip = ()
    cfg.capability = ""  # the GPU's compute capability the candidates are for ('': the device's)
    cfg.rounds = 3  # interleaved; the time is the median over rounds
    cfg.steps = 2  # calls per round per candidate; a round keeps their median
    cfg.long_call_s = 0.05  # a candidate whose first call took longer: one call a round
    # Largest difference from the float32 reference a candidate may have (above: inaccurate, out
    # of the table): 5-10x what the H100 run's kernels had (benchmark_results/device/h100).
    cfg.tolerance = dict(bfloat16=0.05, float32=0.01)
    cfg.time_budget_s = 240.0  # no cell starts past it (0: no budget)
    cfg.compile_workers = 12  # threads compiling a cell's candidates
    cfg.interpret_pallas = False  # run the Pallas kernels interpreted (CPU smoke runs)
    cfg.compilation_cache_dir = ""  # one process compiles each program once: no cache
    # The child's XLA flags. XLA's autotuning runs the dots of a program (the XLA candidate's,
    # the reference's, the XLA ops around the kernels) on the GPU while compiling it, which the
    # deviceless estimate cannot see and the sweep's budget cannot afford over 28 cells; the
    # Pallas kernels are not autotuned. So the XLA candidate runs XLA's default algorithms.
    cfg.xla_flags = "--xla_gpu_autotune_level=0"
    cfg.output_dir = "benchmark_results/device/sweep"
    if preset == "sweep_smoke":  # on CPU, seconds (kernels interpreted): checks the pipeline
        cfg.op_shapes = (("tiny 2x16 h1x16", 2, 16, 1, 16),)
        cfg.dtypes, cfg.modes = ("float32",), ("forward",)
        # tokamax's XLA paths run on CPU (where installed); its GPU kernels and ColabFold's are
        # rows with the reason (ColabFold's: not at float32).
        cfg.implementations = ("pallas", "xla", *PEERS)
        cfg.candidates_per_implementation = 2  # each interpreted kernel compiles for a second
        cfg.capability = "9.0"  # an H100's candidates
        cfg.rounds, cfg.steps = 1, 1
        cfg.compile_workers = 2
        cfg.interpret_pallas = True
        cfg.time_budget_s = 0.0
        cfg.xla_flags = ""
        cfg.output_dir = ""
    return cfg


def _family_config(preset):
    """AF2's attention modules and EvoformerIteration, as users run them (family_benchmark.py)."""
    cfg = ml_collections.ConfigDict()
    cfg.suite = "family"
    cfg.family_shapes = FAMILY_SHAPES
    cfg.goals = FAMILY_GOALS
    cfg.dtypes = ("float32", "bfloat16")
    cfg.modes = ("inference", "training")
    cfg.rounds = 5
    cfg.steps = 1
    cfg.memory_scaling = FAMILY_MEMORY_SCALING
    cfg.resident_max_n_res = FAMILY_RESIDENT_MAX_N_RES
    cfg.output_dir = "benchmark_results/family"
    cfg.allocator = "steady"  # malloc policy of every child (measure.ALLOCATOR_POLICIES)
    cfg.baseline_tolerance = 0.10  # AF2 in the harness against AF2 alone: flagged beyond this
    # Our modules' global_config.remat_policy in the training cells, one cell per policy.
    cfg.remat_policies = ("nothing",)
    # Our modules' global_config.memory_budget_mib, one cell per budget (None: the default). On a
    # GPU, e.g. (None, 256.0): the default (one call where the module fits 0.1 of the device's
    # memory) against the CPU's 256 MiB row tiles (time against memory).
    cfg.memory_budgets_mib = (None,)
    cfg.family_variants = ()  # (): each cell's own (AF2, ours, and the floor for blocks)
    cfg.model_dtype = "float32"  # the whole model's cell (AF2's monomer default)
    cfg.baseline_check = True  # AF2 timed alone in a fresh process, against its harness time
    # (what, n_seq, first N_res, limit, step): the longest N_res each variant runs (inference).
    cfg.longest = ()
    if preset == "family_remat":  # the training step with each policy: what saving buys on CPU
        cfg.family_shapes = tuple(s for s in FAMILY_SHAPES if s[0] not in ("evoformer", "model"))
        cfg.dtypes, cfg.modes = ("float32",), ("training",)
        cfg.remat_policies = ("nothing", "projections", "everything")
        cfg.goals, cfg.memory_scaling = (), ()
        cfg.output_dir = "benchmark_results/family_remat"
    if preset == "family_gpu":  # a GPU: AF2 plain, as ColabFold runs it, and each with ours
        cfg.family_shapes = FAMILY_GPU_SHAPES
        cfg.family_variants = ("af2", "colabfold", "ours", "ours_colabfold")
        cfg.model_dtype = "bfloat16"  # model_1's default: global_config.bfloat16
        cfg.dtypes, cfg.modes = ("bfloat16",), ("inference", "training")
        cfg.rounds, cfg.steps = 3, 3
        cfg.goals, cfg.memory_scaling = (), ()
        cfg.baseline_check = False  # no malloc policy on a device to check
        cfg.longest = (("evoformer", 512, 1024, 8192, 256),)
        cfg.output_dir = "benchmark_results/device/family"
    if preset == "family_smoke":  # 2-3 minutes on 2 CPU cores (142 s): checks the suite runs
        cfg.family_shapes = (("triangle_start", 1, 8), ("evoformer", 4, 8))
        cfg.goals = (("time", "triangle_start", "training", "float32", SMOKE_GOAL),) + (
            ("memory", "triangle_start", 1, 8, 1024),
        )
        cfg.dtypes, cfg.modes = ("float32",), ("inference", "training")
        cfg.rounds = 1
        cfg.memory_scaling = (("triangle_start", 1, 8, ("ours", "af2")),)
        cfg.resident_max_n_res = dict(ours=8)
        cfg.baseline_tolerance = SMOKE_TOLERANCE
        cfg.output_dir = ""
    return cfg


def _options_config(preset):
    """What jax.nn's arguments cost (options_benchmark.py): causal against full forward time at
    1 x 4,096 tokens (8 heads of 32), and grouped-query attention's memory, 8 query heads over 1."""
    cfg = ml_collections.ConfigDict()
    cfg.suite = "options"
    cfg.causal_shape = (4096, 8, 32)  # (tokens, heads, head dim), batch 1, no bias or mask
    cfg.implementations = ("chunked", "xla")
    cfg.goal_implementation = "chunked"  # the goals are about it; the others are context
    cfg.causal_goal = 0.55  # causal forward time / full, at most
    cfg.gqa_slack_mib = 0.0  # added to the GQA memory goal's bound (options_benchmark.gqa_goal)
    cfg.gqa_shape = (4096, 8, 32)  # (tokens, query heads, head dim) over 1 key/value head
    cfg.gqa_implementations = ("chunked", "xla")
    cfg.modes = ("forward", "training")
    cfg.dtypes = ("float32",)
    cfg.rounds = 7
    cfg.steps = 3
    cfg.output_dir = "benchmark_results/options"
    cfg.allocator = "steady"  # malloc policy of every child (measure.ALLOCATOR_POLICIES)
    cfg.baseline_tolerance = 0.10  # the full call in the harness against it alone
    if preset == "options_smoke":  # about a minute on 2 CPU cores (64 s): checks the suite runs
        cfg.causal_shape = cfg.gqa_shape = (64, 2, 8)
        cfg.rounds, cfg.steps = 1, 1
        cfg.causal_goal = SMOKE_GOAL
        cfg.gqa_slack_mib = 1024.0  # at 64 tokens the memory is the allocator's noise
        cfg.baseline_tolerance = SMOKE_TOLERANCE
        cfg.output_dir = ""
    return cfg


# The compile_memory suite's presets (compile_memory.py): preset -> (placement, results folder).
COMPILE_MEMORY = {
    "device_memory": ("one_device", "device_memory"),
    "mesh_memory": ("rows", "mesh_memory"),
    "context_memory": ("keys", "context_memory"),
}


def _compile_memory_config(preset):
    """Device memory compiled deviceless for GPU and TPU targets (compile_memory.py), nothing run;
    needs the targets extra (pip install -e '.[targets,bench]'). A preset measures one placement
    (COMPILE_MEMORY), configured by cfg.<placement>_cells; --config.placements may name several
    (a _smoke preset's cells are all small)."""
    smoke = preset.endswith("_smoke")
    placement, folder = COMPILE_MEMORY[preset.removesuffix("_smoke")]
    cfg = ml_collections.ConfigDict()
    cfg.suite = "compile_memory"
    cfg.placements = (placement,)
    cfg.one_device_cells = _one_device_cells(smoke)
    cfg.rows_cells = _rows_cells(smoke)
    cfg.keys_cells = _keys_cells(smoke)
    cfg.output_dir = "" if smoke else f"benchmark_results/{folder}"
    return cfg


def _one_device_cells(smoke):
    """One device: AF2's family compiled for an H100 and a TPU v5e, crops growing until a program
    no longer fits."""
    cfg = ml_collections.ConfigDict()
    cfg.targets = ("h100", "v5e")
    cfg.whats = ("triangle_start", "msa_row", "msa_column", "msa_column_global", "evoformer")
    cfg.crops = (256, 512, 1024, 2048, 3072, 4096, 6144, 8192)
    cfg.msa_rows = 512
    cfg.extra_msa_rows = 1024
    cfg.dtypes = ("bfloat16", "float32")
    cfg.modes = ("training", "inference")
    # Our implementations compiled by name as well as 'auto', per platform kind.
    cfg.implementations = ml_collections.ConfigDict(dict(gpu=("chunked",), tpu=("chunked",)))
    if smoke:  # about a minute on 2 CPU cores (device_memory_smoke: 48 s): checks the suite runs
        cfg.targets = ("v5e",)
        cfg.whats = ("triangle_start",)
        cfg.crops = (16, 32)
        cfg.msa_rows, cfg.extra_msa_rows = 4, 8
        cfg.dtypes, cfg.modes = ("bfloat16",), ("training",)
        cfg.implementations = ml_collections.ConfigDict(dict(gpu=(), tpu=()))
    return cfg


def _rows_cells(smoke):
    """Rows over a mesh: the family modules compiled for 8 H100s and a TPU v5p slice of 8 chips,
    per-device memory and collectives against one device's peak / 8."""
    cfg = ml_collections.ConfigDict()
    cfg.targets = ("h100", "v5p")
    cfg.devices = 8
    cfg.whats = ("triangle_start", "triangle_end", "msa_row", "msa_column", "msa_column_global")
    # (what, (N_seq, N_res)): the crops the issue measured at (model_1's channels).
    cfg.crops = (
        ("triangle_start", (1, 2048)),
        ("triangle_end", (1, 2048)),
        ("msa_row", (512, 1024)),
        ("msa_column", (512, 1024)),
        ("msa_column_global", (1024, 1024)),
    )
    cfg.dtypes = ("bfloat16",)
    cfg.modes = ("training", "inference")
    cfg.variants = ("ours", "af2")
    cfg.styles = ("auto", "explicit")
    # Ours' global_config.memory_budget_mib (None: the default): each device keeps a working set
    # of that order whatever its share of the rows, so small shares are measured at 64 too.
    cfg.memory_budget_mib = ml_collections.config_dict.placeholder(float)
    if smoke:  # about a minute on 2 CPU cores (device_memory_smoke: 48 s): checks the suite runs
        cfg.targets, cfg.whats = ("h100",), ("triangle_end",)
        cfg.crops = (("triangle_end", (1, 64)),)
        cfg.modes, cfg.variants, cfg.styles = ("training",), ("ours",), ("auto",)
    return cfg


def _keys_cells(smoke):
    """Keys over a mesh (context parallelism): the op with its query and key positions split over
    8 H100s and a TPU v5p slice of 8 chips, per-device memory and collectives against one
    device's peak / 8; TriangleAttention with the pair, and MSA column global attention with the
    extra MSA, tiled over a grid of 64 devices."""
    cfg = ml_collections.ConfigDict()
    cfg.targets = ("h100", "v5p")
    cfg.devices = 8
    cfg.tokens = 16384
    cfg.heads, cfg.head_dim = 8, 64
    cfg.dtypes = ("bfloat16",)
    cfg.modes = ("training", "inference")
    cfg.causal = (False, True)
    cfg.key_bias = True  # a [B, 1, 1, S] bias: it travels with the keys
    cfg.variants = ("ring", "plain")
    # The modules on their input tiled over a grid of 64 devices: (mode, N_res) crops.
    cfg.grid_targets = ("h100", "v5p")
    cfg.grid = (8, 8)
    cfg.grid_whats = ("triangle_start", "triangle_end")
    cfg.grid_extra_msa_rows = 5120  # model_1's extra MSA: MSA column global attention's rows
    # The goals' crops and twice them (the longest that fits is reported).
    cfg.grid_crops = (
        ("training", 16384),
        ("training", 32768),
        ("inference", 32768),
        ("inference", 65536),
    )
    # (module, (mode, N_res), 'plain'): the same tiled pair left to XLA's partitioner, on H100s.
    cfg.grid_plain = (
        ("triangle_start", ("training", 16384), "plain"),
        ("triangle_end", ("inference", 32768), "plain"),
    )
    if smoke:  # about a minute on 2 CPU cores (device_memory_smoke: 48 s): checks the suite runs
        cfg.targets, cfg.tokens, cfg.modes, cfg.causal = ("h100",), 256, ("training",), (True,)
        cfg.variants = ("ring",)
        cfg.grid_targets, cfg.grid_whats = ("h100",), ("triangle_end",)
        cfg.grid_crops, cfg.grid_plain = (("training", 64),), ()
    return cfg


def _design_config(preset):
    """ColabDesign's design step with its own attention and with ours (design_benchmark.py):
    'design_memory' its memory compiled deviceless for GPUs (needs the targets and colabdesign
    extras, or test), 'design_time' its time on this CPU, 'design_smoke' one small compile and
    one small timed cell on one-block stacks (checks the suite runs)."""
    cfg = ml_collections.ConfigDict()
    cfg.suite = "design"
    own, ours = "colabdesign", "ours"
    # (target, case, variant, residues): the 1,024-residue goal on 80 GB, both protocols, and
    # each side of the longest that fits 80 GB (A100) and 24 GB (RTX 4090).
    cfg.memory_cells = (
        ("a100", "hallucination", own, 1024),
        ("a100", "hallucination", ours, 1024),
        ("a100", "binder_multimer", own, 1024),
        ("a100", "binder_multimer", ours, 1024),
        ("h100", "hallucination", own, 1024),
        ("h100", "hallucination", ours, 1024),
        ("a100", "hallucination", own, 896),
        ("a100", "hallucination", ours, 1792),
        ("a100", "hallucination", ours, 2048),
        ("rtx4090", "hallucination", own, 512),
        ("rtx4090", "hallucination", own, 640),
        ("rtx4090", "hallucination", ours, 896),
        ("rtx4090", "hallucination", ours, 1024),
    )
    cfg.longest_cells = ()  # (target, case, variant, start): a search, cfg.length_step apart
    cfg.length_step = 128
    cfg.blocks = None  # every stack's depth: None is AF2's (design_model.build); the smoke's 1
    # (case, residues): 5 full-depth compiles a cell (both variants, the baseline alone, each
    # variant's resident peak), about 10 minutes on 2 cores.
    cfg.time_cells = (("hallucination", 128),)
    cfg.dtypes = ("bfloat16",)  # ColabDesign's default
    cfg.rounds = 3
    cfg.allocator = "steady"  # malloc policy of every child (measure.ALLOCATOR_POLICIES)
    cfg.baseline_tolerance = 0.10  # ColabDesign's step in the harness against it alone
    if preset == "design_memory":
        cfg.time_cells, cfg.output_dir = (), "benchmark_results/design_memory"
    if preset == "design_time":
        cfg.memory_cells, cfg.output_dir = (), "benchmark_results/design_time"
    if preset == "design_smoke":  # checks the suite runs: one small compile, one small cell
        cfg.memory_cells = (("a100", "hallucination", ours, 16),)
        cfg.time_cells = (("hallucination", 16),)
        cfg.rounds, cfg.blocks = 1, 1
        cfg.baseline_tolerance = SMOKE_TOLERANCE
        cfg.output_dir = ""
    return cfg
