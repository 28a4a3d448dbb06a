"""Device memory of AlphaFold 3's trunk block compiled deviceless (targets.py), with AF3's own XLA
attention, with ours (gated_attention.af3.use_gated_attention), and with the attention removed.

The block: AF3's PairFormerIteration as its trunk builds it (Evoformer.Config().pairformer: the
pair [N, N, 128], the single [N, 384], 4 pair heads, 16 single heads), in bfloat16 under AF3's
bfloat16_context, AF3's GlobalConfig otherwise (its triangle attention runs over 128-row chunks
below 1,536 tokens). Modes: 'inference' (the block's outputs) and 'gradient' (the gradient of the
block with respect to the pair, what binder design takes; the outputs' cotangents are arguments).
Variants: 'af3' (flash_attention_implementation='xla', AF3's attention on a TPU and what it runs
without tokamax; 'af3:triton' or 'af3:cudnn' names AF3's others), 'ours' (the swap, 'auto'), 'ours_inline' (with
its inline half too), 'ours:<implementation>', 'floor' and 'floor_qkv' (AF3's
attention function replaced by a stand-in with its shapes and no logits, FLOORS), and 'no_inline'
(AF3's inline self_attention, the single and diffusion transformers', replaced by one projection:
the rest's cost, so the inline attention's share). what='trunk_stack': the whole trunk, its 48
blocks in AF3's own layer stack, each checkpointed (AF3's block_remat, on by default here).
what='diffusion': the diffusion head's token transformer (24 blocks, inline attention only),
inference. The peak is XLA's memory_analysis
(arguments + outputs + temporaries); each cell compiles in a child process. `--time` runs the
variants on this machine's device instead (time_cells). `--longest` searches the longest token count whose peak fits the device, in
steps of `--step` tokens.

  python -m gated_attention_tools.af3_memory --targets=h100 --tokens=1024 --modes=gradient
  python -m gated_attention_tools.af3_memory --targets=h100,rtx4090,v5e --longest --modes=gradient
  python -m gated_attention_tools.af3_memory --what=diffusion --modes=inference --variants=af3,no_inline
  python -m gated_attention_tools.af3_memory --what=trunk_stack --modes=inference --tokens=1024,5120
  python -m gated_attention_tools.af3_memory --time --what=diffusion --variants=af3,no_inline
  python -m gated_attention_tools.af3_memory --time --modes=gradient,inference \\
      --variants=af3:triton,ours,af3:xla --tokens=768,1024     # on a GPU: against tokamax's Triton
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import time
from typing import Any

import numpy as np

VARIANTS = ("af3", "ours", "ours_inline", "floor", "floor_qkv", "no_inline")
MODES = ("inference", "gradient")
WHATS = ("trunk", "trunk_stack", "diffusion")
AF3_IMPLEMENTATIONS = ("xla", "triton", "cudnn")  # 'af3:<name>': AF3's own, by its name
PAIR, SINGLE, TOKEN = 128, 384, 768  # AF3's trunk channels, the diffusion transformer's
# jax.random.PRNGKey(1)'s data as NumPy: a jax key would be computed on the default device, which
# is the (abstract) target GPU while a GPU cell traces (_on).
KEY = np.array([0, 1], np.uint32)


def _no_logits(x, mask, pair_logits, config, global_config, single_cond=None, name="", **kwargs):
    """A stand-in for AF3's inline self_attention with its projections (q, k, v, gate and output,
    of x's width) and no logits: q * k * v gated and projected (the 'no_inline' variant: what the
    rest costs, so the share of the logits, softmax and weighted average; no layer norm)."""
    import haiku as hk
    import jax

    del mask, pair_logits, config, global_config, single_cond, kwargs
    width = x.shape[-1]
    q, k, v, gate = (hk.Linear(width, name=f"{name}no_logits_{p}")(x) for p in "qkvg")
    return hk.Linear(width, name=f"{name}no_logits_o")(q * k * v * jax.nn.sigmoid(gate))


def _swap(variant: str):
    """The context the block is traced in for `variant`."""
    import gated_attention as ga
    from gated_attention_tools import af3_model

    name, _, implementation = variant.partition(":")
    if name in ("ours", "ours_inline"):
        inline = name == "ours_inline"
        return ga.af3.use_gated_attention(implementation or "auto", inline=inline)
    if name in ("floor", "floor_qkv"):
        stand_in = FLOORS[name]
        return _patched(af3_model.load().attention, "dot_product_attention", stand_in)
    if name == "no_inline":
        return _patched(af3_model.load().diffusion_transformer, "self_attention", _no_logits)
    if name != "af3" or (implementation and implementation not in AF3_IMPLEMENTATIONS):
        raise ValueError(
            f"variant must be one of {VARIANTS}, 'ours:<implementation>' or 'af3:<name>' with a "
            f"name of {AF3_IMPLEMENTATIONS}, got {variant!r}"
        )
    return contextlib.nullcontext()


# Stand-ins for AF3's attention function with its shapes and no logits: 'floor' returns the values
# (q and k are then dead code, their projections too); 'floor_qkv' their elementwise product, so
# the gradient keeps q, k and v as an attention's must (AF3's q/k/v heads have one width).
FLOORS = {
    "floor": lambda q, k, v, **kwargs: v,
    "floor_qkv": lambda q, k, v, **kwargs: q * k * v,
}


class _patched(contextlib.ContextDecorator):  # noqa: N801 (a context, named as one)
    """module.name = value while active; reusable (the init's trace and the apply's)."""

    def __init__(self, module, name, value):
        self.module, self.name, self.value = module, name, value

    def __enter__(self):
        self.original = getattr(self.module, self.name)
        setattr(self.module, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.original)


def _global_config(af3, variant: str):
    """AF3's GlobalConfig with the attention AF3 names in 'af3:<name>' ('xla' otherwise: under
    the swap AF3's name only matters for implementation='af3')."""
    name, _, implementation = variant.partition(":")
    chosen = implementation if name == "af3" and implementation else "xla"
    return af3.model_config.GlobalConfig(flash_attention_implementation=chosen)


def _diffusion_problem(variant: str, n_tokens: int, mode: str):
    """(fn, abstract args): the diffusion head's token transformer (24 blocks of inline self
    attention with the pair's logits), one sampling step's call, in bfloat16."""
    import haiku as hk
    import jax
    import jax.numpy as jnp

    from gated_attention_tools import af3_model

    if mode != "inference":
        raise ValueError(f"the diffusion transformer is measured for inference, got {mode=}")
    af3 = af3_model.load()
    config = af3.diffusion_head.DiffusionHead.Config().transformer
    global_config = _global_config(af3, variant)

    def transformer(act, mask, single_cond, pair_cond):
        with af3.utils.bfloat16_context():
            stack = af3.diffusion_transformer.Transformer(config, global_config)
            return stack(act=act, mask=mask, single_cond=single_cond, pair_cond=pair_cond)

    t = hk.transform(transformer)
    n, bf16 = n_tokens, jnp.bfloat16
    args = [
        jax.ShapeDtypeStruct((n, TOKEN), bf16),
        jax.ShapeDtypeStruct((n,), bf16),
        jax.ShapeDtypeStruct((n, SINGLE), bf16),
        jax.ShapeDtypeStruct((n, n, PAIR), bf16),
    ]
    swap = _swap(variant)
    with swap:
        params = jax.eval_shape(t.init, KEY, *args)

    def inference(params, *args):
        with swap:
            return t.apply(params, None, *args)

    return inference, [params, *args]


def problem(variant: str, n_tokens: int, mode: str, what: str = "trunk"):
    """(fn, abstract args): AF3's trunk block (what='trunk'), its whole trunk (what='trunk_stack':
    the 48 blocks) or, what='diffusion', its diffusion transformer, in `variant`, inference or
    the pair gradient."""
    import haiku as hk
    import jax
    import jax.numpy as jnp

    from gated_attention_tools import af3_model

    if what not in WHATS:
        raise ValueError(f"what must be one of {WHATS}, got {what!r}")
    if what == "diffusion":
        return _diffusion_problem(variant, n_tokens, mode)
    af3 = af3_model.load()
    config = af3.evoformer.Evoformer.Config().pairformer
    global_config = _global_config(af3, variant)

    def iteration(pair, single, pair_mask, seq_mask):
        pairformer = af3.modules.PairFormerIteration(
            config, global_config, with_single=True, name="trunk_pairformer"
        )
        return pairformer(pair, pair_mask, single_act=single, seq_mask=seq_mask)

    def block(pair, pair_mask, single, seq_mask):
        with af3.utils.bfloat16_context():
            if what == "trunk":
                return iteration(pair, single, pair_mask, seq_mask)
            # The trunk as AF3's Evoformer builds it: its own layer stack, checkpointed per block.
            body = lambda x: iteration(*x, pair_mask, seq_mask)  # noqa: E731
            stack = af3.evoformer._stack(config.num_layer, body, config.block_remat)
            return stack((pair, single))

    t = hk.transform(block)
    bf16 = jnp.bfloat16
    n = n_tokens
    pair = jax.ShapeDtypeStruct((n, n, PAIR), bf16)
    single = jax.ShapeDtypeStruct((n, SINGLE), bf16)
    masks = jax.ShapeDtypeStruct((n, n), bf16), jax.ShapeDtypeStruct((n,), bf16)  # as AF3's trunk
    swap = _swap(variant)
    with swap:  # no_inline's stand-in has parameters of its own
        params = jax.eval_shape(t.init, KEY, pair, masks[0], single, masks[1])

    def inference(params, pair, pair_mask, single, seq_mask):
        with swap:
            return t.apply(params, KEY, pair, pair_mask, single, seq_mask)

    if mode == "inference":
        return inference, [params, pair, *masks[:1], single, masks[1]]

    def gradient(params, pair, pair_mask, single, seq_mask, cotangents):
        with swap:
            forward = lambda x: t.apply(params, KEY, x, pair_mask, single, seq_mask)  # noqa: E731
            _, vjp = jax.vjp(forward, pair)
            return vjp(cotangents)[0]

    return gradient, [params, pair, masks[0], single, masks[1], (pair, single)]


def compile_cell(
    variant: str, n_tokens: int, mode: str, target: str, what: str = "trunk"
) -> dict[str, Any]:
    """The child: one cell compiled for its target; its memory and what 'auto' chose there."""
    import gated_attention as ga
    from gated_attention_tools import measure, targets

    start = time.perf_counter()
    kind = targets.target(target).kind
    with ga.record_implementation_choices() as choices, _cross_compiling(kind), _on(target):
        fn, args = problem(variant, n_tokens, mode, what)
        compiled = targets.compile(fn, *args, target=target)
    chosen = sorted({c["by_platform"][kind]["chosen"] for c in choices if kind in c["by_platform"]})
    return dict(
        memory=measure.compiled_memory(compiled),
        chosen=chosen,
        compile_s=round(time.perf_counter() - start, 1),
    )


def _on(target: str):
    """A GPU target's device the default while tracing, as on the GPU: the peers' kernels
    (ours:tokamax_*) are traced for it alone (for the host's CPU too otherwise, which they refuse)."""
    import jax

    from gated_attention_tools import targets

    if targets.target(target).kind != "gpu":
        return contextlib.nullcontext()
    return jax.default_device(targets.device(target))


def _cross_compiling(kind: str):
    """tokamax's own switch for compiling on a machine without the device (AF3's 'triton' and
    'cudnn' are tokamax's, which otherwise refuse a host without a GPU), for a GPU target."""
    import importlib.util

    if kind != "gpu" or importlib.util.find_spec("tokamax") is None:
        return contextlib.nullcontext()
    import tokamax

    return tokamax.config.cross_compile(True)


def measure_cell(
    variant: str, n_tokens: int, mode: str, target: str, log=print, what: str = "trunk"
) -> dict:
    """compile_cell in a child process: the row, with whether the peak fits, or the error."""
    from gated_attention_tools import targets

    kwargs = dict(variant=variant, n_tokens=n_tokens, mode=mode, target=target, what=what)
    row = dict(kwargs)
    try:
        got = targets.in_child("gated_attention_tools.af3_memory:compile_cell", kwargs, log)
    except RuntimeError as e:  # a compiler's error (a TPU's RESOURCE_EXHAUSTED: does not fit)
        return row | dict(error=_reason(str(e)), fits=False)
    fits = got["memory"]["peak"] <= targets.target(target).memory_bytes
    return row | got | dict(fits=fits)


def _reason(error: str) -> str:
    """The error's own last line, not JAX's note on the frames it filtered or a rule."""
    notes = ("For simplicity, JAX has removed", "-----", "=====")
    lines = [x for x in error.strip().splitlines() if x.strip() and not x.startswith(notes)]
    return (lines[-1] if lines else error.strip())[:300]


def longest(
    variant: str, mode: str, target: str, start: int, step: int, log=print, what: str = "trunk"
) -> list:
    """Rows from `start` tokens up (while they fit) or down (while they don't) in `step`s: the
    last fitting one is the longest, to `step` tokens."""
    from gated_attention_tools import targets

    at = lambda n: measure_cell(variant, n, mode, target, log, what)
    return targets.search_longest(at, start, step)


def time_cells(
    variants, n_tokens: int, what: str = "trunk", mode: str = "inference", rounds: int = 5
) -> dict[str, Any]:
    """Seconds per call on this machine's default device (float32 on a CPU, where XLA emulates
    bfloat16; bfloat16 elsewhere), each variant compiled first, then called in turn `rounds`
    times (interleaved: a shared machine drifts); the median per variant, its ratio to the
    first's, and on a GPU or TPU the device's peak bytes in use after all."""
    import jax
    import numpy as np

    on_cpu = jax.default_backend() == "cpu"
    calls = {}
    for variant in variants:
        fn, specs = problem(variant, n_tokens, mode, what)
        if on_cpu:
            specs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, np.float32), specs)
        rng = np.random.default_rng(0)
        draw = lambda s: rng.standard_normal(s.shape).astype(s.dtype)  # noqa: E731, B023
        inputs = jax.device_put(jax.tree.map(draw, specs[1:]))
        params = hk_transformed_params(specs[0], rng)
        jitted = jax.jit(fn)
        jax.block_until_ready(jitted(params, *inputs))  # compiled
        calls[variant] = (jitted, params, inputs)
    seconds = {v: [] for v in variants}
    for _ in range(rounds):
        for variant, (jitted, params, inputs) in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(jitted(params, *inputs))
            seconds[variant].append(time.perf_counter() - start)
    median = {v: float(np.median(s)) for v, s in seconds.items()}
    stats = None if on_cpu else jax.devices()[0].memory_stats()
    return dict(
        what=what,
        mode=mode,
        n_tokens=n_tokens,
        backend=jax.default_backend(),
        dtype="float32" if on_cpu else "bfloat16",
        seconds=median,
        over_first={v: median[v] / median[variants[0]] for v in variants},
        peak_bytes_in_use=None if stats is None else stats.get("peak_bytes_in_use"),
    )


def hk_transformed_params(shapes, rng):
    """Random parameters of these shapes (weights ~ N(0, 1/fan_in), vectors ~ 1 + N(0, 0.01))."""
    import jax
    import numpy as np

    def draw(s):
        scale = s.shape[0] ** -0.5 if len(s.shape) > 1 else 0.1
        return (scale * rng.standard_normal(s.shape) + (len(s.shape) == 1)).astype(np.float32)

    return jax.device_put(jax.tree.map(draw, shapes))


def table(rows: list[dict]) -> str:
    """Markdown: every compiled cell (peak in GB = 1e9 bytes, against the target's memory), then
    the longest fitting token count per target, mode and variant where a search ran."""
    from gated_attention_tools import targets

    lines = [
        "| target | what | mode | variant | tokens | peak GB | fits | 'auto' chose |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    compiled = [r for r in rows if "target" in r]
    for r in compiled:
        peak = f"{r['memory']['peak'] / 1e9:.2f}" if "memory" in r else r.get("error", "")[:60]
        chosen = ", ".join(r.get("chosen", [])) or "-"
        what = r.get("what", "trunk")
        lines.append(
            f"| {r['target']} | {what} | {r['mode']} | {r['variant']} | {r['n_tokens']} | {peak} "
            f"| {'yes' if r['fits'] else 'no'} | {chosen} |"
        )
    groups: dict[tuple, list] = {}
    for r in compiled:
        groups.setdefault(
            (r["target"], r.get("what", "trunk"), r["mode"], r["variant"]), []
        ).append(r)
    longest_rows = []
    for (target, what, mode, variant), found in groups.items():
        fit = [r["n_tokens"] for r in found if r["fits"]]
        over = [r["n_tokens"] for r in found if not r["fits"]]
        if fit and over:
            memory = targets.target(target).memory_bytes / 1e9
            longest_rows.append(
                f"| {target} ({memory:.1f} GB) | {what} | {mode} | {variant} | {max(fit)} "
                f"| {min(n for n in over if n > max(fit))} |"
            )
    if longest_rows:
        lines += [
            "",
            "| target | what | mode | variant | longest that fits | shortest that does not |",
            "| --- | --- | --- | --- | --- | --- |",
            *longest_rows,
        ]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", default="trunk", choices=WHATS)
    parser.add_argument("--time", action="store_true", help="run and time (time_cells) instead")
    parser.add_argument("--targets", default="h100")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--modes", default="gradient")
    parser.add_argument("--tokens", default="1024", help="token counts, or --longest's starts")
    parser.add_argument("--longest", action="store_true")
    parser.add_argument("--step", type=int, default=128)
    parser.add_argument("--out", default=None, help="a JSON lines file the rows are appended to")
    parser.add_argument("--table", default=None, help="print a JSON lines file's rows as tables")
    flags = parser.parse_args(argv)
    if flags.table:
        with open(flags.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    quiet = lambda _: None  # noqa: E731
    tokens = [int(x) for x in split(flags.tokens)]
    if flags.time:
        for mode, n in itertools.product(split(flags.modes), tokens):
            row = time_cells(split(flags.variants), n, flags.what, mode)
            print(json.dumps(row), flush=True)
            if flags.out:
                with open(flags.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
        return
    for target in split(flags.targets):
        for mode in split(flags.modes):
            for variant in split(flags.variants):
                for n in tokens:
                    if flags.longest:
                        rows = longest(variant, mode, target, n, flags.step, quiet, flags.what)
                    else:
                        rows = [measure_cell(variant, n, mode, target, quiet, flags.what)]
                    for row in rows:
                        print(json.dumps(row), flush=True)
                        if flags.out:
                            with open(flags.out, "a") as f:
                                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
