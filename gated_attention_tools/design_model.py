"""ColabDesign's design models as the tests and the design benchmark build them: through its own
API (`mk_afdesign_model`, `prep_inputs`, `run`), on random parameters with every weight drawn
(gated_attention.colabdesign.random_params), with a target structure made here (an ideal helix
per chain: a PDB file ColabDesign reads as it reads any).

CASES names the protocols as users run them: hallucination (model_3_ptm, or model_1_multimer),
fixbb (redesign of a given backbone), binder (model_1_ptm with the target as template) and
binder_multimer (model_1_multimer with templates: BindCraft's). `blocks` shrinks every stack (the
Evoformer's, the extra MSA's, the template pair stack's and the structure module's layers, at
least 2) for tests that compile on 2 cores; None keeps AF2's depth. The loss: each protocol's
default weights, and pLDDT and PAE at 0.1 each.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import numpy as np

CASES = {
    "hallucination": dict(protocol="hallucination"),
    "hallucination_multimer": dict(protocol="hallucination", use_multimer=True),
    "fixbb": dict(protocol="fixbb"),
    "binder": dict(protocol="binder"),
    "binder_multimer": dict(protocol="binder", use_multimer=True),
}
BINDER_SHARE = 4  # the binder protocol's binder: a quarter of the residues, the rest the target

# An ideal alpha helix: per residue 100 degrees and 1.5 A along z; (radius A, angle offset
# degrees, z offset A) of each backbone atom and the C-beta about the helix axis.
_HELIX_ATOMS = {
    "N": (1.55, -28.0, -0.9),
    "CA": (2.3, 0.0, 0.0),
    "C": (1.6, 28.0, 0.9),
    "O": (1.8, 40.0, 2.0),
    "CB": (3.3, 0.0, -0.6),
}


def helix_pdb(path: str, chains: dict[str, int]) -> str:
    """Writes a PDB file with one ideal alanine helix per chain (chain id -> residues), the
    chains 12 A apart along x; returns the path."""
    lines, serial = [], 1
    for c, (chain, length) in enumerate(chains.items()):
        for i in range(length):
            for atom, (radius, offset, dz) in _HELIX_ATOMS.items():
                angle = np.deg2rad(100.0 * i + offset)
                x, y, z = 12.0 * c + radius * np.cos(angle), radius * np.sin(angle), 1.5 * i + dz
                lines.append(
                    f"ATOM  {serial:5d}  {atom:<3s} ALA {chain}{i + 1:4d}    "
                    f"{x:8.3f}{y:8.3f}{z:8.3f}  1.00  0.00           {atom[0]}"
                )
                serial += 1
        lines.append("TER")
    with open(path, "w") as f:
        f.write("\n".join([*lines, "END", ""]))
    return path


def _shrink(cfg: Any, blocks: int) -> None:
    e = cfg.model.embeddings_and_evoformer
    e.evoformer_num_block = e.extra_msa_stack_num_block = blocks
    e.template.template_pair_stack.num_block = blocks
    cfg.model.heads.structure_module.num_layer = max(blocks, 2)  # one layer: no loss on it


def build(
    case: str,
    length: int,
    *,
    bfloat16: bool = True,
    blocks: int | None = None,
    seed: int = 0,
    params: bool = True,
) -> Any:
    """A prepared ColabDesign model of `length` residues in all (the binder's share of them for
    the binder protocols), with random parameters (`params=False`: none set), ColabDesign's
    defaults otherwise (remat and dropout on, bfloat16 unless asked)."""
    import gated_attention as ga

    ga.colabdesign.adapt_colabdesign()
    from colabdesign import mk_afdesign_model

    if case not in CASES:
        raise ValueError(f"case must be one of {sorted(CASES)}, got {case!r}")
    # The weights' folder (empty) and the target's PDB file live only while the model is built.
    with tempfile.TemporaryDirectory(prefix="gated_attention_design_") as folder:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            model = mk_afdesign_model(**CASES[case], data_dir=folder)  # "'model_1_ptm' not found"
        model._cfg.model.global_config.bfloat16 = bfloat16
        if blocks is not None:
            _shrink(model._cfg, blocks)
        _prepare(model, CASES[case]["protocol"], length, folder)
    # The confidence losses too (BindCraft weighs them): one-block stacks leave the multimer
    # hallucination's default loss (contacts) at exactly 0, a loss that checks nothing.
    model.set_weights(plddt=0.1, pae=0.1, set_defaults=True)
    if params:
        model._model_params = [ga.colabdesign.random_params(model, seed)]
        model._model_names = ["random"]
    return model


def _prepare(model: Any, protocol: str, length: int, folder: str) -> None:
    """The protocol's prep_inputs: a length, or a helix PDB written into `folder`."""
    if protocol == "hallucination":
        model.prep_inputs(length=length)
    elif protocol == "fixbb":
        model.prep_inputs(pdb_filename=helix_pdb(f"{folder}/fixbb.pdb", {"A": length}), chain="A")
    else:
        binder = max(length // BINDER_SHARE, 1)
        target = helix_pdb(f"{folder}/target.pdb", {"A": length - binder})
        model.prep_inputs(pdb_filename=target, chain="A", binder_len=binder)


def design_step(model: Any, params: Any = None, seed: int = 0) -> tuple[float, np.ndarray]:
    """One design step through ColabDesign's `run` (its loss and its gradient with respect to the
    sequence, one model, no recycles), from `restart(seed)`: (loss, gradient)."""
    if params is not None:
        model._model_params = [params]
    model.restart(seed=seed)
    model.run(backprop=True)
    return float(model.aux["loss"]), np.asarray(model.aux["grad"]["seq"], np.float32)


def nudged(params: Any, scale: float, seed: int) -> Any:
    """params with every entry multiplied by 1 + scale * N(0, 1): the yardstick's model."""
    import jax

    rng = np.random.default_rng(seed)
    nudge = lambda x: (x * (1 + scale * rng.normal(size=x.shape))).astype(x.dtype)
    return jax.tree_util.tree_map(nudge, params)
