"""The one mask-range rule (masking.py): its spans and tiles against brute force over every
(query, key) pair, and no other module of the library working the ranges out again."""

from __future__ import annotations

import itertools
import pathlib
import re

import numpy as np
import pytest

from gated_attention.core import masking

WINDOWS = [None, (0, 0), (2, 1), (0, 3), (4, 0)]


def _brute(q_len, kv_len, offset, is_causal, window, q_length, kv_length):
    """bool [T, S]: jax.nn's conventions written out pair by pair."""
    ok = np.ones((q_len, kv_len), bool)
    for a, j in itertools.product(range(q_len), range(kv_len)):
        i = offset + a
        if is_causal and j > i:
            ok[a, j] = False
        if window is not None and not i - window[0] <= j <= i + window[1]:
            ok[a, j] = False
        if i >= q_length or j >= kv_length:
            ok[a, j] = False
    return ok


def _check(got: set, exact: set, every: bool, one_side: bool):
    """every: exactly the positions each of the range attends (tiles left unmasked). Some: all
    it attends (tiles skipped are masked whole), exactly so unless the range straddles the
    other side's length (then the span is the band's, a safe superset)."""
    if every or one_side:
        assert got == exact
    else:
        assert got >= exact


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("offset", [0, 3])
def test_spans_match_brute_force(is_causal, window, offset):
    q_len, kv_len, q_length, kv_length = 7, 9, offset + 5, 6
    ok = _brute(q_len, kv_len, offset, is_causal, window, q_length, kv_length)
    for first, last in [(a, b) for a in range(q_len) for b in range(a, q_len)]:
        rows = ok[first : last + 1]
        for every, reduce in ((False, np.any), (True, np.all)):
            lo, hi = (
                int(x)
                for x in masking.key_span(
                    offset + first, offset + last, is_causal, window, kv_len, q_length,
                    kv_length, every,
                )
            )  # fmt: skip
            _check(
                set(range(lo, hi)),
                set(np.flatnonzero(reduce(rows, axis=0))),
                every,
                offset + last < q_length or offset + first >= q_length,
            )
    for first, last in [(a, b) for a in range(kv_len) for b in range(a, kv_len)]:
        columns = ok[:, first : last + 1]
        for every, reduce in ((False, np.any), (True, np.all)):
            lo, hi = (
                int(x)
                for x in masking.query_span(
                    first, last, is_causal, window, offset, q_len, q_length, kv_length, every
                )
            )
            _check(
                {x - offset for x in range(lo, hi)},
                set(np.flatnonzero(reduce(columns, axis=1))),
                every,
                last < kv_length or first >= kv_length,
            )


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_allowed_matches_brute_force(is_causal, window):
    q_len, kv_len, offset = 6, 8, 2
    i = offset + np.arange(q_len)[:, None]
    j = np.arange(kv_len)[None, :]
    got = masking.allowed(i, j, is_causal, window, offset + 4, 5)
    assert np.array_equal(got, _brute(q_len, kv_len, offset, is_causal, window, offset + 4, 5))
    assert masking.allowed(i, j, False, None) is None


@pytest.mark.parametrize(
    "lo, hi, size, want",
    [(0, 0, 4, (0, 0)), (3, 9, 4, (0, 3)), (4, 8, 4, (1, 2)), (5, 5, 4, (1, 1))],
)
def test_tiles_covers_the_span(lo, hi, size, want):
    assert masking.tiles(lo, hi, size) == want
    traced = tuple(int(x) for x in masking.tiles(np.int32(lo), np.int32(hi), size))
    assert traced == want


def test_no_other_module_works_out_the_ranges():
    """Arithmetic on the window's bounds, or a causal comparison of positions, appears in
    masking.py alone: a fifth copy of the rule in a kernel fails here."""
    package = pathlib.Path(masking.__file__).parents[1]
    pattern = re.compile(r"[-+] *[\w.]*window\[|window\[[01]\] *[-+]|left, right = |kj <= qi")
    found = [
        f"{path.relative_to(package)}:{n}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "masking.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line.split("#")[0])
    ]
    assert not found, f"causal/window ranges computed outside masking.py: {found}"
