"""Every bad input gets a ValueError or TypeError naming the argument, what it got and what it expects."""

import contextlib

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention_tools.family_benchmark import random_params

B, Q, K, A, H, O = 2, 5, 6, 8, 2, 4
q_data = jnp.ones((B, Q, A))
m_data = jnp.ones((B, K, A))
key_mask = jnp.ones((B, 1, 1, K), bool)


def _apply(*args, config=None, global_config=None, output_dim=O, **kwargs):
    config = dict(num_head=H) if config is None else config
    global_config = {} if global_config is None else global_config
    fn = hk.transform(lambda *a, **k: ga.Attention(config, global_config, output_dim)(*a, **k))
    return jax.eval_shape(fn.init, jax.random.PRNGKey(0), *args, **kwargs)


ATTENTION_ERRORS = {
    "float mask": (
        TypeError,
        r"mask must be a boolean array.*float64.*bias=",
        dict(mask=jnp.ones((B, 1, 1, K))),
    ),
    "int mask": (
        TypeError,
        r"mask must be a boolean array.*int",
        dict(mask=jnp.ones((B, 1, 1, K), jnp.int32)),
    ),
    "mask not broadcastable": (
        ValueError,
        r"mask of shape \(2, 1, 1, 5\) does not broadcast to \[\.\.\., b, h, q, k\] = "
        r"\(2, 2, 5, 6\) \(each dimension 1 or equal\); dimension -1 \(k\) is 5, expected 1 or 6(\n|$)",
        dict(mask=jnp.ones((B, 1, 1, 5), bool)),
    ),
    "[b, q, k] mask not broadcastable": (
        ValueError,
        r"mask of shape \(2, 6, 6\) does not broadcast to \[\.\.\., b, q, k\] = \(2, 5, 6\) "
        r"\(each dimension 1 or equal\); dimension -2 \(q\) is 6, expected 1 or 5(\n|$)",
        dict(mask=jnp.ones((B, K, K), bool)),
    ),
    "mask wrong rank": (
        ValueError,
        r"mask of shape \(6,\) must have the rank of \[\.\.\., b, h, q, k\] = \(2, 2, 5, 6\) or of "
        r"\[\.\.\., b, q, k\] = \(2, 5, 6\) \(no leading dimension is added\), each dimension 1 or "
        r"equal; got rank 1(\n|$)",
        dict(mask=jnp.ones((K,), bool)),
    ),
    "key mask [b, k]": (
        ValueError,
        r"mask of shape \(2, 6\) must have the rank .*; got rank 2; a key mask \[\.\.\., b, k\] is "
        r"mask\[\.\.\., :, None, None, :\]",
        dict(mask=jnp.ones((B, K), bool)),
    ),
    "bias not broadcastable": (
        ValueError,
        r"bias of shape \(3, 1, 1, 6\) does not broadcast to .*; dimension -4 \(b\) is 3, expected "
        r"1 or 2(\n|$)",
        dict(bias=jnp.ones((3, 1, 1, K))),
    ),
    "bool bias": (
        TypeError,
        r"bias must be a floating-point array, got dtype bool",
        dict(bias=jnp.ones((B, 1, 1, K), bool)),
    ),
    "nonbatched wrong shape": (
        ValueError,
        r"nonbatched_bias of shape \(2, 6, 5\) must be \[h, q, k\] = \(2, 5, 6\) or \[q, k\] = \(5, 6\)",
        dict(nonbatched_bias=jnp.ones((H, K, Q))),
    ),
    "nonbatched with batch": (
        ValueError,
        r"nonbatched_bias of shape \(2, 2, 5, 6\)",
        dict(nonbatched_bias=jnp.ones((B, H, Q, K))),
    ),
    "q_data rank": (
        ValueError,
        r"q_data must have rank >= 3.*got shape \(5, 8\)",
        dict(q_data=jnp.ones((Q, A))),
    ),
    "m_data rank": (
        ValueError,
        r"q_data \(2, 5, 8\) and m_data \(6, 8, 1\) must have the same batch",
        dict(m_data=jnp.ones((K, A, 1))),
    ),
    "batch differs": (
        ValueError,
        r"q_data \(2, 5, 8\) and m_data \(3, 6, 8\) must have the same batch dimensions",
        dict(m_data=jnp.ones((3, K, A))),
    ),
    "int q_data": (
        TypeError,
        r"q_data must be a floating-point array, got dtype int32",
        dict(q_data=jnp.ones((B, Q, A), jnp.int32)),
    ),
    "dtypes differ": (
        TypeError,
        r"q_data and m_data must have the same dtype, got float64 and bfloat16",
        dict(m_data=jnp.ones((B, K, A), jnp.bfloat16)),
    ),
}


@pytest.mark.parametrize("case", list(ATTENTION_ERRORS))
def test_attention_call_errors(case):
    error, match, overrides = ATTENTION_ERRORS[case]
    args = dict(q_data=q_data, m_data=m_data, mask=key_mask, nonbatched_bias=None, bias=None)
    args.update(overrides)
    bias = args.pop("bias")
    with pytest.raises(error, match=match):
        _apply(*args.values(), bias=bias)


CONFIG_ERRORS = {
    "key_dim not divisible": (
        dict(config=dict(num_head=3, key_dim=8)),
        r"key_dim=8 must be divisible by num_head=3",
    ),
    "value_dim not divisible": (
        dict(config=dict(num_head=2, value_dim=7)),
        r"value_dim=7 must be divisible by num_head=2",
    ),
    "default key_dim not divisible": (
        dict(config=dict(num_head=3)),
        r"key_dim=8 must be divisible by num_head=3",
    ),
    "num_head missing": (dict(config=dict(gating=True)), r"config.num_head is required"),
    "num_head zero": (dict(config=dict(num_head=0)), r"config.num_head must be an int >= 1, got 0"),
    "num_head float": (
        dict(config=dict(num_head=2.0)),
        r"config.num_head must be an int >= 1, got 2.0",
    ),
    "typo key": (
        dict(config=dict(num_heads=2)),
        r"config has unknown key\(s\) 'num_heads' \(did you mean 'num_head'\?\)",
    ),
    "output_dim zero": (dict(output_dim=0), r"output_dim must be an int >= 1, got 0"),
    "unknown implementation": (
        dict(global_config=dict(attention_implementation="flash")),
        r"global_config.attention_implementation must be one of \('auto', 'xla'",
    ),
    "module implementation": (
        dict(config=dict(num_head=2, attention_implementation="fast")),
        r"config.attention_implementation must be one of",
    ),
    "global typo": (
        dict(global_config=dict(zero_int=True)),
        r"global_config has unknown key 'zero_int'; did you mean 'zero_init'\?",
    ),
    "gating not bool": (
        dict(config=dict(num_head=2, gating="yes")),
        r"config.gating must be a bool, got 'yes'",
    ),
    "orientation": (
        dict(config=dict(num_head=2, orientation="diagonal")),
        r"config.orientation must be one of \('per_row', 'per_column'\), got 'diagonal'",
    ),
    "dropout rate": (
        dict(config=dict(num_head=2, dropout_rate=1.5)),
        r"config.dropout_rate must be a number in \[0, 1\), got 1.5",
    ),
    "chunk size": (
        dict(global_config=dict(query_chunk_size=-4)),
        r"global_config.query_chunk_size must be None or an int >= 1, got -4",
    ),
    "budget": (
        dict(global_config=dict(memory_budget_mib=0)),
        r"global_config.memory_budget_mib must be a positive number of MiB, got 0",
    ),
    "gpu memory fraction": (
        dict(global_config=dict(gpu_memory_fraction=1.5)),
        r"global_config.gpu_memory_fraction must be a number in \(0, 1\], got 1.5",
    ),
    "gpu memory fraction type": (
        dict(global_config=dict(gpu_memory_fraction="half")),
        r"global_config.gpu_memory_fraction must be a number in \(0, 1\], got 'half'",
    ),
    "subbatch": (
        dict(global_config=dict(subbatch_size=0)),
        r"global_config.subbatch_size must be None or an int >= 1, got 0",
    ),
    "remat policy": (
        dict(global_config=dict(remat_policy="dots")),
        r"global_config.remat_policy must be one of \('nothing', 'projections', 'everything'\), "
        r"got 'dots'",
    ),
    "config type": (
        dict(config=[("num_head", 2)]),
        r"config must be an ml_collections.ConfigDict or a mapping, got list",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_errors(case):
    kwargs, match = CONFIG_ERRORS[case]
    wrong_type = case in ("config type", "gating not bool")
    with pytest.raises(TypeError if wrong_type else ValueError, match=match):
        _apply(q_data, m_data, key_mask, **kwargs)


def test_af2_global_config_keys_are_accepted():
    af2_global = dict(
        bfloat16=True,
        bfloat16_output=False,
        deterministic=False,
        multimer_mode=False,
        subbatch_size=4,
        use_remat=False,
        zero_init=True,
        eval_dropout=False,
        use_dgram=False,
    )
    shapes = _apply(q_data, m_data, key_mask, global_config=af2_global)
    assert shapes["attention"]["output_w"].shape == (H, A // H, O)


def test_params_that_do_not_fit_name_the_parameter():
    fn = hk.transform(lambda q, m: ga.Attention(dict(num_head=H), {}, O)(q, m))
    params = random_params(fn, (q_data, m_data))
    with pytest.raises(
        ValueError,
        match=r"attention/~/query_w|attention/query_w|query_w.*\(16, 2, 4\).*\(8, 2, 4\)|query_w.*\(8, 2, 4\).*\(16, 2, 4\)",
    ):
        fn.apply(params, None, jnp.ones((B, Q, 2 * A)), m_data)


OP_ERRORS = {
    "kv heads differ": (
        dict(key=jnp.ones((B, K, 3, 4))),
        ValueError,
        r"key and value head counts K differ: 3 != 2",
    ),
    "query heads not a multiple": (
        dict(key=jnp.ones((B, K, 3, 4)), value=jnp.ones((B, K, 3, 4))),
        ValueError,
        r"query heads N=2 must be a multiple of key/value heads K=3 \(grouped-query attention\)",
    ),
    "lengths differ": (
        dict(value=jnp.ones((B, 5, 2, 4))),
        ValueError,
        r"key and value lengths S differ: 6 != 5",
    ),
    "head dims differ": (
        dict(key=jnp.ones((B, K, 2, 3))),
        ValueError,
        r"query and key head dims H differ: 4 != 3",
    ),
    "batch differs": (
        dict(key=jnp.ones((3, K, 2, 4)), value=jnp.ones((3, K, 2, 4))),
        ValueError,
        r"batch dimensions differ",
    ),
    "rank differs": (
        dict(key=jnp.ones((1, B, K, 2, 4))),
        ValueError,
        r"query, key and value must have the same rank \(the same batch dimensions before "
        r"\[T, N, H\], \[S, K, H\], \[S, K, Hv\]\), got ranks 4, 5 and 4: shapes \(2, 5, 2, 4\), "
        r"\(1, 2, 6, 2, 4\) and \(2, 6, 2, 4\)$",
    ),
    "dtypes differ": (  # jax.nn.dot_product_attention refuses them too
        dict(query=jnp.ones((B, Q, 2, 4), jnp.bfloat16)),
        ValueError,
        r"query, key and value must have the same dtype \(as in jax.nn.dot_product_attention\), "
        r"got bfloat16, float64 and float64; cast them to one$",
    ),
    "value dtype differs": (
        dict(value=jnp.ones((B, K, 2, 4), jnp.float32)),
        ValueError,
        r"must have the same dtype .*got float64, float64 and float32",
    ),
    "rank 2": (dict(query=jnp.ones((Q, 4))), ValueError, r"query must have rank >= 3"),
    "float mask": (
        dict(mask=jnp.ones((B, 1, 1, K))),
        TypeError,
        r"mask must be a boolean array .*got dtype float64",
    ),
    "mask shape": (
        dict(mask=jnp.ones((B, 1, 1, Q), bool)),
        ValueError,
        r"mask of shape \(2, 1, 1, 5\) must broadcast to \[\.\.\., N, T, S\] = \(2, 2, 5, 6\): "
        r"aligned on the right, rank <= 4, each dimension 1 or equal \(missing leading dimensions "
        r"count as 1\); dimension -1 \(S\) is 5, expected 1 or 6$",
    ),
    "lower-rank mask shape": (
        dict(mask=jnp.ones((Q, Q), bool)),
        ValueError,
        r"mask of shape \(5, 5\) must broadcast to \[\.\.\., N, T, S\] = \(2, 2, 5, 6\)",
    ),
    "bias rank": (
        dict(bias=jnp.ones((1, B, 2, Q, K))),
        ValueError,
        r"bias of shape \(1, 2, 2, 5, 6\) must broadcast to .* rank <= 4.*; got rank 5, expected at "
        r"most 4$",
    ),
    "lower-rank bias shape": (
        dict(bias=jnp.ones((3, Q, K))),
        ValueError,
        r"bias of shape \(3, 5, 6\) must broadcast to \[\.\.\., N, T, S\] = \(2, 2, 5, 6\).*; "
        r"dimension -3 \(N\) is 3, expected 1 or 2$",
    ),
    "float8 query": (
        dict(query=jnp.ones((B, Q, 2, 4), jnp.float8_e4m3fn)),
        TypeError,
        r"query must be a floating-point array of at least 16 bits, got dtype float8_e4m3fn "
        r"\(quantized inputs are not supported",
    ),
    "int8 key": (
        dict(key=jnp.ones((B, K, 2, 4), jnp.int8)),
        TypeError,
        r"key must be a floating-point array, got dtype int8",
    ),
    "is_causal": (dict(is_causal="yes"), TypeError, r"is_causal must be a bool, got 'yes'"),
    "window negative": (
        dict(local_window_size=-1),
        ValueError,
        r"local_window_size must be None, an int >= 0 or a \(left, right\) pair of ints >= 0, "
        r"got -1",
    ),
    "window triple": (
        dict(local_window_size=(1, 2, 3)),
        ValueError,
        r"local_window_size must be .*got \(1, 2, 3\)",
    ),
    "query lengths shape": (
        dict(query_seq_lengths=jnp.ones((3,), jnp.int32)),
        ValueError,
        r"query_seq_lengths must have the batch shape of query, query.shape\[:-3\] = \(2,\), got "
        r"shape \(3,\)",
    ),
    "kv lengths dtype": (
        dict(key_value_seq_lengths=jnp.ones((B,))),
        TypeError,
        r"key_value_seq_lengths must be None or an integer array, got dtype float64",
    ),
    "return_residual": (
        dict(return_residual=1),
        TypeError,
        r"return_residual must be a bool, got 1",
    ),
    "soft cap": (
        dict(logits_soft_cap=0.0),
        ValueError,
        r"logits_soft_cap must be a positive number, got 0.0",
    ),
    "precision": (
        dict(precision="fast"),
        ValueError,
        r"precision must be None, a jax.lax.Precision or one of \('default', 'high', 'highest'\), "
        r"got 'fast'",
    ),
    "logits_dtype": (
        dict(logits_dtype=jnp.bfloat16),
        ValueError,
        r"logits_dtype must be None or float64 \(logits are computed in float32, float64 for "
        r"float64 inputs\), got bfloat16",
    ),
    "int query": (
        dict(query=jnp.ones((B, Q, 2, 4), jnp.int32)),
        TypeError,
        r"query must be a floating-point array",
    ),
    "implementation": (
        dict(implementation="flash"),
        ValueError,
        r"implementation must be one of \('auto', 'xla'.*got 'flash'",
    ),
    "implementation type": (
        dict(implementation=3),
        TypeError,
        r"implementation must be a name, an implementation instance.*got int",
    ),
    "empty priority": (
        dict(implementation=()),
        ValueError,
        r"implementation must not be an empty sequence",
    ),
    "priority item": (
        dict(implementation=("xla", "flash")),
        ValueError,
        r"implementation\[1\] must be one of \('auto', 'xla'.*got 'flash'",
    ),
    "policy": (
        dict(compute_dtype="fp32"),
        ValueError,
        r"compute_dtype must be one of \('auto', 'input', 'float32'\), got 'fp32'",
    ),
    "empty key": (
        dict(key=jnp.ones((B, 0, 2, 4)), value=jnp.ones((B, 0, 2, 4))),
        ValueError,
        r"T, S, N, H and Hv must be non-empty",
    ),
}


@pytest.mark.parametrize("case", list(OP_ERRORS))
def test_op_errors(case):
    overrides, error, match = OP_ERRORS[case]
    args = dict(
        query=jnp.ones((B, Q, 2, 4)), key=jnp.ones((B, K, 2, 4)), value=jnp.ones((B, K, 2, 4))
    )
    args.update(overrides)
    with pytest.raises(error, match=match):
        ga.dot_product_attention(**args)


def test_implementation_tuning_errors():
    with pytest.raises(ValueError, match=r"query_chunk_size must be None or an int >= 1, got 0"):
        ga.ChunkedAttention(query_chunk_size=0)
    with pytest.raises(ValueError, match=r"memory_budget_bytes must be an int >= 1, got 1.5"):
        ga.ChunkedAttention(memory_budget_bytes=1.5)
    with pytest.raises(ValueError, match=r"memory_budget_bytes must be an int >= 1, got 0"):
        ga.Auto(memory_budget_bytes=0)


def test_cudnn_is_unavailable_on_cpu_with_a_clear_error():
    if jax.default_backend() == "gpu":
        pytest.skip("GPU present")
    args = (jnp.ones((B, Q, 2, 8), jnp.bfloat16),) * 3
    with pytest.raises(NotImplementedError, match=r"implementation='cudnn'.*GPU only"):
        ga.dot_product_attention(*args, implementation="cudnn")


GLOBAL_ERRORS = {
    "positions differ": (
        dict(m_data=jnp.ones((B, K, A))),
        ValueError,
        r"m_data has 6 positions but q_data has 5",
    ),
    "mask shape": (
        dict(q_mask=jnp.ones((B, 1, Q))),
        ValueError,
        r"q_mask of shape \(2, 1, 5\) must be \[\.\.\., b, q, 1\] = \(2, 5, 1\)",
    ),
    "int mask": (
        dict(q_mask=jnp.ones((B, Q, 1), jnp.int32)),
        TypeError,
        r"q_mask must be bool or float 0/1, got dtype int32",
    ),
}


@pytest.mark.parametrize("case", list(GLOBAL_ERRORS))
def test_global_attention_errors(case):
    overrides, error, match = GLOBAL_ERRORS[case]
    args = dict(q_data=q_data, m_data=q_data, q_mask=jnp.ones((B, Q, 1)))
    args.update(overrides)
    fn = hk.transform(lambda *a: ga.GlobalAttention(dict(num_head=H), {}, O)(*a))
    with pytest.raises(error, match=match):
        jax.eval_shape(fn.init, jax.random.PRNGKey(0), *args.values())


def test_no_assertion_error_reaches_callers():
    """Random junk shapes raise ValueError/TypeError only."""
    rng = np.random.default_rng(0)
    for _ in range(30):
        shapes = [
            tuple(int(d) for d in rng.integers(1, 4, size=rng.integers(1, 5))) for _ in range(3)
        ]
        # Shapes only (traced by _apply's eval_shape): jnp.ones would compile a program per shape.
        float_ = jnp.result_type(float)  # jnp.ones' default dtype
        q, m = (jax.ShapeDtypeStruct(s, float_) for s in shapes[:2])
        with contextlib.suppress(ValueError, TypeError):
            _apply(q, m, jax.ShapeDtypeStruct(shapes[2], bool))


def test_mixed_dtypes_refused_as_jax_nn_refuses_them():
    q = jnp.ones((B, Q, 2, 4), jnp.bfloat16)
    kv = jnp.ones((B, K, 2, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"query dtype should be float32, but got bfloat16"):
        jax.nn.dot_product_attention(q, kv, kv)  # jax.nn's rule, which ours follows
    with pytest.raises(ValueError, match=r"must have the same dtype .*got bfloat16, float32"):
        ga.dot_product_attention(q, kv, kv)
    same = ga.dot_product_attention(q, kv.astype(jnp.bfloat16), kv.astype(jnp.bfloat16))
    assert same.dtype == jnp.bfloat16  # cast to one dtype, it runs
