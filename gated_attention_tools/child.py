"""Run a function in a fresh Python process: `child.call('module:function', kwargs, log)`, the one
runner of the tools (the benchmarks' cells, measure's memory probes, targets.in_child's deviceless
compiles: an environment of their own through `env`, a time limit through `timeout_s`).

The benchmarks time every cell in a process of its own, under one malloc policy for all its
variants (measure.ALLOCATOR_POLICIES): a process's history moves glibc's mmap threshold, and with it
the time of XLA:CPU's programs (measure.py says how), so a child's figures hold only under a fixed
policy.

`python -m gated_attention_tools.child '<json>'` is the child: it calls the function with the
kwargs, lets its printed lines through, and prints the JSON-serializable result last, after RESULT.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from gated_attention_tools import measure

_RESULT = "RESULT "


def call(
    target: str,
    kwargs: dict[str, Any],
    log: Callable[[str], None] = print,
    allocator: str | None = None,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> Any:
    """target(**kwargs) ('module:function', importable with this process's sys.path) computed in a
    fresh process; its printed lines go to `log` as they come. `allocator` names the child's malloc
    policy (measure.ALLOCATOR_POLICIES; None: this process's environment as it is), `env` variables
    set on top. A child still running after timeout_s seconds is killed (a RuntimeError).

    Raises:
      RuntimeError: the child failed or printed no result (its stderr's tail included).
    """
    import subprocess

    spec = json.dumps(dict(target=target, kwargs=kwargs))
    result = None
    with tempfile.TemporaryFile("w+") as stderr:
        with subprocess.Popen(
            [sys.executable, "-m", __name__, spec],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=measure.child_env(allocator, **(env or {})),
            start_new_session=timeout_s is not None,  # a group: its own children die with it
        ) as child:
            kill = lambda: os.killpg(child.pid, signal.SIGKILL)
            timer = threading.Timer(timeout_s, kill) if timeout_s is not None else None
            if timer is not None:
                timer.start()
            try:
                for line in child.stdout:
                    if line.startswith(_RESULT):
                        result = line[len(_RESULT) :]
                    else:
                        log(line.rstrip("\n"))
            finally:
                if timer is not None:
                    timer.cancel()
        if child.returncode != 0 or result is None:
            stderr.seek(0)
            killed = timeout_s is not None and child.returncode == -9
            timed_out = f" (killed after its {timeout_s:.0f} s)" if killed else ""
            raise RuntimeError(
                f"{target}({kwargs}) failed in its child process with exit code "
                f"{child.returncode}{timed_out}:\n{stderr.read()[-3000:]}"
            )
    return json.loads(result)


def _main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    module, _, name = spec["target"].partition(":")
    out = getattr(importlib.import_module(module), name)(**spec["kwargs"])
    print(_RESULT + json.dumps(out), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])


@contextlib.contextmanager
def printed(fds=(1, 2)):
    """Captures what this process writes to the file descriptors (compilers' dumps, written
    below Python's sys.stdout) while the block runs; yields a list that receives the text."""
    text: list[str] = []
    with tempfile.TemporaryFile(mode="w+") as out:
        sys.stdout.flush()
        saved = [os.dup(fd) for fd in fds]
        for fd in fds:
            os.dup2(out.fileno(), fd)
        try:
            yield text
        finally:
            sys.stdout.flush()
            for fd, old in zip(fds, saved, strict=True):
                os.dup2(old, fd)
                os.close(old)
            out.seek(0)
            text.append(out.read())
