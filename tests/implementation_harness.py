"""The tests every attention implementation passes: one harness, one subclass per implementation.

As tokamax's attention test_base: a subclass of `ImplementationTests` names an implementation
instance (`IMPL`, with its own tuning) and its capabilities (`DTYPES`, `SUPPORTS_VALUE_HEAD_DIM`,
`BITWISE_DETERMINISTIC`), and inherits every test below. Each runs
`ga.dot_product_attention(..., implementation=IMPL, compute_dtype='input')` under jax.jit and
compares it with the float64 NumPy/JAX reference (tests/reference.py) fed the same dtype-rounded
inputs: the output and the vjp at a random cotangent (dq, dk, dv, dbias), for every supported dtype
and every bias/mask form of FORMS; then the mask contract of gated_attention/core/numerics.py (fully
masked rows, masked keys, NaN/inf/1e12 garbage at masked positions), determinism, eager == jit,
several biases, extra batch axes and unbatched inputs.

Compile time is the suite's cost (2 CPU cores, ~0.5-1 s per form's forward and backward): all
forms of one dtype run as ONE jitted program (`run`), compiled once and fed other data by every
check of that dtype, in one test per dtype (`Checks` reports every failing check, not only the
first). The test processes compile at LLVM -O0 (conftest.py), the float64 reference's programs
at XLA's own level (helpers.jit_reference): -O0 miscompiles the reference's gradient to inf.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from tests import reference
from tests.helpers import DTYPES, as_f64, assert_close, jit_reference, rand, to_device

# The problem: B, T, S, N, H, Hv, all distinct (Hv = H for implementations that need equal head
# dims). B = 5 rows make tiles of 2 rows and a remainder; T and S are not multiples of 2 and 3.
SHAPE = (5, 7, 8, 3, 4, 2)

# name -> (bias dims, mask dims) over [B, N, T, S], '1' a broadcast dimension; None = absent.
FORMS = {
    "plain": (None, None),
    "key_mask": (None, "B11S"),
    "shared_bias+key_mask": ("1NTS", "B11S"),
    "batched_bias+query_key_mask": ("BNTS", "B1TS"),
    "key_bias+full_mask": ("B11S", "BNTS"),
    "head_bias+shared_mask": ("1N11", "11TS"),
}
FORM_NAMES = tuple(FORMS)

# The calling conventions' cases (calling_convention_cases), run at a custom scale.
CONVENTIONS = ("two biases, batch axes (2, 3)", "unbatched")
CONVENTIONS_SCALE = 0.3

# The forms the mask checks replace (fully masked rows, masked garbage, a partly masked key).
MASK_FORMS = ("shared_bias+key_mask", "batched_bias+query_key_mask", "key_bias+full_mask")

# What padding or a bug can leave at masked positions.
GARBAGE = {"nan": np.nan, "inf": np.inf, "1e12": 1e12}


class Case(NamedTuple):
    """One call's inputs and the cotangent of its output (arrays, or their float64 copies)."""

    q: Any
    k: Any
    v: Any
    bias: Any  # None, an array or a list of arrays
    mask: Any  # None or bool
    cot: Any


def dims(spec: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """'B1TS' -> (B, 1, T, S) for shape = (B, T, S, N, H, Hv)."""
    b, t, s, n, _, _ = shape
    sizes = {"B": b, "N": n, "T": t, "S": s, "1": 1}
    return tuple(sizes[c] for c in spec)


def problem(shape, dtype, form: str, seed: int = 0, *, mask=None) -> tuple[Case, Case]:
    """Random inputs of a FORMS form in `dtype` and their exact float64 copies.

    q [B, T, N, H], k [B, S, N, H], v [B, S, N, Hv], the cotangent [B, T, N, Hv]; the mask keeps
    about 70% of the entries unless `mask` (bool, of the form's mask shape) is given.
    """
    b, t, s, n, h, hv = shape
    rng = np.random.default_rng(seed)
    q, q64 = rand(rng, (b, t, n, h), dtype)
    k, k64 = rand(rng, (b, s, n, h), dtype)
    v, v64 = rand(rng, (b, s, n, hv), dtype)
    cot, cot64 = rand(rng, (b, t, n, hv), dtype)
    bias_spec, mask_spec = FORMS[form]
    bias = bias64 = None
    if bias_spec is not None:
        bias, bias64 = rand(rng, dims(bias_spec, shape), dtype)
    if mask_spec is not None and mask is None:
        mask = rng.random(dims(mask_spec, shape)) > 0.3
    mask = None if mask is None else np.asarray(mask, bool)
    return (
        Case(q, k, v, bias, None if mask is None else to_device(mask), cot),
        Case(q64, k64, v64, bias64, mask, cot64),
    )


# ------------------------------------------------------------------------------------------------
# Running an implementation and the reference
# ------------------------------------------------------------------------------------------------


def _fwd_vjp(impl, case: Case, scale, compute_dtype):
    """(out, (dq, dk, dv, dbias)): the output and its vjp at case.cot."""

    def attend(q, k, v, bias):
        return ga.dot_product_attention(
            q,
            k,
            v,
            bias,
            case.mask,
            scale=scale,
            implementation=impl,
            compute_dtype=compute_dtype,
        )

    out, vjp = jax.vjp(attend, case.q, case.k, case.v, case.bias)
    return out, vjp(case.cot)


@functools.partial(jax.jit, static_argnames=("impls", "scales", "compute_dtype"))
def _run(cases, impls, scales, compute_dtype):
    return [
        _fwd_vjp(impl, c, scale, compute_dtype)
        for impl, c, scale in zip(impls, cases, scales, strict=True)
    ]


def _per_case(x, cases):
    return x if isinstance(x, tuple) else (x,) * len(cases)


def run(impl, cases, *, scale=None, compute_dtype="input"):
    """[(out, (dq, dk, dv, dbias))] of every case, as ONE jitted program.

    impl: an implementation, or a tuple of one per case. scale: None (H ** -0.5), a number, or a
    tuple of one per case. The same impls, scales, shapes and dtypes reuse the compiled program
    whatever the data.
    """
    cases = tuple(cases)
    return _run(
        cases,
        impls=_per_case(impl, cases),
        scales=_per_case(scale, cases),
        compute_dtype=compute_dtype,
    )


def _reference_fwd_vjp(case: Case, scale):
    def attend(q, k, v, bias):
        if isinstance(bias, (list, tuple)):
            bias = functools.reduce(jnp.add, bias)
        return reference.dot_product_attention(q, k, v, bias, case.mask, scale, xp=jnp)

    out, vjp = jax.vjp(attend, case.q, case.k, case.v, case.bias)
    return out, vjp(case.cot)


@functools.partial(jit_reference, static_argnames=("scales",))
def _reference_run(cases, scales):
    return [_reference_fwd_vjp(c, scale) for c, scale in zip(cases, scales, strict=True)]


def reference_run(cases64, *, scale=None):
    """The float64 reference's [(out, (dq, dk, dv, dbias))] of float64 cases, as NumPy (scale as
    for `run`)."""
    cases64 = tuple(to_device(c) for c in cases64)
    return as_f64(jax.device_get(_reference_run(cases64, scales=_per_case(scale, cases64))))


def assert_matches(result, expected, dtype, name: str = "", platform: str | None = None):
    """An (out, grads) result against the reference's: tolerance(dtype) for the output,
    grad_tolerance(dtype) (atol scaled by the largest reference entry) for each gradient; float32
    judged as `platform`'s default dots round it (None: where it ran; reference.computed_as)."""
    out, grads = result
    ref_out, ref_grads = expected
    tol = reference.tolerance(dtype, platform=platform)
    assert_close(out, ref_out, tol, err_msg=f"{name}: output")
    for label, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads, strict=True):
        assert (g is None) == (r is None), f"{name}: {label}"
        for gi, ri in zip(jax.tree.leaves(g), jax.tree.leaves(r), strict=True):
            assert gi.shape == ri.shape, f"{name}: {label} shape {gi.shape} != {ri.shape}"
            tol = reference.grad_tolerance(dtype, ri, platform=platform)
            assert_close(gi, ri, tol, err_msg=f"{name}: {label}")


# The forms an interpreted kernel runs in a half dtype (compile time: ~2 s each): every bias
# broadcast, whose gradient the kernels reduce and cast; the float32 harness runs all FORMS.
BIASED_FORMS = tuple(name for name, (bias, _) in FORMS.items() if bias is not None)


def assert_forms_match(impl, shape, dtype, forms=BIASED_FORMS):
    """`forms`, forward and vjp, computed in `dtype` itself, against the float64 reference."""
    probs = problem_set(shape, dtype, calling_conventions=False)
    results = run(impl, [probs.cases[name] for name in forms])
    for name, result in zip(forms, results, strict=True):
        check_types(result, probs.cases[name], name)
        assert_matches(result, probs.expected[name], dtype, name)


def check_types(result, case: Case, name: str = ""):
    """The output has query's dtype; each gradient its input's dtype and shape."""
    out, grads = result
    assert out.dtype == case.q.dtype, name
    for label, g, x in zip(("dq", "dk", "dv", "dbias"), grads, case[:4], strict=True):
        for gi, xi in zip(jax.tree.leaves(g), jax.tree.leaves(x), strict=True):
            assert gi.dtype == xi.dtype and gi.shape == xi.shape, f"{name}: {label}"


class ProblemSet(NamedTuple):
    """Cases by name, their float64 copies and reference results (`problem_set`), and the names
    of those to run."""

    names: tuple[str, ...]
    cases: dict[str, Case]
    cases64: dict[str, Case]
    expected: dict[str, Any]

    @property
    def scales(self) -> tuple:
        return tuple(CONVENTIONS_SCALE if n in CONVENTIONS else None for n in self.names)

    def replaced(self, **cases: Case) -> list[Case]:
        """The cases to run, some replaced (same shapes: fed to the same program)."""
        return [cases.get(name, self.cases[name]) for name in self.names]

    def replaced64(self, **cases64: Case) -> list[Case]:
        return [cases64.get(name, self.cases64[name]) for name in self.names]


@functools.cache
def problem_set(shape, dtype, *, calling_conventions: bool) -> ProblemSet:
    """Every FORMS form's case (at the default scale), and with calling_conventions those of
    calling_convention_cases (at CONVENTIONS_SCALE). The reference runs all of them either way:
    one float64 program per shape, whatever the dtype."""
    cases, cases64 = {}, {}
    for i, form in enumerate(FORM_NAMES):
        cases[form], cases64[form] = problem(shape, dtype, form, seed=i)
    for name, (case, case64) in calling_convention_cases(shape, dtype).items():
        cases[name], cases64[name] = case, case64
    scales = tuple(CONVENTIONS_SCALE if n in CONVENTIONS else None for n in cases)
    expected = dict(zip(cases, reference_run(list(cases64.values()), scale=scales), strict=True))
    names = FORM_NAMES + (CONVENTIONS if calling_conventions else ())
    return ProblemSet(names, cases, cases64, expected)


def calling_convention_cases(shape, dtype):
    """name -> (case, float64 case).

    "two biases, batch axes (2, 3)": a pair bias shared by every batch element plus a key bias
    broadcast along the second batch axis (two biases, as AF2 before 2023 and ColabFold pass
    them), a key mask broadcast along the first. "unbatched": [T, N, H] inputs with a bias.
    """
    _, t, s, n, h, hv = shape
    rng = np.random.default_rng(4)

    def case(lead, biases, mask):
        q, q64 = rand(rng, (*lead, t, n, h), dtype)
        k, k64 = rand(rng, (*lead, s, n, h), dtype)
        v, v64 = rand(rng, (*lead, s, n, hv), dtype)
        cot, cot64 = rand(rng, (*lead, t, n, hv), dtype)
        pairs = [rand(rng, bias_shape, dtype) for bias_shape in biases]
        bias, bias64 = [p[0] for p in pairs], [p[1] for p in pairs]
        if len(pairs) == 1:
            bias, bias64 = bias[0], bias64[0]
        m = None if mask is None else to_device(mask)
        return Case(q, k, v, bias, m, cot), Case(q64, k64, v64, bias64, mask, cot64)

    cases = {
        "two biases, batch axes (2, 3)": case(
            (2, 3), [(1, 1, n, t, s), (2, 1, 1, 1, s)], rng.random((1, 3, 1, 1, s)) > 0.3
        ),
        "unbatched": case((), [(n, t, s)], None),
    }
    assert tuple(cases) == CONVENTIONS
    return cases


class Checks:
    """Runs several named checks and reports every failure at once (not only the first)."""

    def __init__(self):
        self.failures: list[str] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        try:
            yield
        except AssertionError as e:
            self.failures.append(f"--- {name}: {e}")

    def raise_failures(self):
        if self.failures:
            count = f"{len(self.failures)} check(s) failed"
            raise AssertionError("\n".join([count, *self.failures]))


# ------------------------------------------------------------------------------------------------
# Masks with fully masked rows and dead keys, and garbage at their positions
# ------------------------------------------------------------------------------------------------


def live_rows_and_keys(mask, shape):
    """Bool [B, T, N] (the query row has a key) and [B, S, N] (some query attends to the key)."""
    b, t, s, n, _, _ = shape
    full = np.broadcast_to(mask, (b, n, t, s))
    return np.swapaxes(full.any(axis=3), 1, 2), np.swapaxes(full.any(axis=2), 1, 2)


def with_garbage(case: Case, shape, garbage: float) -> Case:
    """case with `garbage` in the queries of rows with no key and the keys and values that no
    query attends to (what numerics.zero_dead_inputs promises never leaks)."""
    live_rows, live_keys = live_rows_and_keys(np.asarray(case.mask), shape)

    def fill(x, live):
        x = np.asarray(x)
        with np.errstate(over="ignore"):  # 1e12 is inf in float16
            return to_device(np.where(live[..., None], x, np.asarray(garbage).astype(x.dtype)))

    return case._replace(
        q=fill(case.q, live_rows), k=fill(case.k, live_keys), v=fill(case.v, live_keys)
    )


def assert_no_leak(result, clean, case: Case, shape, dtype, name: str):
    """Rows that have a key, and the gradients of unmasked inputs (q of those rows, k and v of
    keys some query attends to, biases at unmasked entries), equal the clean run's and are finite."""
    b, t, s, n, _, _ = shape
    mask = np.asarray(case.mask)
    live_rows, live_keys = live_rows_and_keys(mask, shape)
    (out, (dq, dk, dv, dbias)), (c_out, (c_dq, c_dk, c_dv, c_dbias)) = as_f64((result, clean))
    tol, gtol = reference.tolerance(dtype), reference.grad_tolerance(dtype)
    for label, x, ref, live in (
        ("output", out, c_out, live_rows),
        ("dq", dq, c_dq, live_rows),
        ("dk", dk, c_dk, live_keys),
        ("dv", dv, c_dv, live_keys),
    ):
        x, ref = x[live], ref[live]
        assert np.isfinite(x).all(), f"{name}: {label} not finite where it must be"
        assert_close(x, ref, tol if label == "output" else gtol, err_msg=f"{name}: {label}")
    full = np.broadcast_to(mask, (b, n, t, s))
    axes = tuple(a for a, d in enumerate(dbias.shape) if d == 1)
    unmasked = np.broadcast_to(full.any(axis=axes, keepdims=True), dbias.shape)
    assert np.isfinite(dbias[unmasked]).all(), f"{name}: dbias not finite"
    assert_close(dbias[unmasked], c_dbias[unmasked], gtol, err_msg=f"{name}: dbias")


def garbage_masks(shape):
    """Masks of the garbage cases, by FORMS name:

    (a) key mask [B, 1, 1, S]: keys 1 and 4 of batch 0 masked, batch 1 fully masked;
    (b) query-key mask [B, 1, T, S]: a random mask with query rows (0, 1) and (1, 3) fully masked
        and keys (0, 2) and (1, 5) masked for every query.
    """
    b, t, s, _, _, _ = shape
    key_mask = np.ones((b, 1, 1, s), bool)
    key_mask[0, ..., [1, 4]] = False
    key_mask[1] = False
    qk_mask = np.random.default_rng(11).random((b, 1, t, s)) > 0.3
    qk_mask[0, 0, 1, :] = False
    qk_mask[1, 0, 3, :] = False
    qk_mask[0, 0, :, 2] = False
    qk_mask[1, 0, :, 5] = False
    return {"shared_bias+key_mask": key_mask, "batched_bias+query_key_mask": qk_mask}


# ------------------------------------------------------------------------------------------------
# The tests
# ------------------------------------------------------------------------------------------------


class ImplementationTests:
    """What every implementation passes. Subclass it as `Test<Name>` with IMPL and its capabilities.

    Attributes:
      IMPL: the implementation instance under test.
      DTYPES: the input dtypes it takes (each tested against the reference, forward and vjp).
      SUPPORTS_VALUE_HEAD_DIM: it takes a value head dim Hv != H (else it must raise
        NotImplementedError for one, and is tested with Hv = H).
      BITWISE_DETERMINISTIC: two runs of one compiled program give equal bits.
      MASK_CHECKS_ALONE: the mask checks (fully masked rows, garbage, a partly masked key) run
        just the three forms they replace, in a program of their own, instead of the whole set
        seven times: for an implementation whose time is running, not compiling.
      BATCH, HEADS, HEAD_DIM: B, N and H of the problems (SHAPE's; e.g. H a multiple of 8 for
        cuDNN, fewer heads for a kernel that unrolls them: compile time).
      LENGTHS: T and S of the problems (SHAPE's; e.g. even for cuDNN, whose backward with a
        bias refuses odd lengths).

    One test per dtype runs every check that needs that dtype's compiled program (a finer split
    would let pytest-xdist's two workers compile the same program twice); in one dtype
    (`one_dtype`) that program also holds the calling conventions' cases.
    """

    IMPL: ClassVar[ga.Implementation]
    DTYPES: ClassVar[tuple[str, ...]] = DTYPES
    SUPPORTS_VALUE_HEAD_DIM: ClassVar[bool] = True
    BITWISE_DETERMINISTIC: ClassVar[bool] = True
    # The mask checks run their three forms alone (Mosaic GPU's interpreter: running dominates).
    MASK_CHECKS_ALONE: ClassVar[bool] = False
    BATCH: ClassVar[int] = SHAPE[0]
    HEADS: ClassVar[int] = SHAPE[3]
    HEAD_DIM: ClassVar[int] = SHAPE[4]
    LENGTHS: ClassVar[tuple[int, int]] = SHAPE[1:3]

    def pytest_generate_tests(self, metafunc):
        if "dtype" in metafunc.fixturenames:
            metafunc.parametrize("dtype", self.DTYPES)

    @property
    def shape(self) -> tuple[int, ...]:
        (t, s), hv, h = self.LENGTHS, SHAPE[5], self.HEAD_DIM
        return (self.BATCH, t, s, self.HEADS, h, hv if self.SUPPORTS_VALUE_HEAD_DIM else h)

    @property
    def one_dtype(self) -> str:
        """The dtype of the tests that need one: float32, or the first of DTYPES."""
        return "float32" if "float32" in self.DTYPES else self.DTYPES[0]

    def test_reference_and_mask_contract(self, dtype):
        """Every FORMS form against the reference (forward and vjp), determinism, fully masked
        rows, masked keys' bias gradient, NaN/inf/1e12 at masked positions, and in one dtype
        eager == jit and the calling conventions: all from one compiled program."""
        calling_conventions = dtype == self.one_dtype
        probs = problem_set(self.shape, dtype, calling_conventions=calling_conventions)
        results = self.run(probs, probs.replaced())
        check = Checks()
        for name in probs.names:
            with check(f"{name}: against the reference"):
                check_types(results[name], probs.cases[name], name)
                assert_matches(results[name], probs.expected[name], dtype, name)
        if self.BITWISE_DETERMINISTIC:
            with check("two runs are bitwise equal"):
                again = self.run(probs, probs.replaced())
                for a, b in zip(jax.tree.leaves(results), jax.tree.leaves(again), strict=True):
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if calling_conventions:
            with check("eager equals jit"):
                self.eager_equals_jit(probs, results, dtype)
        with check("fully masked rows"):
            self.fully_masked_rows(probs, dtype)
        with check("masked entries get no bias gradient"):
            self.masked_entries_get_no_bias_gradient(probs, results)
        self.masked_garbage_does_not_leak(probs, dtype, check)
        with check("NaN in a key that some rows mask"):
            self.partly_masked_key(probs, dtype)
        check.raise_failures()

    def run(self, probs: ProblemSet, cases) -> dict:
        """run() on the problems' cases (e.g. some replaced): name -> result."""
        results = run(self.IMPL, cases, scale=probs.scales)
        return dict(zip(probs.names, results, strict=True))

    def run_forms(self, probs: ProblemSet, cases: dict[str, Case]) -> dict:
        """run() with some forms' cases replaced: name -> result, for at least those forms. With
        MASK_CHECKS_ALONE just MASK_FORMS run (where running, not compiling, is the time: one
        smaller program, reused whatever the data); else the whole set's program."""
        if not self.MASK_CHECKS_ALONE:
            return self.run(probs, probs.replaced(**cases))
        assert set(cases) <= set(MASK_FORMS), cases
        scales = tuple(probs.scales[probs.names.index(name)] for name in MASK_FORMS)
        replaced = [cases.get(name, probs.cases[name]) for name in MASK_FORMS]
        return dict(zip(MASK_FORMS, run(self.IMPL, replaced, scale=scales), strict=True))

    def eager_equals_jit(self, probs: ProblemSet, results, dtype):
        form = "shared_bias+key_mask"
        eager = ga.dot_product_attention(
            *probs.cases[form][:5], implementation=self.IMPL, compute_dtype="input"
        )
        exact = reference.computed_as(dtype) == "float32"  # not TF32: one kernel, same bits
        tol = dict(rtol=1e-6, atol=1e-6) if exact else reference.tolerance(dtype)
        assert_close(eager, results[form][0], tol)

    def fully_masked_rows(self, probs: ProblemSet, dtype):
        """Row 1 of batch 0 (every head) and all of batch 1 see no key: the mean of the values
        over all keys, finite, with gradients reaching v only."""
        form = "key_bias+full_mask"
        b, t, s, n, _, hv = self.shape
        mask = np.random.default_rng(12).random((b, n, t, s)) > 0.3
        mask[0, :, 1] = False
        mask[1] = False
        case = probs.cases[form]._replace(mask=to_device(mask))
        case64 = probs.cases64[form]._replace(mask=mask)
        result = self.run_forms(probs, {form: case})[form]
        out, (dq, dk, _, dbias) = as_f64(result)
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(as_f64(result))), "not finite"
        uniform = case64.v.mean(axis=1)  # [B, N, Hv]
        tol = reference.tolerance(dtype)
        assert_close(out[0, 1], uniform[0], tol, err_msg="masked row")
        assert_close(out[1], np.broadcast_to(uniform[1], (t, n, hv)), tol, err_msg="masked batch")
        expected = reference_run(probs.replaced64(**{form: case64}), scale=probs.scales)
        assert_matches(result, expected[FORM_NAMES.index(form)], dtype, form)
        # No gradient to the queries and biases of those rows, nor to keys only they could see.
        for label, x in (("dq", dq[0, 1]), ("dq", dq[1]), ("dk", dk[1]), ("dbias", dbias[1])):
            np.testing.assert_array_equal(x, 0.0, err_msg=label)

    def masked_entries_get_no_bias_gradient(self, probs: ProblemSet, results):
        form = "batched_bias+query_key_mask"
        dbias = as_f64(results[form][1][3])  # [B, N, T, S]
        masked = ~np.broadcast_to(np.asarray(probs.cases[form].mask), dbias.shape)
        assert masked.any() and np.abs(dbias[~masked]).max() > 0
        np.testing.assert_array_equal(dbias[masked], 0.0)

    def masked_garbage_does_not_leak(self, probs: ProblemSet, dtype, check: Checks):
        """NaN, inf or 1e12 in the queries of fully masked rows and in keys and values no query
        attends to: (a) under a key mask, with one batch row fully masked; (b) under a query-key
        mask. Rows with a key and the gradients of unmasked inputs are the clean run's."""
        clean = {
            form: probs.cases[form]._replace(mask=to_device(mask))
            for form, mask in garbage_masks(self.shape).items()
        }
        clean_results = self.run_forms(probs, clean)
        for garbage, value in GARBAGE.items():
            dirty = {form: with_garbage(case, self.shape, value) for form, case in clean.items()}
            dirty_results = self.run_forms(probs, dirty)
            for form, case in clean.items():
                with check(f"{garbage} at masked positions, {form}"):
                    args = (case, self.shape, dtype, form)
                    assert_no_leak(dirty_results[form], clean_results[form], *args)

    def partly_masked_key(self, probs: ProblemSet, dtype):
        """NaN in a key (not its value) that some rows attend to and others mask, under a
        query-key mask: the rows that mask it do not see it (the mask is a select, numerics.py);
        forward only (their gradient meets that key with a zero weight)."""
        form = "batched_bias+query_key_mask"
        mask = garbage_masks(self.shape)[form]  # [B, 1, T, S]
        attended = mask[0, 0].any(axis=0) & ~mask[0, 0].all(axis=0)  # [S]
        key = int(np.flatnonzero(attended)[0])
        rows = ~mask[0, 0, :, key] & mask[0, 0].any(axis=1)  # [T]: mask it, have a key
        assert rows.any()
        clean = probs.cases[form]._replace(mask=to_device(mask))
        k = np.array(clean.k)
        k[0, key] = np.nan
        dirty = clean._replace(k=to_device(k))
        out = as_f64(self.run_forms(probs, {form: dirty})[form][0])
        clean_out = as_f64(self.run_forms(probs, {form: clean})[form][0])
        assert np.isfinite(out[0, rows]).all(), "rows that mask the key are not finite"
        assert_close(out[0, rows], clean_out[0, rows], reference.tolerance(dtype))

    def test_value_head_dim(self):
        case, _ = problem((*self.shape[:5], self.shape[4] + 2), self.one_dtype, "key_mask")
        call = functools.partial(ga.dot_product_attention, implementation=self.IMPL)
        if self.SUPPORTS_VALUE_HEAD_DIM:
            assert jax.eval_shape(call, *case[:5]).shape == case.cot.shape
        else:
            with pytest.raises(NotImplementedError, match="head dim"):
                jax.eval_shape(call, *case[:5])


# B, T, S, N (query heads), K (key/value heads), H: three query and key tiles of 128, partial.
WIDE = (2, 300, 290, 2, 1, 16)
STRUCTURED = dict(
    is_causal=True,
    local_window_size=(150, 40),
    query_seq_lengths=np.array([300, 170], np.int32),
    key_value_seq_lengths=np.array([290, 100], np.int32),
    logits_soft_cap=3.0,
)


def allowed_by(t, s, kw):
    """bool [B, 1, T, S]: the causal, window and length masks of kw, brute force."""
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    ok = np.ones((t, s), bool)
    if kw.get("is_causal"):
        ok &= j <= i
    if kw.get("local_window_size"):
        left, right = kw["local_window_size"]
        ok &= (j >= i - left) & (j <= i + right)
    q_ok = i < kw["query_seq_lengths"][:, None, None]
    return (ok & q_ok & (j < kw["key_value_seq_lengths"][:, None, None]))[:, None]


def check_forward_batch_first_and_packed(impl, b: int, t: int, seed: int, keyless_rows) -> None:
    """impl's bfloat16 forward, one head of 32, a bias shared over the batch and a key mask
    (`keyless_rows` without a key): output and log-sum-exp (what the backward reads) against the
    float64 reference, batch first from q, k, v and positions first from a packed q/k/v read in
    place (Plan.columns, Plan.packed), in one jitted program."""
    n, h = 1, 32
    rng = np.random.default_rng(seed)
    draw = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
    qkv, bias = draw(b, t, 3, n, h), draw(1, n, t, t)
    mask = rng.random((b, 1, 1, t)) > 0.3
    mask[list(keyless_rows)] = False
    half = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    first = lambda x: jnp.swapaxes(x, 0, 1)  # noqa: E731

    @jax.jit
    def run(qkv, bias):
        q, k, v = (qkv[:, :, slot] for slot in range(3))
        kw = dict(implementation=impl, compute_dtype="input", return_residual=True)
        rows = ga.dot_product_attention(q, k, v, bias, jnp.asarray(mask), **kw)
        packed = ga.packed_dot_product_attention(
            first(qkv), bias, jnp.asarray(mask), positions_first=True, **kw
        )
        return rows, packed

    exact = half(qkv).astype(np.float64), half(bias).astype(np.float64)
    rows, packed = run(*(half(x) for x in (qkv, bias)))
    with jax.enable_x64(True):
        q, k, v = (np.asarray(exact[0][:, :, slot]) for slot in range(3))
        out = reference.dot_product_attention(q, k, v, np.asarray(exact[1]), mask, xp=jnp)
        _, lse = ga.dot_product_attention(
            q, k, v, np.asarray(exact[1]), mask, implementation="xla", return_residual=True
        )
    live = np.asarray(mask).any(axis=(1, 2, 3))  # rows without a key: no log-sum-exp to match
    for name, (o, r) in (("batch first", rows), ("packed", packed)):
        o, r = (o, r) if name == "batch first" else (first(o), first(r))
        assert_close(o.astype(jnp.float32), out, reference.tolerance("bfloat16"), name)
        assert_close(r[live], np.asarray(lse)[live], dict(rtol=1e-5, atol=1e-5), name)


def check_eagerly(impl, case: Case, case64: Case, dtype: str, name: str) -> None:
    """impl's output and vjp at case.cot, run eagerly (the interpreter's several warpgroups run
    only outside jit), against the float64 reference."""

    def loss(q, k, v, bias):
        out = ga.dot_product_attention(q, k, v, bias, case.mask, implementation=impl)
        return jnp.sum(out.astype(jnp.float32) * case.cot.astype(jnp.float32)), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        case.q, case.k, case.v, case.bias
    )
    [expected] = reference_run([case64])
    assert_matches((out, grads), expected, dtype, name)
