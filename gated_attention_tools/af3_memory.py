"""Device memory of AlphaFold 3's trunk block compiled deviceless (targets.py), with AF3's own XLA
attention, with ours (gated_attention.af3.use_gated_attention), and with the attention removed.

The block: AF3's PairFormerIteration as its trunk builds it (Evoformer.Config().pairformer: the
pair [N, N, 128], the single [N, 384], 4 pair heads, 16 single heads), in bfloat16 under AF3's
bfloat16_context, AF3's GlobalConfig otherwise (its triangle attention runs over 128-row chunks
below 1,536 tokens). Modes: 'inference' (the block's outputs) and 'gradient' (the gradient of the
block with respect to the pair, what binder design takes; the outputs' cotangents are arguments).
Variants: 'af3' (flash_attention_implementation='xla', AF3's attention on a TPU and what it runs
without tokamax), 'ours' (the swap, 'auto'), 'ours:<implementation>', and 'floor' (AF3's attention
function replaced by a stand-in that returns the values: the same projections and shapes, no
logits). The peak is XLA's memory_analysis (arguments + outputs + temporaries); each cell compiles
in a child process. `--longest` searches the longest token count whose peak fits the device, in
steps of `--step` tokens.

  python -m gated_attention_tools.af3_memory --targets=h100 --tokens=1024 --modes=gradient
  python -m gated_attention_tools.af3_memory --targets=h100,rtx4090,v5e --longest --modes=gradient
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from typing import Any

VARIANTS = ("af3", "ours", "floor")
MODES = ("inference", "gradient")
PAIR, SINGLE = 128, 384  # AF3's trunk channels


def _swap(variant: str):
    """The context the block is traced in for `variant`."""
    import gated_attention as ga
    from gated_attention_tools import af3_model

    name, _, implementation = variant.partition(":")
    if name == "ours":
        return ga.af3.use_gated_attention(implementation or "auto")
    if name == "floor":
        attention = af3_model.load().attention
        stand_in = lambda q, k, v, **kwargs: v  # noqa: E731 (no logits: the values, as they are)
        return _patched(attention, "dot_product_attention", stand_in)
    if name != "af3":
        raise ValueError(
            f"variant must be one of {VARIANTS} or 'ours:<implementation>', got {variant!r}"
        )
    return contextlib.nullcontext()


@contextlib.contextmanager
def _patched(module, name, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def problem(variant: str, n_tokens: int, mode: str):
    """(fn, abstract args): AF3's trunk block in `variant`, inference or its pair gradient."""
    import haiku as hk
    import jax
    import jax.numpy as jnp

    from gated_attention_tools import af3_model

    af3 = af3_model.load()
    config = af3.evoformer.Evoformer.Config().pairformer
    global_config = af3.model_config.GlobalConfig(flash_attention_implementation="xla")

    def block(pair, pair_mask, single, seq_mask):
        with af3.utils.bfloat16_context():
            iteration = af3.modules.PairFormerIteration(
                config, global_config, with_single=True, name="trunk_pairformer"
            )
            return iteration(pair, pair_mask, single_act=single, seq_mask=seq_mask)

    t = hk.transform(block)
    bf16 = jnp.bfloat16
    n = n_tokens
    pair = jax.ShapeDtypeStruct((n, n, PAIR), bf16)
    single = jax.ShapeDtypeStruct((n, SINGLE), bf16)
    masks = jax.ShapeDtypeStruct((n, n), bf16), jax.ShapeDtypeStruct((n,), bf16)  # as AF3's trunk
    params = jax.eval_shape(t.init, jax.random.PRNGKey(0), pair, masks[0], single, masks[1])
    key = jax.random.PRNGKey(1)
    swap = _swap(variant)

    def inference(params, pair, pair_mask, single, seq_mask):
        with swap:
            return t.apply(params, key, pair, pair_mask, single, seq_mask)

    if mode == "inference":
        return inference, [params, pair, *masks[:1], single, masks[1]]

    def gradient(params, pair, pair_mask, single, seq_mask, cotangents):
        with swap:
            forward = lambda x: t.apply(params, key, x, pair_mask, single, seq_mask)  # noqa: E731
            _, vjp = jax.vjp(forward, pair)
            return vjp(cotangents)[0]

    return gradient, [params, pair, masks[0], single, masks[1], (pair, single)]


def compile_cell(variant: str, n_tokens: int, mode: str, target: str) -> dict[str, Any]:
    """The child: one cell compiled for its target; its memory and what 'auto' chose there."""
    import gated_attention as ga
    from gated_attention_tools import measure, targets

    fn, args = problem(variant, n_tokens, mode)
    start = time.perf_counter()
    with ga.record_implementation_choices() as choices:
        compiled = targets.compile(fn, *args, target=target)
    kind = targets.target(target).kind
    chosen = sorted({c["by_platform"][kind]["chosen"] for c in choices if kind in c["by_platform"]})
    return dict(
        memory=measure.compiled_memory(compiled),
        chosen=chosen,
        compile_s=round(time.perf_counter() - start, 1),
    )


def measure_cell(variant: str, n_tokens: int, mode: str, target: str, log=print) -> dict:
    """compile_cell in a child process: the row, with whether the peak fits, or the error."""
    from gated_attention_tools import targets

    row = dict(variant=variant, n_tokens=n_tokens, mode=mode, target=target)
    kwargs = dict(variant=variant, n_tokens=n_tokens, mode=mode, target=target)
    try:
        got = targets.in_child("gated_attention_tools.af3_memory:compile_cell", kwargs, log)
    except RuntimeError as e:  # a compiler's error (a TPU's RESOURCE_EXHAUSTED: does not fit)
        return row | dict(error=str(e).strip().splitlines()[-1][:300], fits=False)
    fits = got["memory"]["peak"] <= targets.target(target).memory_bytes
    return row | got | dict(fits=fits)


def longest(variant: str, mode: str, target: str, start: int, step: int, log=print) -> list:
    """Rows from `start` tokens up (while they fit) or down (while they don't) in `step`s: the
    last fitting one is the longest, to `step` tokens."""
    rows = [measure_cell(variant, start, mode, target, log)]
    direction = step if rows[0]["fits"] else -step
    while start + direction > 0:
        start += direction
        rows.append(measure_cell(variant, start, mode, target, log))
        if rows[-1]["fits"] != rows[-2]["fits"]:
            break
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="h100")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--modes", default="gradient")
    parser.add_argument("--tokens", default="1024", help="token counts, or --longest's starts")
    parser.add_argument("--longest", action="store_true")
    parser.add_argument("--step", type=int, default=128)
    parser.add_argument("--out", default=None, help="a JSON lines file the rows are appended to")
    flags = parser.parse_args(argv)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    tokens = [int(x) for x in split(flags.tokens)]
    for target in split(flags.targets):
        for mode in split(flags.modes):
            for variant in split(flags.variants):
                for n in tokens:
                    if flags.longest:
                        rows = longest(variant, mode, target, n, flags.step, log=lambda _: None)
                    else:
                        rows = [measure_cell(variant, n, mode, target, log=lambda _: None)]
                    for row in rows:
                        print(json.dumps(row), flush=True)
                        if flags.out:
                            with open(flags.out, "a") as f:
                                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
