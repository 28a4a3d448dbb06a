"""A proxy for sessions without a GPU: the instruction mix of each attention kernel's inner loop
(every forward; our backward's two kernels), per exponential (one per attention score), read from
its sm_90a machine code.

Each kernel is compiled for an H100 without a device (targets.py) at AF2's MSA row shape
(q, k, v [512, 384, 8, 32] bfloat16, a shared [1, 8, 384, 384] bias, a key mask, where the kernel
takes them), its PTX assembled by ptxas for sm_90a and disassembled by nvdisasm (CUDA 13's, from
the `nvidia-cuda-nvcc` and `nvidia-cuda-nvdisasm` wheels of the `targets` extra: Mosaic GPU
writes PTX 9.0). The inner loop is the loop of the SASS (a backward branch) with the most MUFU.EX2
instructions; its instructions are counted by class: MUFU.EX2, tensor-core MMA (HGMMA), other
float ALU, integer and moves, shared memory, global memory and TMA, barriers and synchronisation,
branches. Per exponential, every instruction a warp issues besides the exponential competes for
the SM's 4 issue slots a clock (128 lane-instructions) while the exponential unit does 16 a clock:
at k instructions a score, issue allows at most 8 / k of the exponential unit's peak
('issue-bound % of exp peak'). It says nothing of latency, stalls or memory: a proxy for the
ordering, never a time.

  JAX_PLATFORMS=cpu python -m gated_attention_tools.sass_proxy --out benchmark_results/sass_proxy

Kernels (KERNELS): ours ('mosaic', the Mosaic GPU kernel 'auto' takes on Hopper; 'pallas', the
Triton one), ColabFold's `tri_flash` (colabfold-kernels, the kernel alphafold-colabfold calls) and
JAX's own Mosaic GPU attention (`jax.experimental.pallas.ops.gpu.attention_mgpu`, no bias or
mask: it reads the CUDA runtime's version while tracing, which a deviceless compile has not, so
it is told 12.9).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gated_attention_tools import child, targets

SHAPE = (512, 384, 8, 32)  # AF2's MSA row: [rows, length, heads, head dim]
_MODULE = "gated_attention_tools.sass_proxy"  # children import it by name, also under -m
# Each kernel's forward entry (None: the dumped module with the exponentials), head dim, dtype.
KERNELS = {
    "ours_mosaic": ("gated_attention_mosaic_forward_mosaic_gpu_kernel", 32, "bfloat16"),
    "ours_pallas": ("gated_attention_forward", 32, "bfloat16"),
    # The Mosaic forward computing two batch rows a program (MosaicAttention.rows_per_program).
    "ours_mosaic_r2": ("gated_attention_mosaic_forward_mosaic_gpu_kernel", 32, "bfloat16"),
    # The Mosaic forward with two consumer warpgroups (MosaicAttention.consumer_warpgroups).
    "ours_mosaic_c2": ("gated_attention_mosaic_forward_mosaic_gpu_kernel", 32, "bfloat16"),
    # The persistent Mosaic forward (MosaicAttention.persistent), one and two consumers.
    "ours_mosaic_p1": ("gated_attention_mosaic_forward_mosaic_gpu_kernel", 32, "bfloat16"),
    "ours_mosaic_c2p1": ("gated_attention_mosaic_forward_mosaic_gpu_kernel", 32, "bfloat16"),
    # The backward's two kernels (a vjp at the same shape): each recomputes p = exp(s - lse).
    "ours_mosaic_dkdv": ("gated_attention_mosaic_dkdv_mosaic_gpu_kernel", 32, "bfloat16"),
    "ours_mosaic_dq_dbias": ("gated_attention_mosaic_dq_dbias_mosaic_gpu_kernel", 32, "bfloat16"),
    "ours_pallas_dkdv": ("gated_attention_dkdv", 32, "bfloat16"),
    "ours_pallas_dq_dbias": ("gated_attention_dq_dbias", 32, "bfloat16"),
    # The one-pass Triton backward (PallasAttention.fused_backward): p and ds once a score.
    "ours_pallas_fused": ("gated_attention_fused_backward", 32, "bfloat16"),
    "colabfold_tri_flash": ("tri_flash_fwd", 32, "bfloat16"),
    "tokamax_triton": (None, 32, "bfloat16"),
    "tokamax_mosaic": (None, 32, "bfloat16"),
    # It takes head dims that are multiples of 64 and float16 only.
    "jax_attention_mgpu": (None, 64, "float16"),
}
CLASSES = ("exp", "mma", "float", "integer", "shared", "global", "sync", "branch")
_OPCODE = {
    "exp": re.compile(r"^MUFU\.EX2"),
    "mma": re.compile(r"^(HGMMA|HMMA|WGMMA|UTC)"),
    "float": re.compile(
        r"^(F|H)(FMA|ADD|MUL|MNMX|SEL|SETP|SET|2F|2FP|CHK|RND|MUL2|ADD2|FMA2|MNMX2|SWZADD)"
    ),
    "shared": re.compile(r"^(LDS|STS|LDSM|STSM|ATOMS|REDS)"),
    "global": re.compile(
        r"^(LDG|STG|LD|ST|UTMA|UBLKCP|UTMALDG|UTMASTG|UTMAPF|ATOMG|RED|LDGSTS|LDGDEPBAR)"
    ),
    "sync": re.compile(
        r"^(BAR|SYNCS|WARPSYNC|DEPBAR|WARPGROUP|ARRIVES|MEMBAR|ERRBAR|CCTL|FENCE|ELECT|NANOSLEEP|YIELD)"
    ),
    "branch": re.compile(r"^(BRA|BRX|JMP|CALL|RET|EXIT|BSSY|BSYNC|BREAK|WARPSYNC)"),
}
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`?\(?(\.L_x_\d+)\)?")


def classify(opcode: str) -> str:
    """One of CLASSES for a SASS opcode; 'integer' for everything else (integer ALU, moves,
    predicates, conversions to uniform registers)."""
    for name in ("exp", "mma", "sync", "branch", "shared", "global", "float"):
        if _OPCODE[name].match(opcode):
            return name
    return "integer"


def parse_sass(text: str, function: str | None = None) -> list[tuple[int, str, str]]:
    """[(address, opcode, operands)] of one function of nvdisasm's output (the first with an
    EX2 when `function` is None), labels as (address, ':LABEL', '')."""
    sections = re.split(r"\n\s*\.section\s+\.text\.", text)
    body = None
    for section in sections[1:]:
        name = section.split(",", 1)[0].strip()
        if (function is None and "MUFU.EX2" in section) or name == function:
            body = section
            break
    if body is None:
        raise ValueError(f"function {function!r} not in the disassembly")
    out, last = [], 0
    for line in body.splitlines():
        if m := _LABEL.match(line.strip()):
            out.append((last + 1, ":" + m.group(1), ""))
        elif m := _INSTRUCTION.search(line):
            last = int(m.group(1), 16)
            out.append((last, m.group(2), m.group(3).strip()))
    return out


def inner_loop(code: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The instructions of the loop (a backward branch to a label) with the most MUFU.EX2; of
    loops with as many, the shortest. A span that holds another such loop is not one: ptxas puts
    a barrier wait's retry after the code and branches back into it, a span over both consumer
    warpgroups' loops (MosaicAttention.consumer_warpgroups) is no loop of either."""
    labels = {op[1:]: addr for addr, op, _ in code if op.startswith(":")}
    loops = []
    for addr, op, operands in code:
        if not op.startswith("BRA"):
            continue
        target = _TARGET.search(operands)
        start = labels.get(target.group(1)) if target else None
        if start is None or start > addr:
            continue
        body = [c for c in code if start <= c[0] <= addr and not c[1].startswith(":")]
        exps = sum(c[1].startswith("MUFU.EX2") for c in body)
        if exps:
            loops.append((start, addr, exps, body))

    def holds_another(a):
        return any(b is not a and a[0] <= b[0] and b[1] <= a[1] for b in loops)

    inner = [loop for loop in loops if not holds_another(loop)]
    if not inner:
        raise ValueError("no loop with an exponential in the kernel")
    return max(inner, key=lambda loop: (loop[2], -len(loop[3])))[3]


def mix(loop: list[tuple[int, str, str]]) -> dict[str, Any]:
    """Counts by class, instructions per exponential, and the issue-bound share of the
    exponential unit's peak (8 / instructions per exponential, at most 1)."""
    counts = dict.fromkeys(CLASSES, 0)
    for _, op, _ in loop:
        counts[classify(op)] += 1
    exps = counts["exp"]
    per_exp = {k: v / exps for k, v in counts.items()}
    total = sum(counts.values()) / exps
    return dict(
        counts=counts,
        per_exp=per_exp,
        instructions_per_exp=total,
        issue_bound_exp_share=min(1.0, 8 / total),
    )


def tools() -> dict[str, str] | None:
    """ptxas and nvdisasm of CUDA 13 (the nvidia-cuda-nvcc and -nvdisasm wheels), or None."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        found = {t: os.path.join(root, "cu13", "bin", t) for t in ("ptxas", "nvdisasm")}
        if all(os.path.exists(p) for p in found.values()):
            return found
    return None


def missing() -> str | None:
    """Why the proxy cannot run here, or None."""
    if tools() is None:
        return "CUDA 13's ptxas and nvdisasm are not installed (pip install -e '.[targets]')"
    return targets.missing("h100")


# The Mosaic forwards by option: two rows a program (the shared bias's tiles read once for both),
# two consumer warpgroups on one producer's slots, persistent (one program per multiprocessor).
_FORWARDS = dict(
    r2=dict(rows_per_program=2),
    c2=dict(consumer_warpgroups=2),
    p1=dict(persistent=True),
    c2p1=dict(consumer_warpgroups=2, persistent=True),
)


def _program(kernel: str):
    """(fn, abstract args) of the kernel's forward at SHAPE."""
    import jax
    import jax.numpy as jnp

    import gated_attention as ga

    b, t, n, _ = SHAPE
    _, h, dtype = KERNELS[kernel]
    sd = jax.ShapeDtypeStruct
    qkv, bias = sd((b, t, n, h), jnp.dtype(dtype)), sd((1, n, t, t), jnp.dtype(dtype))
    mask = sd((b, 1, 1, t), jnp.bool_)
    if kernel.startswith("ours_"):
        impl, _, backward = kernel.removeprefix("ours_").partition("_")
        if backward in _FORWARDS:  # a forward with some of MosaicAttention's options
            impl, backward = ga.MosaicAttention(**_FORWARDS[backward]), ""
        elif backward == "fused":
            impl = ga.PallasAttention(fused_backward=True)
        fn = lambda q, k, v, b_, m: ga.dot_product_attention(q, k, v, b_, m, implementation=impl)
        if backward:  # the cotangent an argument, as in a training step
            op = fn
            fn = lambda q, k, v, b_, m, do: jax.vjp(lambda *x: op(*x, m), q, k, v, b_)[1](do)
            return fn, (qkv, qkv, qkv, bias, mask, qkv)
    elif kernel == "colabfold_tri_flash":
        from colabfold_kernels.tri_flash import pallas_attention

        def fn(q, k, v, b_, m):
            heads = lambda x: jnp.swapaxes(x, 1, 2)  # AF2's projections write [b, h, S, c]
            mask_bias = 1e9 * (m.astype(q.dtype) - 1.0)
            return heads(
                pallas_attention(heads(q), heads(k), heads(v), mask_bias, b_[0], scale=h**-0.5)
            )
    elif kernel.startswith("tokamax_"):
        import tokamax

        impl = kernel.removeprefix("tokamax_")
        fn = lambda q, k, v, b_, m: tokamax.dot_product_attention(
            q, k, v, b_, m, implementation=impl
        )
    elif kernel == "jax_attention_mgpu":
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        config = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
        fn = lambda q, k, v, b_, m: attention_mgpu.attention(q, k, v, config)
    else:
        raise ValueError(f"kernel must be one of {tuple(KERNELS)}, got {kernel!r}")
    return fn, (qkv, qkv, qkv, bias, mask)


class _Runtime:  # attention_mgpu reads the CUDA runtime's version while tracing
    @staticmethod
    def cuda_runtime_get_version() -> int:
        return 12090


def _program_key(kernel: str) -> str:
    """Kernels read from one compiled program share a key: a backward's two kernels, its vjp."""
    for suffix in ("_dkdv", "_dq_dbias"):
        if kernel.endswith(suffix):
            return kernel.removesuffix(suffix) + "_backward"
    return kernel


def kernels_ptx(kernels: list[str]) -> dict[str, str]:
    """{kernel: the PTX of its module, or 'error: ...'} compiled for an H100, each program once
    (a child's function: Mosaic GPU's PTX dump is read from this process's stdout, XLA's from
    its dump folder)."""
    from unittest import mock

    runtime = mock.patch("jax.experimental.pallas.ops.gpu.attention_mgpu.cuda_versions", _Runtime)
    out: dict[str, str] = {}
    by_program: dict[str, list[str]] = {}
    for kernel in kernels:
        by_program.setdefault(_program_key(kernel), []).append(kernel)
    for group in by_program.values():
        try:
            fn, args = _program(group[0])
            with tempfile.TemporaryDirectory() as dump, child.printed((1,)) as text, runtime:
                targets.compile(fn, *args, target="h100", dump_to=dump)
                paths = sorted(glob.glob(os.path.join(dump, "*.ptx")))
                modules = [Path(p).read_text() for p in paths]
        except Exception as e:  # a peer that does not compile here: its rows say why
            out.update({k: f"error: {reason(e)}" for k in group})
            continue
        printed = text[0].split("// Generated by LLVM NVPTX Back-End")[1:]
        modules += ["//\n// Generated by LLVM NVPTX Back-End" + m for m in printed]  # Mosaic GPU's
        for kernel in group:
            entry = KERNELS[kernel][0]
            found = [
                m for m in modules if (f".entry {entry}(" in m if entry else "ex2.approx" in m)
            ]
            out[kernel] = found[0] if found else f"error: {kernel}: no PTX with its kernel dumped"
    return out


def sass(ptx: str) -> str:
    """nvdisasm's disassembly of the PTX assembled for sm_90a."""
    paths = tools()
    with tempfile.TemporaryDirectory() as work:
        src, cubin = os.path.join(work, "k.ptx"), os.path.join(work, "k.cubin")
        Path(src).write_text(ptx)
        subprocess.run(
            [paths["ptxas"], "-arch=sm_90a", src, "-o", cubin], check=True, capture_output=True
        )
        return subprocess.run(
            [paths["nvdisasm"], "-c", cubin], check=True, capture_output=True, text=True
        ).stdout


def measure(kernels: list[str]) -> list[dict[str, Any]]:
    """Each kernel's inner-loop mix, or {kernel, error}: all compiled in one child with Mosaic
    GPU's PTX dump on (the compilers start once)."""
    dump = {"MOSAIC_GPU_DUMP_PTX": "1"}
    ptx = targets.in_child(f"{_MODULE}:kernels_ptx", dict(kernels=kernels), env=dump)
    rows = []
    for kernel in kernels:
        if ptx[kernel].startswith("error: "):
            rows.append(dict(kernel=kernel, error=ptx[kernel].removeprefix("error: ")))
            continue
        try:
            code = parse_sass(sass(ptx[kernel]), KERNELS[kernel][0])
            _, head_dim, dtype = KERNELS[kernel]
            rows.append(
                dict(kernel=kernel, head_dim=head_dim, dtype=dtype, **mix(inner_loop(code)))
            )
        except Exception as e:  # ptxas refused it, or no loop with an exponential
            rows.append(dict(kernel=kernel, error=reason(e)))
    return rows


def reason(e: BaseException) -> str:
    """The last error line of an exception (a child's carries its whole log)."""
    lines = [x.strip() for x in str(e).splitlines() if re.match(r"\s*\w+(Error|Exception):", x)]
    return lines[-1][:300] if lines else f"{type(e).__name__}: {str(e)[:300]}"


def markdown(rows: list[dict[str, Any]], results: dict[str, Any] | None = None) -> str:
    made = f" (jax {results['jax']}, ptxas {results['ptxas']})" if results else ""
    lines = [
        f"Inner loop of each kernel (the forwards; our backward's dk/dv and dq/bias-gradient "
        f"kernels), sm_90a SASS{made}, AF2's MSA row shape "
        f"{list(SHAPE)[:3]} at the head dim and dtype given; per exponential (one per attention "
        "score).",
        "",
        "| kernel | head dim, dtype | instructions / exp | issue-bound % of exp peak | "
        + " | ".join(CLASSES[1:])
        + " |",
        "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in CLASSES[1:]) + " |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['error'][:150]} |")
            continue
        per = " | ".join(f"{r['per_exp'][c]:.2f}" for c in CLASSES[1:])
        lines.append(
            f"| {r['kernel']} | {r['head_dim']}, {r['dtype']} | {r['instructions_per_exp']:.2f} | "
            f"{100 * r['issue_bound_exp_share']:.0f} | {per} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for results.json and results.md")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated")
    args = parser.parse_args(argv)
    why = missing()
    if why:
        sys.exit(f"sass_proxy: {why}")
    rows = measure(args.kernels.split(","))
    import jax

    ptxas = subprocess.run([tools()["ptxas"], "--version"], capture_output=True, text=True)
    results = dict(jax=jax.__version__, ptxas=ptxas.stdout.strip().splitlines()[-1], rows=rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(markdown(rows, results))
    print(markdown(rows, results))
    print(f"wrote {(out / 'results.json').resolve()} and {(out / 'results.md').resolve()}")


if __name__ == "__main__":
    main()
