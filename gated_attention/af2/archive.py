"""The .npz archive as a file: written atomically, read member by member, checked whole.

np.savez writes the archive, and `save_npz_atomically` puts it at a path without ever destroying
the file already there: a hidden temporary file beside it ('.NAME.RANDOM.tmp', created with the
mode open() gives), flushed and fsynced, renamed over the path with os.replace and the directory
fsynced; any error or interrupt before the rename removes the temporary file. Reading opens the zip
(`open_npz`: a path or a seekable file object, a .npy file or a non-zip refused), lists its .npy
members (`members`), reads each selected member to its end so that zipfile checks its CRC-32
(`check_members_intact`), then reads .npy headers and arrays, or one slice of a C-ordered array's
leading axis without reading the rest (`read_header`, `read_array`). What the keys mean (AF2's
'scope//name', prefixes, layers) is params.py's business; the messages here name the file as the
AF2 checkpoint it holds for that caller.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import zipfile
import zlib
from collections.abc import Callable
from typing import IO, Any

import numpy as np

_NPY_MAGIC = b"\x93NUMPY"
_CHUNK = 1 << 20  # Bytes read at a time when checking a member's CRC-32.
_TEMP_ATTEMPTS = 100  # Unique temporary names tried before giving up (as tempfile does).

PathOrFile = str | os.PathLike | IO[bytes]
Shape = tuple[int, ...]


# ---------------------------------------------------------------------------- archive writing


def save_npz_atomically(path: str, flat: dict[str, np.ndarray]) -> None:
    """np.savez into a temporary file beside `path`, synced, then renamed over it."""
    source = describe(path)
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


def describe(path_or_file: PathOrFile) -> str:
    """How messages name the archive: a path's repr, or a file object's name (or type)."""
    if isinstance(path_or_file, (str, os.PathLike)):
        return repr(os.fspath(path_or_file))
    return f"file object {getattr(path_or_file, 'name', type(path_or_file).__name__)!r}"


def open_npz(path_or_file: PathOrFile, source: str) -> zipfile.ZipFile:
    """The zip archive at a path or in a seekable binary file object (its position kept), or
    FileNotFoundError, TypeError or ValueError (a .npy file, not a zip) naming `source`."""
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


def members(
    archive: zipfile.ZipFile, source: str, check_key: Callable[[str], Any]
) -> dict[str, str]:
    """Maps each key of the archive to its member name ('key.npy'), calling check_key(key) on
    each in the archive's order (the caller's rule for keys, which raises on a bad one)."""
    members = {}
    for member in archive.namelist():
        if not member.endswith(".npy"):
            raise ValueError(
                f"{source} holds {member!r}, which is not a .npy array; expected an "
                ".npz archive written by np.savez"
            )
        key = member[: -len(".npy")]
        check_key(key)
        members[key] = member
    return members


def check_members_intact(archive: zipfile.ZipFile, selected: dict[str, str], source: str) -> None:
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


def _parse_header(fp: IO[bytes]) -> tuple[Shape, bool, np.dtype] | None:
    """Reads a .npy header: (shape, fortran_order, dtype), or None for a rare header version."""
    version = np.lib.format.read_magic(fp)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(fp)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(fp)
    return None


def read_header(archive: zipfile.ZipFile, member: str, source: str) -> tuple:
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


def read_array(
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
