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
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import operator
import os
import stat
import zipfile
import zlib
from collections.abc import Mapping
from typing import IO, Any

import jax
import numpy as np

from gated_attention import numerics

SEPARATOR = "//"  # Between a scope and a parameter name in checkpoint keys.
TOP_LEVEL_SCOPE = "~"  # Haiku's scope for parameters created outside any module.
_NPY_MAGIC = b"\x93NUMPY"
_MAX_LISTED = 10  # How many available scopes an error message lists.
_CHUNK = 1 << 20  # Bytes read at a time when checking a member's CRC-32.
_TEMP_ATTEMPTS = 100  # Unique temporary names tried before giving up (as tempfile does).

PathOrFile = str | os.PathLike | IO[bytes]
Params = dict[str, dict[str, np.ndarray]]
Shape = tuple[int, ...]


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
    source = _describe(path_or_file)
    with _open_npz(path_or_file, source) as archive:
        members = _members(archive, source)
        selected = _select(members, prefix, source)
        _check_members_intact(archive, selected, source)
        headers = {k: _read_header(archive, m, source) for k, m in selected.items()}
        if layer is not None:
            _check_layer_in_range(layer, headers, prefix, source)
        params: Params = {}
        for key, member in selected.items():
            scope, name = _split_key(key, source)
            arr = _read_array(archive, member, headers[key], layer)
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
        _save_npz_atomically(os.fsdecode(path), flat)


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


# ---------------------------------------------------------------------------- archive writing


def _save_npz_atomically(path: str, flat: dict[str, np.ndarray]) -> None:
    """np.savez into a temporary file beside `path`, synced, then renamed over it."""
    source = _describe(path)
    target = os.path.realpath(path)  # Through a symlink, as open() goes: the link stays a link.
    directory = os.path.dirname(target)
    _check_save_target(path, target, source)
    try:
        fd, temp = _create_temp(target)
        try:
            with os.fdopen(fd, "wb") as f:
                _keep_mode(target, f.fileno())
                np.savez(f, **flat)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, target)
        except BaseException:
            _remove_quietly(temp)
            raise
        _fsync_directory(directory)
    except PermissionError as e:
        raise PermissionError(
            e.errno,
            f"cannot save AF2 checkpoint {source}: {e.strerror or e}; saving writes a temporary "
            f"file in {directory!r} and renames it over the checkpoint, so that directory must be "
            "writable",
        ) from e


def _check_save_target(path: str, target: str, source: str) -> None:
    if not os.path.basename(path) or os.path.isdir(target):
        raise ValueError(
            f"path {source} is a directory; expected a file path such as 'params_model_1.npz'"
        )
    directory = os.path.dirname(target)
    if not os.path.isdir(directory):
        raise ValueError(
            f"path {source} lies in {directory!r}, which is not an existing directory; expected a "
            "path in an existing directory (create it first)"
        )
    if os.path.exists(target) and not os.access(target, os.W_OK):
        raise PermissionError(
            errno.EACCES,
            f"AF2 checkpoint {source} is read-only; saving over it needs write permission on it",
        )


def _create_temp(target: str) -> tuple[int, str]:
    """Creates '.NAME.RANDOM.tmp' beside `target` with the mode open() gives (0o666 & ~umask)."""
    directory, name = os.path.split(target)
    for _ in range(_TEMP_ATTEMPTS):
        temp = os.path.join(directory, f".{name}.{os.urandom(6).hex()}.tmp")
        with contextlib.suppress(FileExistsError):
            # Not mkstemp: its 0o600 could only be widened by reading the process-wide umask.
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), temp
    raise FileExistsError(
        errno.EEXIST, f"no unused temporary name beside {target!r} after {_TEMP_ATTEMPTS} tries"
    )


def _keep_mode(target: str, fd: int) -> None:
    """Gives the new file the mode of the checkpoint it replaces, as writing into it would keep."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        return
    os.fchmod(fd, mode)


def _remove_quietly(temp: str) -> None:
    with contextlib.suppress(OSError):  # The error being raised says more than a failed cleanup.
        os.unlink(temp)


def _fsync_directory(directory: str) -> None:
    """Makes the rename itself durable; some filesystems cannot sync a directory (EINVAL, EBADF)."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- archive reading


def _describe(path_or_file: PathOrFile) -> str:
    if isinstance(path_or_file, (str, os.PathLike)):
        return repr(os.fspath(path_or_file))
    return f"file object {getattr(path_or_file, 'name', type(path_or_file).__name__)!r}"


def _open_npz(path_or_file: PathOrFile, source: str) -> zipfile.ZipFile:
    if isinstance(path_or_file, (str, os.PathLike)):
        path = os.fspath(path_or_file)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"AF2 checkpoint {source} not found: expected an .npz file "
                "such as params_model_1.npz"
            )
        with open(path, "rb") as f:
            head = f.read(len(_NPY_MAGIC))
    elif hasattr(path_or_file, "read") and hasattr(path_or_file, "seek"):
        start = path_or_file.tell()
        head = path_or_file.read(len(_NPY_MAGIC))
        path_or_file.seek(start)
    else:
        raise TypeError(
            f"path_or_file must be a path or a seekable binary file object, got {path_or_file!r}"
        )
    expected = "expected an .npz archive of 'scope//name' arrays written by np.savez"
    if head == _NPY_MAGIC:
        raise ValueError(f"{source} is a .npy file (a single array); {expected}")
    try:
        return zipfile.ZipFile(path_or_file)
    except zipfile.BadZipFile:
        raise ValueError(f"{source} is not an .npz (zip) archive; {expected}") from None


def _members(archive: zipfile.ZipFile, source: str) -> dict[str, str]:
    """Maps each key of the archive to its member name ('key.npy')."""
    members = {}
    for member in archive.namelist():
        if not member.endswith(".npy"):
            raise ValueError(
                f"{source} holds {member!r}, which is not a .npy array; expected an "
                ".npz archive written by np.savez"
            )
        key = member[: -len(".npy")]
        _split_key(key, source)
        members[key] = member
    return members


def _check_members_intact(archive: zipfile.ZipFile, selected: dict[str, str], source: str) -> None:
    """Reads each member to its end, where zipfile compares its CRC-32, one chunk at a time."""
    for key, member in selected.items():
        try:
            if archive.getinfo(member).header_offset < 0:  # zipfile's shift for missing bytes.
                raise zipfile.BadZipFile("bytes are missing before its data")
            with archive.open(member) as fp:
                while fp.read(_CHUNK):
                    pass
        # A damaged central directory entry: zipfile's NotImplementedError (an unknown
        # compression method) or RuntimeError (an encryption flag), as damaged as a bad CRC.
        except (zipfile.BadZipFile, EOFError, zlib.error, NotImplementedError, RuntimeError) as e:
            raise ValueError(
                f"{source} is damaged: the data of key {key!r} (member {member!r}) fails its check "
                f"({e}); expected an intact .npz archive whose members match their CRC-32 "
                "(re-download or re-save the checkpoint)"
            ) from None


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


def _parse_header(fp: IO[bytes]) -> tuple[Shape, bool, np.dtype] | None:
    """Reads a .npy header: (shape, fortran_order, dtype), or None for a rare header version."""
    version = np.lib.format.read_magic(fp)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(fp)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(fp)
    return None


def _read_header(archive: zipfile.ZipFile, member: str, source: str) -> tuple:
    """Returns (shape, fortran_order, dtype) of a .npy member, reading no data when it can."""
    with archive.open(member) as fp:
        header = _parse_header(fp)
    if header is None:
        with archive.open(member) as fp:  # Read the array to learn its shape.
            arr = np.lib.format.read_array(fp, allow_pickle=False)
        header = arr.shape, False, arr.dtype
    if header[2].hasobject:
        raise ValueError(
            f"{member!r} in {source} holds Python objects (dtype {header[2]}); "
            "expected numeric arrays"
        )
    return header


def _read_array(
    archive: zipfile.ZipFile, member: str, header: tuple, layer: int | None
) -> np.ndarray:
    """Reads a member, or only its slice `layer` of the leading axis when it is C-ordered."""
    shape, fortran_order, dtype = header
    with archive.open(member) as fp:
        if layer is None or fortran_order or _parse_header(fp) is None:
            fp.seek(0)
            arr = np.lib.format.read_array(fp, allow_pickle=False)
            return arr if layer is None else arr[layer].copy()
        nbytes = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
        fp.seek(fp.tell() + layer * nbytes)
        data = fp.read(nbytes)
    assert len(data) == nbytes, (member, len(data), nbytes)
    return np.frombuffer(data, dtype=dtype).reshape(shape[1:]).copy()


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
