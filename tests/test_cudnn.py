"""The cuDNN adapter: what it accepts, and its adaptation run through jax.nn's XLA path on CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention import cudnn
from tests import reference
from tests.helpers import assert_close, rand

B, N, T, S, H = 2, 2, 6, 8, 16


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_supports_reports_why_not():
    q, kv = _spec((B, N, T, H)), _spec((B, N, S, H))
    assert cudnn.supports(q, kv, kv, backend="gpu") is None
    assert "GPU only, the backend is 'cpu'" in cudnn.supports(q, kv, kv, backend="cpu")
    f32 = _spec((B, N, T, H), jnp.float32)
    assert "float16 or bfloat16 inputs, got float32" in cudnn.supports(f32, kv, kv, backend="gpu")
    odd = _spec((B, N, T, 12))
    assert "multiple of 8 and <= 128, got 12" in cudnn.supports(odd, odd, odd, backend="gpu")
    big = _spec((B, N, T, 136))
    assert "got 136" in cudnn.supports(big, big, big, backend="gpu")
    assert "equal key and value head dims, got 16 and 8" in cudnn.supports(
        q, kv, _spec((B, N, S, 8)), backend="gpu"
    )


def test_auto_picks_cudnn_only_where_it_fits(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    q, kv = _spec((B, N, T, H)), _spec((B, N, S, H))
    assert ga.choose_implementation(q, kv, kv)[0] == "cudnn"
    f32q, f32kv = _spec((B, N, T, H), jnp.float32), _spec((B, N, S, H), jnp.float32)
    assert ga.choose_implementation(f32q, f32kv, f32kv)[0] != "cudnn"


def test_explicit_cudnn_on_cpu_raises_not_implemented():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    x = jnp.ones((B, T, N, H), jnp.bfloat16)
    with pytest.raises(
        NotImplementedError,
        match=r"implementation='cudnn' cannot take these inputs: cuDNN attention runs on GPU only",
    ):
        ga.dot_product_attention(x, x, x, implementation="cudnn")


FORMS = {
    "key_mask+shared_bias": ((1, N, T, S), (B, 1, 1, S)),
    "head_bias+qk_mask": ((1, N, 1, 1), (B, 1, T, S)),
    "batched_bias": ((B, N, T, S), None),
}


# jax.nn's XLA path has no float16 x float16 -> float32 dot on CPU, so float16 is GPU-only here.
@pytest.mark.parametrize("dtype", ["bfloat16"])
@pytest.mark.parametrize("form", list(FORMS))
def test_adaptation_matches_reference(dtype, form):
    rng = np.random.default_rng(0)
    q, q64 = rand(rng, (B, N, T, H), dtype)
    k, k64 = rand(rng, (B, N, S, H), dtype)
    v, v64 = rand(rng, (B, N, S, H), dtype)
    bias_shape, mask_shape = FORMS[form]
    bias, bias64 = rand(rng, bias_shape, dtype)
    mask = None
    if mask_shape is not None:
        mask_np = rng.random(mask_shape) > 0.3
        mask_np[1] = False  # batch 1: fully masked rows
        mask = jnp.asarray(mask_np)
    attend = jax.jit(functools.partial(cudnn.attend, scale=H**-0.5, inner_implementation="xla"))
    out = attend(q, k, v, (bias,), mask)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (B, N, T, H)
    to_btnh = lambda x: np.swapaxes(x, 1, 2)
    expected = reference.dot_product_attention(
        to_btnh(q64), to_btnh(k64), to_btnh(v64), bias64, None if mask is None else np.asarray(mask)
    )
    assert_close(to_btnh(np.asarray(out.astype(jnp.float32))), expected, reference.tolerance(dtype))
