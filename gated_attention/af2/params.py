"""AlphaFold 2 .npz checkpoints <-> Haiku params.

An AF2 checkpoint (params_model_1.npz, ...) is a flat archive of arrays keyed 'scope//name', e.g.
'alphafold/alphafold_iteration/evoformer/evoformer_iteration/msa_row_attention_with_pair_bias/
attention//query_w' of shape [48, 256, 8, 32]: the 48 Evoformer blocks are stacked on a leading axis.
Haiku params are the same thing nested: {scope: {name: array}}.

Prefix rule. `prefix` selects the keys whose scope lies under it, matching whole '/' components, and
strips it together with the following '/':

  prefix '.../evoformer_iteration', scope '.../evoformer_iteration/msa_row_attention_with_pair_bias'
    -> scope 'msa_row_attention_with_pair_bias': the params of a module of that name created at the
       top level of hk.transform. So to load one module, pass its *parent* scope as the prefix.
  a scope equal to the prefix itself -> '~', the scope Haiku gives hk.get_parameter calls made at the
       top level, outside any module. This keeps the mapping lossless: saving with the same prefix
       writes those params back under the prefix.
  prefix 'a/b' does not select 'a/bc/...': components must match exactly.

`layer` then takes one slice of the stacked leading axis; only that slice is read from the file.

Example::

    prefix = 'alphafold/alphafold_iteration/evoformer/evoformer_iteration'
    params = load_af2_params('params_model_1.npz', prefix=prefix, layer=7)
    params['msa_row_attention_with_pair_bias/attention']['query_w'].shape  # (256, 8, 32)

    forward = hk.transform(lambda m, z, mask: MSARowAttentionWithPairBias(cfg, gcfg)(m, mask, z))
    shapes = jax.eval_shape(forward.init, jax.random.key(0), m, z, mask)
    params = {k: v for k, v in params.items() if k.startswith('msa_row_attention_with_pair_bias')}
    check_params(params, shapes)  # ValueError listing every missing/unexpected/mis-shaped param
    out = forward.apply(cast_params(params, m.dtype), None, m, z, mask)

    save_af2_params(params, 'layer7.npz', prefix=prefix)  # the same key layout, unstacked

The archive as a file (the atomic save, the CRC-32 checks, reading one layer of a member) is
archive.py's; this module holds the checkpoint format: keys, scopes, prefixes, layers.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from gated_attention.af2 import archive as archive_lib
from gated_attention.core import numerics

SEPARATOR = "//"  # Between a scope and a parameter name in checkpoint keys.
TOP_LEVEL_SCOPE = "~"  # Haiku's scope for parameters created outside any module.
_MAX_LISTED = 10  # How many available scopes an error message lists.

PathOrFile = archive_lib.PathOrFile
Params = dict[str, dict[str, np.ndarray]]
Shape = archive_lib.Shape


def load_af2_params(
    path_or_file: PathOrFile, *, prefix: str | None = None, layer: int | None = None
) -> Params:
    """Loads an AF2 .npz checkpoint (or the part of it under `prefix`) as Haiku params.

    Args:
      path_or_file: path of the .npz file, or a seekable binary file object holding one.
      prefix: scope prefix to select and strip (whole '/' components; see the module docstring).
        None selects every key.
      layer: index into the stacked leading axis shared by all selected arrays, or None for all.

    Returns:
      {scope: {name: np.ndarray}}; with `layer`, each array is [...] instead of [layers, ...].

    Every selected member is read once in full, before any array is built, so that zipfile checks
    its CRC-32: a damaged archive fails whole instead of returning wrong numbers. This reads the
    selected members' data once more than the arrays need (with `layer`, all of it, not one slice),
    1 MiB at a time.

    Raises:
      FileNotFoundError: the path does not exist.
      ValueError: not an .npz archive (a truncated file is not one), a member whose data fails its
        CRC-32 or ends early (the message names the file and the 'scope//name' key), a key without
        '//', a prefix that selects nothing, a layer out of range or a layer for arrays without a
        common leading axis.
      TypeError: layer is not an int.
    """
    prefix = _check_prefix(prefix)
    layer = _check_layer(layer)
    source = archive_lib.describe(path_or_file)
    with archive_lib.open_npz(path_or_file, source) as archive:
        members = archive_lib.members(archive, source, lambda key: _split_key(key, source))
        selected = _select(members, prefix, source)
        archive_lib.check_members_intact(archive, selected, source)
        headers = {k: archive_lib.read_header(archive, m, source) for k, m in selected.items()}
        if layer is not None:
            _check_layer_in_range(layer, headers, prefix, source)
        params: Params = {}
        for key, member in selected.items():
            scope, name = _split_key(key, source)
            arr = archive_lib.read_array(archive, member, headers[key], layer)
            params.setdefault(_strip_prefix(scope, prefix), {})[name] = arr
    return dict(sorted(params.items()))


def save_af2_params(
    params: Mapping[str, Mapping[str, Any]], path: PathOrFile, *, prefix: str | None = None
) -> None:
    """Writes Haiku params as an AF2-style .npz archive ('scope//name' keys, np.savez).

    Saving to a path never destroys the checkpoint already there: the archive is written to a hidden
    temporary file in the same directory ('.NAME.RANDOM.tmp'), flushed and fsynced, then renamed
    over `path` with os.replace (atomic on POSIX filesystems) and the directory is fsynced. Any
    error or interrupt (KeyboardInterrupt included) before the rename removes the temporary file
    and leaves the old checkpoint byte for byte; one after it (syncing the directory) leaves the new
    one. Only a killed process leaves its temporary file behind, never a partial `path`. The file
    gets the permissions open() would give it: an existing checkpoint's mode is kept, a new one
    gets 0o666 & ~umask. A symlink is followed, as open() does: the file it names is replaced.
    Writing to a file object is the caller's business: the archive is written into it as it is.

    Args:
      params: {scope: {name: array}}, numpy or jax arrays (fetched to host).
      path: file path (written exactly there: no '.npz' is appended) or a binary file object.
      prefix: prepended to every scope as 'prefix/scope'; scope '~' is written as the prefix itself.

    Raises:
      ValueError: a scope or name that cannot round-trip, a dtype .npy cannot store (bfloat16:
        cast first with cast_params(params, np.float32)), or a path that is a directory or whose
        directory does not exist.
      PermissionError: the checkpoint is read-only, or its directory is not writable (the
        temporary file and the rename need it); the message names the path.
    """
    prefix = _check_prefix(prefix)
    flat = {}
    for (scope, name), leaf in _flatten(params, "params").items():
        _check_scope_and_name(scope, name)
        arr = np.asarray(jax.device_get(leaf))
        if arr.dtype.kind in "VO":
            raise ValueError(
                f"params[{scope!r}][{name!r}] has dtype {arr.dtype}, which .npz cannot store "
                "portably; cast it first, e.g. cast_params(params, np.float32)"
            )
        flat[_join_prefix(prefix, scope) + SEPARATOR + name] = arr
    if hasattr(path, "write"):
        np.savez(path, **flat)
    else:
        archive_lib.save_npz_atomically(os.fsdecode(path), flat)


@dataclasses.dataclass(frozen=True)
class ParamsDiff:
    """Differences between a params tree and the expected one, keyed 'scope//name'.

    Attributes:
      missing: (key, expected shape) for each expected param absent from params.
      unexpected: (key, shape) for each param that is not expected.
      mis_shaped: (key, shape, expected shape) for each param whose shape differs.
    """

    missing: list[tuple[str, Shape]]
    unexpected: list[tuple[str, Shape]]
    mis_shaped: list[tuple[str, Shape, Shape]]

    @property
    def ok(self) -> bool:
        """True when params and expected have the same keys and shapes."""
        return not (self.missing or self.unexpected or self.mis_shaped)

    def __str__(self) -> str:
        if self.ok:
            return "params match expected"
        counts = (
            f"{len(self.missing)} missing, {len(self.unexpected)} unexpected, "
            f"{len(self.mis_shaped)} mis-shaped"
        )
        lines = [f"params differ from expected: {counts}"]
        lines += [f"  missing     {k} (expected shape {s})" for k, s in self.missing]
        lines += [f"  unexpected  {k} (shape {s})" for k, s in self.unexpected]
        lines += [f"  mis-shaped  {k}: shape {s}, expected {e}" for k, s, e in self.mis_shaped]
        return "\n".join(lines)


def diff_params(
    params: Mapping[str, Mapping[str, Any]], expected: Mapping[str, Mapping[str, Any]]
) -> ParamsDiff:
    """Compares keys and shapes of two {scope: {name: array}} trees without raising.

    Args:
      params: the params to check (arrays, or anything with a .shape).
      expected: the reference tree, e.g. jax.eval_shape(transformed.init, rng, *inputs), whose
        leaves may be jax.ShapeDtypeStruct.

    Returns:
      A ParamsDiff; its `ok` is True when nothing differs. Entries are sorted by key.
    """
    got = {_key(s, n): _shape(x) for (s, n), x in _flatten(params, "params").items()}
    want = {_key(s, n): _shape(x) for (s, n), x in _flatten(expected, "expected").items()}
    return ParamsDiff(
        missing=[(k, want[k]) for k in sorted(want.keys() - got.keys())],
        unexpected=[(k, got[k]) for k in sorted(got.keys() - want.keys())],
        mis_shaped=[
            (k, got[k], want[k]) for k in sorted(got.keys() & want.keys()) if got[k] != want[k]
        ],
    )


def check_params(
    params: Mapping[str, Mapping[str, Any]], expected: Mapping[str, Mapping[str, Any]]
) -> None:
    """Raises ValueError listing every missing, unexpected and mis-shaped param (see diff_params)."""
    diff = diff_params(params, expected)
    if not diff.ok:
        raise ValueError(str(diff))


def cast_params(params: Any, dtype: Any) -> Any:
    """Casts every floating-point leaf of a params tree to `dtype`; other leaves are unchanged."""
    return numerics.cast_floats(params, dtype)


# ---------------------------------------------------------------------------- argument checks


def _check_prefix(prefix: str | None) -> str | None:
    if prefix is None:
        return None
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str or None, got {prefix!r}")
    stripped = prefix.strip("/")
    if not stripped or SEPARATOR in stripped:
        raise ValueError(
            f"prefix must be a non-empty scope path without '{SEPARATOR}' such as "
            f"'alphafold/alphafold_iteration/evoformer/evoformer_iteration', got {prefix!r}"
        )
    return stripped


def _check_layer(layer: int | None) -> int | None:
    if layer is None:
        return None
    if isinstance(layer, bool):
        raise TypeError(f"layer must be an int or None, got {layer!r}")
    try:
        return operator.index(layer)
    except TypeError:
        raise TypeError(f"layer must be an int or None, got {layer!r}") from None


def _check_scope_and_name(scope: str, name: str) -> None:
    if not isinstance(scope, str) or not scope or SEPARATOR in scope or scope.strip("/") != scope:
        raise ValueError(
            f"params scope must be a non-empty str without '{SEPARATOR}' or "
            f"leading/trailing '/', got {scope!r}"
        )
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(
            f"params[{scope!r}] has parameter name {name!r}; expected a non-empty str without '/'"
        )


def _check_layer_in_range(layer: int, headers: dict, prefix: str | None, source: str) -> None:
    """Checks `layer` against the leading axis all selected arrays share."""
    by_leading: dict[int | None, list[str]] = {}
    for key, (shape, _, _) in headers.items():
        by_leading.setdefault(shape[0] if shape else None, []).append(key)
    where = f"under prefix {prefix!r} " if prefix else ""
    if len(by_leading) != 1 or None in by_leading:
        groups = "; ".join(
            f"{'scalar' if d is None else f'leading dim {d}'}: {len(keys)} arrays, e.g. "
            f"{keys[0]!r} {headers[keys[0]][0]}"
            for d, keys in sorted(
                by_leading.items(), key=lambda item: -1 if item[0] is None else item[0]
            )
        )
        raise ValueError(
            f"layer={layer} given, but the arrays {where}in {source} do not share a stacked "
            f"leading axis ({groups}); pass layer=None for unstacked params, or a prefix that "
            "selects only stacked layers"
        )
    (size,) = by_leading
    if not 0 <= layer < size:
        raise ValueError(
            f"layer={layer} is out of range: the arrays {where}in {source} stack "
            f"{size} layers (expected 0 <= layer < {size})"
        )


# ---------------------------------------------------------------------------- keys and scopes


def _split_key(key: str, source: str) -> tuple[str, str]:
    scope, sep, name = key.partition(SEPARATOR)
    if not sep or not scope or not name or SEPARATOR in name:
        raise ValueError(
            f"key {key!r} in {source} is not 'scope{SEPARATOR}name' with exactly one "
            f"'{SEPARATOR}' (e.g. 'alphafold/alphafold_iteration/evoformer/evoformer_iteration/"
            "msa_row_attention_with_pair_bias/attention//query_w')"
        )
    return scope, name


def _select(members: dict[str, str], prefix: str | None, source: str) -> dict[str, str]:
    if prefix is None:
        selected = members
    else:
        selected = {
            key: m for key, m in members.items() if _under(_split_key(key, source)[0], prefix)
        }
    if not selected:
        scopes = sorted({_split_key(key, source)[0] for key in members})
        raise ValueError(
            f"prefix {prefix!r} matches no key in {source}; {_nearby_scopes(prefix or '', scopes)}"
        )
    return dict(sorted(selected.items()))


def _under(scope: str, prefix: str) -> bool:
    return scope == prefix or scope.startswith(prefix + "/")


def _strip_prefix(scope: str, prefix: str | None) -> str:
    if prefix is None:
        return scope
    return TOP_LEVEL_SCOPE if scope == prefix else scope[len(prefix) + 1 :]


def _join_prefix(prefix: str | None, scope: str) -> str:
    if prefix is None:
        return scope
    return prefix if scope == TOP_LEVEL_SCOPE else f"{prefix}/{scope}"


def _nearby_scopes(prefix: str, scopes: list[str]) -> str:
    """Lists the scope prefixes one component below the longest matching part of `prefix`."""
    parts = prefix.split("/")
    depth = 0
    while depth < len(parts) and any(_under(s, "/".join(parts[: depth + 1])) for s in scopes):
        depth += 1
    base = "/".join(parts[:depth])
    options = sorted(
        {"/".join(s.split("/")[: depth + 1]) for s in scopes if not base or _under(s, base)}
    )
    more = f" and {len(options) - _MAX_LISTED} more" if len(options) > _MAX_LISTED else ""
    where = f"under {base!r}" if base else "top-level"
    return f"available {where} scope prefixes: {options[:_MAX_LISTED]}{more}"


# ---------------------------------------------------------------------------- trees


def _flatten(tree: Mapping[str, Mapping[str, Any]], argname: str) -> dict[tuple[str, str], Any]:
    """Flattens {scope: {name: leaf}} to {(scope, name): leaf}, checking it has two levels."""
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"{argname} must be a mapping {{scope: {{name: array}}}}, got {type(tree).__name__}"
        )
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    flat = {}
    for path, leaf in leaves:
        if len(path) != 2 or not all(isinstance(p, jax.tree_util.DictKey) for p in path):
            raise TypeError(
                f"{argname} must be a two-level mapping {{scope: {{name: array}}}}, "
                f"got a leaf at {jax.tree_util.keystr(path)}"
            )
        flat[(path[0].key, path[1].key)] = leaf
    return flat


def _key(scope: str, name: str) -> str:
    return f"{scope}{SEPARATOR}{name}"


def _shape(leaf: Any) -> Shape:
    return tuple(leaf.shape) if hasattr(leaf, "shape") else np.shape(leaf)
