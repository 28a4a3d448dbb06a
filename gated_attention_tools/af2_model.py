"""AlphaFold 2's whole monomer model (the alphafold-colabfold package's model_1) as a user runs it:
features from the package's own data pipeline, RunModel's forward and recycling loop, with AF2's
attention ('af2'), ours swapped in by gated_attention.af2.af2_package ('ours'), or the five family
modules' updates zero ('floor': what the rest of the model costs).

    fns, params, batch = problem(n_res=64, n_seq=32, n_extra_seq=64, n_templates=2,
                                 num_recycle=1, dtype="float32")
    out_af2, out_ours = fns["af2"](params, batch), fns["ours"](params, batch)

Both variants take the same random parameters (non-zero everywhere: AF2's zero_init would make
every attention update zero) and the same processed features. What differs from RunModel.predict:
no float16 cast of the results (the raw output dict of the last recycle comes back, 'prev'
included, in float32) and no early stop (model_1's stop_at_score and tolerance never stop it).
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from gated_attention.af2 import af2_package

AF2, OURS, FLOOR = "af2", "ours", "floor"
# AF2 as ColabFold runs it on a GPU (global_config.use_pallas: its fused attention, transition,
# triangle multiplication and layer-norm kernels), as it is and with our attention swapped in.
COLABFOLD, OURS_COLABFOLD = "colabfold", "ours_colabfold"
VARIANTS = (AF2, OURS, FLOOR, COLABFOLD, OURS_COLABFOLD)
KERNELS = (COLABFOLD, OURS_COLABFOLD)  # the variants with ColabFold's kernels on


def colabfold_kernels(global_config) -> None:
    """Turns ColabFold's kernels on in AF2's global config, as ColabFold does on a GPU
    (colabfold_kernels.device.dispatch('auto'): use_pallas, the kernel backend for this GPU)."""
    from colabfold_kernels import device

    with global_config.unlocked():
        global_config.update(device.dispatch("auto"))


DTYPES = ("float32", "bfloat16", "float16")
# Modules whose parameters AF2's layer_stack stacks over blocks (a leading block axis): the
# Evoformer and extra MSA blocks (built outside the stack, so named by their own module), and
# what the template pair stack builds inside its layer_stack scope.
_STACKED_MODULES = ("evoformer_iteration", "extra_msa_stack")
_STACK_SCOPE = "__layer_stack"


def raw_features(n_res: int, n_seq: int, n_templates: int, seed: int) -> dict[str, np.ndarray]:
    """A random protein's features as AF2's data pipeline gives them to RunModel.process_features.

    Sequence and MSA features come from the package's own pipeline.make_sequence_features and
    make_msa_features; templates are random but plausible (a 3.8 A CA walk with the residues' atoms
    around it, 90% of the standard atoms present, a few gaps), in the dtypes and shapes
    alphafold.data.templates makes.

    Args:
      n_res: residues.
      n_seq: MSA depth, the query included (clusters and extra MSA are drawn from these rows).
      n_templates: template hits (0: none; model_1's max_templates, 4, are kept).
      seed: numpy seed.
    """
    from alphafold.common import residue_constants as rc
    from alphafold.data import parsers, pipeline

    rng = np.random.default_rng(seed)
    letters = np.array(rc.restypes)
    query = "".join(rng.choice(letters, n_res))
    rows, deletions = [query], [[0] * n_res]
    for _ in range(n_seq - 1):  # mutated copies: 20% substitutions, 5% gaps, a few deletions
        rows.append("".join(_mutated(rng, query, 0.2, 0.05)))
        deletions.append(list(np.where(rng.random(n_res) < 0.05, rng.integers(1, 4, n_res), 0)))
    msa = parsers.Msa(rows, deletions, [f"seq_{i}" for i in range(n_seq)])
    feats = {
        **pipeline.make_sequence_features(query, "random", n_res),
        **pipeline.make_msa_features([msa]),
    }
    return {**feats, **_random_templates(rng, query, n_templates)}


def _mutated(rng, sequence: str, substitutions: float, gaps: float) -> np.ndarray:
    """sequence's letters with a fraction replaced by random residues and a fraction by gaps."""
    from alphafold.common import residue_constants as rc

    seq, n = np.array(list(sequence)), len(sequence)
    seq = np.where(rng.random(n) < substitutions, rng.choice(np.array(rc.restypes), n), seq)
    return np.where(rng.random(n) < gaps, "-", seq)


def _random_templates(rng, query: str, n_templates: int) -> dict[str, np.ndarray]:
    """Template features as alphafold.data.templates makes them, for random hits."""
    from alphafold.common import residue_constants as rc

    n_res, atoms = len(query), rc.atom_type_num
    aatype, masks, positions = [], [], []
    for _ in range(n_templates):
        seq = _mutated(rng, query, 0.3, 0.1)  # gaps: residues the hit does not cover
        aatype.append(rc.sequence_to_onehot("".join(seq), rc.HHBLITS_AA_TO_ID))
        steps = rng.normal(size=(n_res, 3))
        ca = np.cumsum(3.8 * steps / np.linalg.norm(steps, axis=-1, keepdims=True), axis=0)
        standard = np.array([rc.STANDARD_ATOM_MASK[rc.restype_order.get(a, 0)] for a in seq])
        mask = standard * (rng.random((n_res, atoms)) < 0.9) * (seq != "-")[:, None]
        pos = ca[:, None, :] + 1.5 * rng.normal(size=(n_res, atoms, 3))
        masks.append(mask)
        positions.append(pos * mask[..., None])
    f32 = lambda x, shape: np.asarray(x, np.float32).reshape(shape)
    return {
        "template_aatype": f32(aatype, (n_templates, n_res, 22)),
        "template_all_atom_masks": f32(masks, (n_templates, n_res, atoms)),
        "template_all_atom_positions": f32(positions, (n_templates, n_res, atoms, 3)),
        "template_domain_names": np.array(
            [f"t{i:03d}_A".encode() for i in range(n_templates)], dtype=object
        ),
        "template_sum_probs": f32(rng.uniform(20, 200, n_templates), (n_templates, 1)),
    }


def model_config(n_res: int, n_seq: int, n_extra_seq: int, num_recycle: int, dtype="float32"):
    """model_1's config (templates and the extra MSA on) for these sizes, as RunModel sets it up.

    Args:
      n_res: residues, the crop size: features() checks that the raw features have as many (AF2's
        pipeline crops to the raw length).
      n_seq: MSA clusters the model sees (the query included); model_1 adds its max_templates (4)
        template rows to the MSA stack.
      n_extra_seq: extra MSA rows (padded with masked rows when the MSA has fewer).
      num_recycle: recycling iterations after the first (data and model alike).
      dtype: 'float32', or 'bfloat16' / 'float16': AF2's half-precision trunk (global_config
        bfloat16 with its half_dtype; results float32).

    Returns:
      The full ConfigDict (data and model), deterministic: no dropout, one ensemble.
    """
    from alphafold.model import config

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    for name, value in (("n_res", n_res), ("n_seq", n_seq), ("n_extra_seq", n_extra_seq)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if isinstance(num_recycle, bool) or not isinstance(num_recycle, int) or num_recycle < 0:
        raise ValueError(f"num_recycle must be an int >= 0, got {num_recycle!r}")
    cfg = config.model_config("model_1")
    data, model = cfg.data, cfg.model
    data.common.num_recycle = model.num_recycle = num_recycle
    data.eval.num_ensemble = 1
    # model_1 reduces the clusters by max_templates (their rows join the MSA stack instead).
    reserved = data.eval.max_templates if data.common.reduce_msa_clusters_by_max_templates else 0
    data.eval.max_msa_clusters = n_seq + reserved
    data.common.max_extra_msa = n_extra_seq
    data.eval.crop_size = n_res  # what make_data_config sets; features() checks the raw length
    gc = model.global_config
    gc.bfloat16 = dtype != "float32"
    gc.half_dtype = "float16" if dtype == "float16" else "bfloat16"
    gc.deterministic = True  # no dropout, whatever is_training says
    # RunModel's own settings (AlphaFold_noE reads them): no extended pTM.
    model.calc_extended_ptm = model.use_probs_extended = False
    return cfg


def features(cfg, raw: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """RunModel.process_features for a monomer: the package's numpy input pipeline (MSA
    clustering, masked-MSA and cropping seeded by `seed`), a leading axis per recycle."""
    from alphafold.model import features as af2_features

    n_res = int(raw["seq_length"][0])
    if n_res != cfg.data.eval.crop_size:
        raise ValueError(
            f"raw features have {n_res} residues, the config {cfg.data.eval.crop_size} (n_res)"
        )
    return af2_features.np_example_to_features(raw, cfg, random_seed=seed)


class ZeroUpdate(hk.Module):
    """An attention module whose update is zero: the floor variant's stand-in for the family's."""

    def __init__(self, config, global_config, name="zero_update"):
        super().__init__(name=name)
        self.config = config

    def __call__(self, act, mask, *args, **kwargs):
        return jnp.zeros_like(act)


def with_variant(fn: Callable, variant: str) -> Callable:
    """fn (which builds AF2's modules when traced) as it is ('af2'), with our attention ('ours'),
    or with the five family modules' updates zero and no attention parameters ('floor')."""
    if variant in (OURS, OURS_COLABFOLD):
        return af2_package.use_gated_attention()(fn)
    if variant == FLOOR:
        return af2_package.use_gated_attention(dict.fromkeys(af2_package.FAMILY, ZeroUpdate))(fn)
    if variant not in (AF2, COLABFOLD):
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return fn


def transformed(cfg, variant: str) -> hk.Transformed:
    """RunModel's forward for num_ensemble 1: one recycling iteration of AlphaFold_noE on a batch
    with a leading size-1 axis and 'prev' (the previous iteration's outputs), without RunModel's
    float16 cast of the results, traced as `variant` (with_variant)."""

    def forward(batch):
        modules = af2_package.alphafold_modules()
        return modules.AlphaFold_noE(cfg.model)(dict(batch), is_training=False)

    return hk.transform(with_variant(forward, variant))


def one_recycle(batch: dict[str, Any], r: int = 0) -> dict[str, Any]:
    """The features of recycling iteration r, keeping the size-1 leading axis (as RunModel slices
    them for num_ensemble 1)."""
    return {k: v[r : r + 1] for k, v in batch.items()}


def _fan_in(module: str, name: str, shape: tuple[int, ...]) -> int | None:
    """A weight's fan-in, or None for a vector (bias, LayerNorm): a layer_stack block's parameters
    carry the block axis first; output_w [h, c, o] (the attention's, the outer product mean's)
    contracts over its first two axes, other weights over the first."""
    segments = module.split("/")
    if set(_STACKED_MODULES) & set(segments) or any(s.startswith(_STACK_SCOPE) for s in segments):
        shape = shape[1:]
    if len(shape) < 2:
        return None
    return shape[0] * shape[1] if name == "output_w" and len(shape) == 3 else shape[0]


def random_params(t: hk.Transformed, batch: dict[str, Any], seed: int, gain: float = 0.5):
    """Random parameters of the whole model's shapes and dtypes, from jax.eval_shape of its init
    (nothing run), non-zero everywhere: weights ~ N(0, gain^2 / fan_in) (fan-in per block of a
    layer stack), biases and LayerNorm offsets ~ N(0, 0.1^2), LayerNorm scales ~ 1 + N(0, 0.1^2).
    AF2's zero_init would make every attention update zero, and a comparison meaningless.

    Args:
      t: transformed(cfg, AF2) (the others create the same parameters or, the floor, fewer).
      batch: features(...) (all recycles) or one_recycle(...) of them.
      seed: numpy seed.
      gain: the weights' scale; small enough that 48 blocks and recycling stay finite.
    """
    rng = np.random.default_rng(seed)
    with jax.enable_x64(False):  # AF2's model: see predictor
        shapes = jax.eval_shape(t.init, jax.random.PRNGKey(0), one_recycle(batch))
    params = {}
    for module, leaves in sorted(shapes.items()):
        params[module] = {}
        for name, spec in sorted(leaves.items()):
            fan_in = _fan_in(module, name, spec.shape)
            if fan_in is None:
                x = 0.1 * rng.standard_normal(spec.shape, np.float32) + (name == "scale")
            else:
                x = gain / np.sqrt(fan_in) * rng.standard_normal(spec.shape, np.float32)
            params[module][name] = x.astype(spec.dtype)
    return jax.device_put(params)  # not jnp.asarray per leaf: a copy program per shape (jax 0.10)


def counting_calls(fn: Callable, calls: collections.Counter) -> Callable:
    """fn, counting in `calls` each Haiku module class whose __call__ runs while fn runs (that is,
    while it is traced under jax.jit or jax.eval_shape), by the class itself."""

    def interceptor(method, args, kwargs, context):
        if context.method_name == "__call__":
            calls[type(context.module)] += 1
        return method(*args, **kwargs)

    def counted(*args, **kwargs):
        with hk.intercept_methods(interceptor):
            return fn(*args, **kwargs)

    return counted


def af2_attention_calls(calls: collections.Counter) -> dict[str, int]:
    """Of counting_calls' counts, those of AF2's own attention classes (the six names
    af2_package.REPLACEMENTS swaps, as alphafold.model.modules defines them), by name."""
    return {
        cls.__name__: n
        for cls, n in calls.items()
        if cls.__module__ == "alphafold.model.modules" and cls.__name__ in af2_package.REPLACEMENTS
    }


def predictor(cfg, apply: Callable) -> Callable[[Any, dict[str, Any]], dict[str, Any]]:
    """fn(params, batch) -> the last recycle's raw outputs: RunModel.predict's loop (zero 'prev',
    one jitted forward per recycling iteration on its slice of the features, prev passed on, a
    key split per iteration), without its float16 casts and early stop.

    Args:
      cfg: model_config(...).
      apply: transformed(cfg, variant).apply (jitted here), or a wrapper of it (counting_calls).
    """
    apply = jax.jit(apply)
    select = jax.jit(lambda batch, r: jax.tree.map(lambda x: x[r][None], batch))
    c = cfg.model.embeddings_and_evoformer
    num_iters = cfg.model.num_recycle + 1

    def predict(params, batch):
        # AF2's model is float32 code: with jax_enable_x64 (as in this project's tests) its
        # constants turn float64 and its structure module's scan fails, so it runs without.
        with jax.enable_x64(False):
            return run(params, batch)

    def run(params, batch):
        n_res = batch["aatype"].shape[1]
        prev = {
            "prev_msa_first_row": jnp.zeros((n_res, c.msa_channel), jnp.float32),
            "prev_pair": jnp.zeros((n_res, n_res, c.pair_channel), jnp.float32),
            "prev_pos": jnp.zeros((n_res, 37, 3), jnp.float32),
        }
        key = jax.random.PRNGKey(0)
        for r in range(num_iters):
            key, sub = jax.random.split(key)
            out = apply(params, sub, {**select(batch, r), "prev": prev})
            prev = out["prev"]
        return out

    return predict


def problem(
    n_res: int,
    n_seq: int,
    n_extra_seq: int,
    n_templates: int,
    num_recycle: int,
    dtype: str = "float32",
    seed: int = 0,
    variants: tuple[str, ...] = (AF2, OURS),
):
    """({variant: fn}, params, batch): the whole model as each of `variants` (with_variant),
    fn(params, batch) -> the last recycle's raw outputs (predictor), taking the same random params
    (AF2's) and processed features (on the device).

    The raw MSA has n_seq + n_extra_seq rows, so the model sees n_seq clusters and n_extra_seq
    extra rows, all of them real sequences. Compare outputs with family_benchmark.relative_diff.
    """
    cfg = model_config(n_res, n_seq, n_extra_seq, num_recycle, dtype)
    raw = raw_features(n_res, n_seq + n_extra_seq, n_templates, seed)
    batch = jax.device_put(features(cfg, raw, seed))
    ts = {}
    for v in variants:
        variant_cfg = copy.deepcopy(cfg)
        if v in KERNELS:
            colabfold_kernels(variant_cfg.model.global_config)
        ts[v] = transformed(variant_cfg, v)
    params = random_params(transformed(cfg, AF2), batch, seed)
    return {v: predictor(cfg, t.apply) for v, t in ts.items()}, params, batch
