"""CudnnAttention: what it takes, when 'auto' picks it, and the harness's tests of its adaptation
(run through jax.nn's XLA path on CPU; with cuDNN itself where there is a GPU)."""

import jax
import jax.numpy as jnp
import pytest

import gated_attention as ga
from gated_attention.core import compat
from tests.helpers import on_device
from tests.implementation_harness import ImplementationTests

B, T, S, N, H = 2, 6, 8, 2, 16


class TestCudnnAdapterThroughXla(ImplementationTests):
    """The adapter (bias and mask to cuDNN's forms, masked inputs zeroed, uniform fully masked
    rows) run by jax.nn's XLA implementation. jax.nn needs Hv == H. cuDNN takes bfloat16 and
    float16; on CPU jax.nn's XLA path has no float16 dot with float32 accumulation, so bfloat16 is
    tested. (It would take float32, but computes float64 inputs' softmax in float32.)"""

    IMPL = ga.CudnnAttention(jax_nn_implementation="xla")
    DTYPES = ("bfloat16",)
    SUPPORTS_VALUE_HEAD_DIM = False


@on_device("gpu")
class TestCudnnOnGpu(ImplementationTests):
    """cuDNN itself: half precision, head dims a multiple of 8 (not run on a machine without GPU)."""

    IMPL = ga.CudnnAttention()
    DTYPES = ("bfloat16", "float16")
    SUPPORTS_VALUE_HEAD_DIM = False
    BITWISE_DETERMINISTIC = False
    HEAD_DIM = 8
    LENGTHS = (6, 8)  # even: its backward with a bias refuses odd lengths (T != S still)


def _spec(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


Q, KV = _spec((B, T, N, H)), _spec((B, S, N, H))


def _check(q, k, v, dtype=jnp.bfloat16, platform="gpu"):
    ga.CudnnAttention().check(q, k, v, (), None, compute_dtype=dtype, platform=platform)


@pytest.mark.parametrize(
    "q, k, v, dtype, match",
    [
        (Q, KV, KV, jnp.float32, "takes float16 or bfloat16, got float32"),
        (Q, KV, KV, jnp.float64, "takes float16 or bfloat16, got float64"),
        *(
            (_spec((B, T, N, h)), _spec((B, S, N, h)), _spec((B, S, N, h)), None, match)
            for h, match in ((12, "multiple of 8 and <= 128, got 12"), (136, "got 136"))
        ),
        (Q, KV, _spec((B, S, N, 8)), None, "equal key and value head dims, got 16 and 8"),
    ],
)
def test_check_says_why_not_on_gpu(q, k, v, dtype, match, cudnn_loadable):
    _check(Q, KV, KV)  # bfloat16, H = 16: takes it
    with pytest.raises(NotImplementedError, match=match):
        _check(q, k, v, q.dtype if dtype is None else dtype)


def test_check_refuses_without_the_library_and_odd_lengths_with_a_bias(cudnn_loadable, monkeypatch):
    bias = (_spec((1, N, T, S)),)
    odd_q, odd_kv = _spec((B, 7, N, H)), _spec((B, 5, N, H))
    ga.CudnnAttention().check(Q, KV, KV, bias, None, compute_dtype=jnp.bfloat16, platform="gpu")
    ga.CudnnAttention().check(
        odd_q, odd_kv, odd_kv, (), None, compute_dtype=jnp.bfloat16, platform="gpu"
    )  # no bias: odd lengths are fine
    with pytest.raises(NotImplementedError, match=r"even sequence lengths .*got T=7, S=5"):
        ga.CudnnAttention().check(
            odd_q, odd_kv, odd_kv, (_spec((1, N, 7, 5)),), None, compute_dtype=jnp.bfloat16,
            platform="gpu",
        )  # fmt: skip
    # A CUDA plugin without cuDNN (a deviceless compile): refused, so 'auto' moves on.
    monkeypatch.setattr(compat, "cudnn_version", lambda: None)
    with pytest.raises(NotImplementedError, match=r"needs the cuDNN library, which JAX cannot"):
        _check(Q, KV, KV)


def test_check_refuses_other_backends():
    for platform in ("cpu", "tpu"):
        with pytest.raises(NotImplementedError, match=f"GPU only, the program is for '{platform}'"):
            _check(Q, KV, KV, platform=platform)
    # Through jax.nn's XLA path any backend and dtype goes; only Hv != H is refused.
    ga.CudnnAttention(jax_nn_implementation="xla").check(
        Q, KV, KV, (), None, compute_dtype=jnp.float32
    )


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="a GPU is present")
def test_naming_cudnn_on_cpu_raises_not_implemented():
    x = jnp.ones((B, T, N, H), jnp.bfloat16)
    with pytest.raises(
        NotImplementedError,
        match=r"implementation='cudnn' cannot take these inputs: cuDNN attention runs on GPU only",
    ):
        jax.eval_shape(lambda x: ga.dot_product_attention(x, x, x, implementation="cudnn"), x)


class _PallasDeclines(ga.PallasAttention):
    def plan(self, *args, **kwargs):  # what the op asks (check asks it too)
        raise NotImplementedError("declined for this test")


def test_auto_picks_cudnn_on_gpu_for_half_precision_after_pallas(cudnn_loadable):
    def chosen(dtype, auto=None, platform="gpu"):
        q, kv = _spec((B, T, N, H), dtype), _spec((B, S, N, H), dtype)
        impl, reason = (auto or ga.Auto()).choose(
            q, kv, kv, (), None, compute_dtype=dtype, platform=platform
        )
        assert reason
        return impl.name

    assert chosen(jnp.bfloat16, platform="cpu") == "xla"
    assert chosen(jnp.bfloat16) == "pallas"  # the fused kernel first
    no_pallas = ga.Auto(pallas=_PallasDeclines())
    assert chosen(jnp.bfloat16, no_pallas) == "cudnn"
    assert chosen(jnp.float16, no_pallas) == "cudnn"
    assert chosen(jnp.float32, no_pallas) == "xla"
