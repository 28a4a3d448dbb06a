"""Faults around AF2 checkpoints: a save interrupted at any stage, or killed, leaves the old
checkpoint or the new one byte for byte; a damaged archive is refused whole on load."""

import errno
import io
import os
import re
import select
import signal
import stat
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from gated_attention.af2.params import load_af2_params, save_af2_params

NAME = "ckpt.npz"
TEMP_NAME = re.compile(r"\.ckpt\.npz\.[0-9a-f]{12}\.tmp")  # The hidden temporary file of a save.


def _params(seed):
    """Stacked params of ~100 KiB, so that a write interrupted after 4 KiB is mid-archive."""
    rng = np.random.default_rng(seed)
    return {
        "block/attention": {
            "query_w": rng.standard_normal((3, 64, 8, 16), dtype=np.float32),
            "output_b": rng.standard_normal((3, 64), dtype=np.float32),
        },
        "block": {"steps": np.arange(3, dtype=np.int32) + seed},
        "head": {"bias": rng.standard_normal(5)},
    }


def _assert_params_equal(loaded, expected):
    assert loaded.keys() == expected.keys()
    for scope, named in expected.items():
        assert loaded[scope].keys() == named.keys()
        for name, arr in named.items():
            assert loaded[scope][name].dtype == arr.dtype
            np.testing.assert_array_equal(loaded[scope][name], arr)


def _listing(directory):
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture
def old_checkpoint(tmp_path):
    """A good checkpoint at tmp_path/ckpt.npz, and its bytes."""
    path = tmp_path / NAME
    save_af2_params(_params(0), path)
    return path, path.read_bytes()


# ---------------------------------------------------------------------------- interrupted saves


class _WriteFailsOnce:
    """A file whose writes raise `exc` once `after` bytes are in, as Ctrl-C or a full disk would."""

    def __init__(self, f, exc, after):
        self._f, self._exc, self._after, self._written = f, exc, after, 0

    def write(self, data):
        if self._exc is not None and self._written + len(data) > self._after:
            self._f.write(bytes(data[: self._after - self._written]))
            exc, self._exc = self._exc, None
            raise exc
        self._written += len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _fail_creating(m, exc, _):
    real_open = os.open

    def fake_open(path, flags, *args, **kwargs):
        if flags & os.O_CREAT:
            raise exc
        return real_open(path, flags, *args, **kwargs)

    m.setattr(os, "open", fake_open)


def _fail_writing(m, exc, _):
    real_savez = np.savez
    m.setattr(np, "savez", lambda f, **arrays: real_savez(_WriteFailsOnce(f, exc, 4096), **arrays))


def _fail_syncing(is_target):
    def patch(m, exc, _):
        real_fsync = os.fsync

        def fake_fsync(fd):
            if is_target(os.fstat(fd).st_mode):
                raise exc
            return real_fsync(fd)

        m.setattr(os, "fsync", fake_fsync)

    return patch


def _fail_renaming(m, exc, _):
    def fake_replace(src, dst):
        raise exc

    m.setattr(os, "replace", fake_replace)


def _record_renamed_bytes(m, renamed):
    real_replace = os.replace

    def replace(src, dst):
        with open(src, "rb") as f:
            renamed.append(f.read())
        return real_replace(src, dst)

    m.setattr(os, "replace", replace)


def _fail_syncing_directory(m, exc, renamed):
    _record_renamed_bytes(m, renamed)
    _fail_syncing(stat.S_ISDIR)(m, exc, renamed)


STAGES = {  # stage: (patch(monkeypatch, exc, renamed), the checkpoint left at the path)
    "create_temp": (_fail_creating, "old"),
    "write": (_fail_writing, "old"),
    "fsync_file": (_fail_syncing(stat.S_ISREG), "old"),
    "rename": (_fail_renaming, "old"),
    "fsync_directory": (_fail_syncing_directory, "new"),
}
EXCEPTIONS = {
    "OSError": lambda: OSError(errno.EIO, "injected I/O error"),
    "KeyboardInterrupt": KeyboardInterrupt,
}


@pytest.mark.parametrize("exc_name", EXCEPTIONS)
@pytest.mark.parametrize("stage", STAGES)
def test_interrupted_save_leaves_old_or_new_checkpoint(
    old_checkpoint, monkeypatch, stage, exc_name
):
    path, old_bytes = old_checkpoint
    patch, left = STAGES[stage]
    exc = EXCEPTIONS[exc_name]()
    renamed = []
    with monkeypatch.context() as m:
        patch(m, exc, renamed)
        with pytest.raises(type(exc)) as raised:
            save_af2_params(_params(1), path)
    assert raised.value is exc

    assert _listing(path.parent) == [NAME]  # The temporary file is gone.
    if left == "old":
        assert path.read_bytes() == old_bytes
        _assert_params_equal(load_af2_params(path), _params(0))
    else:
        assert path.read_bytes() == renamed[0] != old_bytes
        _assert_params_equal(load_af2_params(path), _params(1))


def test_failed_check_before_writing_leaves_old_checkpoint(old_checkpoint):
    path, old_bytes = old_checkpoint
    with pytest.raises(ValueError, match="has dtype object"):
        save_af2_params({"a": {"w": np.array([None])}}, path)
    assert path.read_bytes() == old_bytes and _listing(path.parent) == [NAME]


_CHILD = """
import sys

import numpy as np

from gated_attention.af2.params import save_af2_params


class PausingFile:
    # Once `after` bytes are written, says so on stdout and waits (for SIGKILL) on stdin.

    def __init__(self, f, after):
        self.f, self.after, self.written = f, after, 0

    def write(self, data):
        if self.after is not None and self.written >= self.after:
            self.after = None
            sys.stdout.write("paused\\n")
            sys.stdout.flush()
            sys.stdin.read()
        self.written += len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


path, after, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
real_savez = np.savez
np.savez = lambda f, **arrays: real_savez(PausingFile(f, after), **arrays)
save_af2_params({"block": {"w": np.arange(size, dtype=np.float32).reshape(16, -1)}}, path)
"""


def test_save_killed_mid_write_leaves_old_checkpoint(old_checkpoint):
    path, old_bytes = old_checkpoint
    after, size = 32 << 20, 64 << 20  # Paused 32 MiB into a 256 MiB float32 array.
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(path), str(after), str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        ready, _, _ = select.select([child.stdout], [], [], 120)
        assert ready and child.stdout.readline() == b"paused\n", "the child did not start writing"
        (temp,) = [p for p in path.parent.iterdir() if p.name != NAME]
        assert TEMP_NAME.fullmatch(temp.name) and temp.stat().st_size >= after
        assert path.read_bytes() == old_bytes  # Mid-write, the old checkpoint is still there.
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdin.close()
        child.stdout.close()

    assert path.read_bytes() == old_bytes
    _assert_params_equal(load_af2_params(path), _params(0))
    (left,) = set(_listing(path.parent)) - {NAME}  # Nothing could remove it after SIGKILL.
    assert TEMP_NAME.fullmatch(left)


# ---------------------------------------------------------------------------- where a save goes


def test_path_is_written_exactly_and_file_objects_as_they_are(tmp_path):
    save_af2_params(_params(1), tmp_path / "ckpt")
    assert _listing(tmp_path) == ["ckpt"]  # No '.npz' appended, no temporary file left.
    _assert_params_equal(load_af2_params(tmp_path / "ckpt"), _params(1))

    buffer = io.BytesIO(b"caller's header")
    buffer.seek(0, io.SEEK_END)
    save_af2_params(_params(1), buffer)
    assert not buffer.closed and buffer.getvalue().startswith(b"caller's header")
    _assert_params_equal(load_af2_params(io.BytesIO(buffer.getvalue()[15:])), _params(1))


def test_new_file_gets_mode_open_gives_and_existing_keeps_its_mode(tmp_path):
    old_umask = os.umask(0o027)
    try:
        save_af2_params(_params(0), tmp_path / NAME)
        with open(tmp_path / "by_open", "wb"):
            pass
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / NAME).stat().st_mode) == 0o640
    assert stat.S_IMODE((tmp_path / "by_open").stat().st_mode) == 0o640

    os.chmod(tmp_path / NAME, 0o604)
    save_af2_params(_params(1), tmp_path / NAME)
    assert stat.S_IMODE((tmp_path / NAME).stat().st_mode) == 0o604


def test_save_through_symlink_replaces_the_file_it_names(old_checkpoint, tmp_path):
    path, _ = old_checkpoint
    links = tmp_path / "links"
    links.mkdir()
    (links / "latest.npz").symlink_to(path)

    save_af2_params(_params(1), links / "latest.npz")
    assert (links / "latest.npz").is_symlink() and _listing(links) == ["latest.npz"]
    assert _listing(tmp_path) == [NAME, "links"]
    _assert_params_equal(load_af2_params(path), _params(1))


# ---------------------------------------------------------------------------- bad save paths


def test_missing_directory_is_a_value_error_naming_path(tmp_path):
    (tmp_path / "file.txt").write_text("not a directory")
    for path in (tmp_path / "missing" / NAME, tmp_path / "file.txt" / NAME):
        with pytest.raises(
            ValueError,
            match=re.escape(repr(str(path))) + r" lies in .* which is not an existing directory",
        ):
            save_af2_params(_params(0), path)
    assert _listing(tmp_path) == ["file.txt"]


def test_directory_as_path_is_a_value_error(tmp_path):
    for path in (tmp_path, f"{tmp_path / 'sub'}/"):
        with pytest.raises(ValueError, match=r"is a directory; expected a file path"):
            save_af2_params(_params(0), path)
    assert _listing(tmp_path) == []


def test_unwritable_directory_is_a_permission_error_naming_path(old_checkpoint, monkeypatch):
    path, old_bytes = old_checkpoint

    def fake_open(temp, flags, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", temp)

    monkeypatch.setattr(os, "open", fake_open)  # As chmod 0o555 would, even for root.
    with pytest.raises(
        PermissionError,
        match=re.escape(
            f"cannot save AF2 checkpoint {str(path)!r}: Permission denied; saving writes"
        )
        + ".* so that directory must be writable",
    ) as raised:
        save_af2_params(_params(1), path)
    monkeypatch.undo()
    assert raised.value.errno == errno.EACCES
    assert path.read_bytes() == old_bytes and _listing(path.parent) == [NAME]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod 0o555 and 0o444")
def test_read_only_directory_and_file_are_permission_errors(old_checkpoint):
    path, old_bytes = old_checkpoint
    path.parent.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match=re.escape(repr(str(path)))):
            save_af2_params(_params(1), path)
    finally:
        path.parent.chmod(0o755)
    path.chmod(0o444)
    with pytest.raises(PermissionError, match=re.escape(repr(str(path))) + " is read-only"):
        save_af2_params(_params(1), path)
    assert path.read_bytes() == old_bytes and _listing(path.parent) == [NAME]


# ---------------------------------------------------------------------------- damaged archives


def _data_offset(data, member):
    """Where `member`'s stored bytes start: after its local header (30 bytes, name, extra)."""
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo(member)
    name_len, extra_len = np.frombuffer(data, "<u2", 2, info.header_offset + 26)
    return info.header_offset + 30 + int(name_len) + int(extra_len), info.file_size


@pytest.mark.parametrize("layer", [None, 0, 2])
def test_flipped_byte_is_a_value_error_naming_file_and_key(old_checkpoint, tmp_path, layer):
    path, data = old_checkpoint
    start, size = _data_offset(data, "block/attention//query_w.npy")
    damaged = bytearray(data)
    damaged[start + size - 1] ^= 0x01  # The last value of the last layer.
    (tmp_path / "damaged.npz").write_bytes(damaged)

    with pytest.raises(
        ValueError,
        match=re.escape(f"{str(tmp_path / 'damaged.npz')!r} is damaged: the data of key ")
        + r"'block/attention//query_w' \(member 'block/attention//query_w.npy'\) fails its check "
        r"\(Bad CRC-32.*\); expected an intact \.npz archive whose members match their CRC-32",
    ):
        load_af2_params(tmp_path / "damaged.npz", prefix="block", layer=layer)
    # Only the members a load selects are read, and checked.
    _assert_params_equal(
        load_af2_params(tmp_path / "damaged.npz", prefix="head"), {"~": _params(0)["head"]}
    )


@pytest.mark.parametrize("keep", [12, 0.25, 0.5, 0.9, -22, -1])
def test_truncated_checkpoint_is_a_value_error(old_checkpoint, tmp_path, keep):
    path, data = old_checkpoint
    cut = keep if isinstance(keep, int) else int(len(data) * keep)
    (tmp_path / "cut.npz").write_bytes(data[:cut])
    with pytest.raises(ValueError, match=r"cut\.npz' is not an \.npz \(zip\) archive"):
        load_af2_params(tmp_path / "cut.npz")


def test_member_cut_short_is_a_value_error_naming_key(old_checkpoint, tmp_path):
    path, data = old_checkpoint
    start, size = _data_offset(data, "block/attention//query_w.npy")
    (tmp_path / "short.npz").write_bytes(data[: start + size // 2] + data[start + size :])
    with pytest.raises(ValueError, match=r"short\.npz' is damaged: the data of key 'block"):
        load_af2_params(tmp_path / "short.npz")


@pytest.mark.parametrize(
    "field, value, why",
    [
        (10, 99, "compression method"),
        (8, 0x1, "encrypted"),
    ],  # zipfile: NotImplementedError, RuntimeError
    ids=["compression", "encryption"],
)
def test_damaged_central_directory_is_a_value_error(old_checkpoint, tmp_path, field, value, why):
    """A central directory entry whose compression method or encryption flag is damaged (zipfile
    raises its own NotImplementedError or RuntimeError) is refused as damaged, naming the file."""
    path, data = old_checkpoint
    damaged = bytearray(data)
    entry = data.index(b"PK\x01\x02", data.index(b"PK\x01\x02") + 1)  # the second member's
    damaged[entry + field : entry + field + 2] = int(value).to_bytes(2, "little")
    (tmp_path / "cd.npz").write_bytes(damaged)
    with pytest.raises(ValueError, match=rf"cd\.npz' is damaged: the data of key .*{why}"):
        load_af2_params(tmp_path / "cd.npz")
