"""memory.py's estimates: each equal to the formula its callers wrote inline before, and the
callers' choices (XlaAttention's row tiles, Auto's rule, modules.rows_per_tile, pair_bias.tile_rows,
the Pallas kernels' VMEM and shared-memory checks) unchanged."""

import itertools
import types

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gated_attention as ga
from gated_attention.af2 import pair_bias
from gated_attention.af2.modules import TILE_BYTES, rows_per_tile
from gated_attention.attention import base
from gated_attention.attention.pallas_mosaic_tpu import plan as pallas_tpu_plan
from gated_attention.attention.pallas_triton import tile_table as pallas_tiles
from gated_attention.core import memory

MIB = 2**20


# The formulas as the callers wrote them before memory.py, kept verbatim.
def _old_module_budget(budget_mib):  # modules._AttentionModule._run
    return int(budget_mib * 2**20)


def _old_auto_row_bytes(heads, q_len, kv_len):  # attention.Auto.choose
    return 2 * 4 * heads * q_len * kv_len


def _old_xla_rows(tile_bytes, heads, q_len, kv_len):  # xla.XlaAttention.__call__
    return max(1, tile_bytes // (4 * heads * q_len * kv_len))


def _old_cache_rows(tile_bytes, row_logits):  # modules.rows_per_tile
    return tile_bytes // (4 * row_logits)


def _old_bound(memory_budget_bytes, subbatch_size, row_bytes):  # modules.rows_per_tile
    bound = max(1, memory_budget_bytes // 2)
    if subbatch_size not in (None, "auto"):
        bound = max(bound, subbatch_size * row_bytes)
    return bound


def _old_attention(h, queries, keys, k_len, a, m, o, key_dim, value_dim):  # modules.Attention
    row_bytes = 4 * h * (2 * queries * k_len + queries * (key_dim + 2 * value_dim))
    row_bytes += 4 * h * keys * (key_dim + value_dim)
    per_query = a + o + h * (2 * key_dim + 3 * value_dim)
    per_key = m + 2 * h * (key_dim + value_dim)
    tile_row_bytes = 2 * 4 * (queries * per_query + keys * per_key)
    return row_bytes, tile_row_bytes


def _old_global(h, queries, keys, a, m, o, key_dim, value_dim):  # modules.GlobalAttention
    row_bytes = 4 * (queries * (2 * h * value_dim + o))
    row_bytes += 4 * keys * (key_dim + value_dim)
    tile_row_bytes = 2 * (row_bytes + 4 * (queries * a + keys * m))
    return row_bytes, tile_row_bytes


def _old_pair_bias_rows(shape, budget_mib):  # pair_bias.tile_rows
    q_len, k_len, c_z = shape
    return max(1, min(q_len, int(budget_mib * 2**20) // (4 * 6 * 4 * k_len * c_z)))


def _attention(h, queries, keys, k_len, a, m, o, key_dim, value_dim):
    dims = dict(heads=h, queries=queries, keys=keys, key_dim=key_dim, value_dim=value_dim)
    return (
        memory.attention_row_bytes(k_len=k_len, **dims),
        memory.attention_tile_row_bytes(q_channels=a, m_channels=m, output_dim=o, **dims),
    )


def _global(h, queries, keys, a, m, o, key_dim, value_dim):
    dims = dict(heads=h, queries=queries, keys=keys, key_dim=key_dim, value_dim=value_dim)
    return (
        memory.global_attention_row_bytes(output_dim=o, **dims),
        memory.global_attention_tile_row_bytes(q_channels=a, m_channels=m, output_dim=o, **dims),
    )


def test_concrete_numbers():
    assert memory.budget_bytes(256) == 268_435_456
    assert memory.budget_bytes(7680 / 2**20) == 7680
    assert memory.budget_bytes(0.1) == 104_857  # rounded down
    assert memory.logits_bytes(1000) == 4000
    assert memory.dense_logits_bytes(4, 64, 64) == 4 * 4 * 64 * 64 == 65_536
    assert memory.dense_row_bytes(4, 64, 64) == 2 * 4 * 4 * 64 * 64 == 131_072
    assert memory.dense_row_bytes(8, 16384, 16384) == 17_179_869_184  # 16 GiB: no overflow
    assert memory.logits_rows(2 * MIB, 4 * 128 * 128) == 8
    assert memory.logits_rows(2 * MIB, 4 * 1024 * 1024) == 0  # one row exceeds the tile
    assert memory.xla_tile_rows(2 * MIB, 4, 128, 128) == 8
    assert memory.xla_tile_rows(2 * MIB, 4, 1024, 1024) == 1  # at least one row
    assert memory.xla_tile_rows(1, 4, 64, 64) == 1
    # modules.Attention: 2 heads of 4 channels, 5 positions, 8 channels in and out.
    assert _attention(2, 5, 5, 5, 8, 8, 8, 4, 4) == (1200, 3840)
    # the family shape: 2 heads of 3, 6 positions, C_Z 6.
    assert _attention(2, 6, 6, 6, 6, 6, 6, 3, 3) == (1296, 3456)
    # modules.GlobalAttention, the same shape.
    assert _global(2, 5, 5, 8, 8, 8, 4, 4) == (640, 1920)
    assert memory.module_tile_budget(7680, None, 1200) == 3840
    assert memory.module_tile_budget(7680, "auto", 1200) == 3840
    assert memory.module_tile_budget(7680, 16, 1200) == 19_200
    assert memory.module_tile_budget(1, 1, 0) == 1  # at least one byte
    assert memory.pair_bias_row_bytes(6, 6) == 6 * 4 * 6 * 6 == 864
    assert memory.pair_bias_tile_rows(6, 6, 6, 4 * 96 * 6 * 6 / 2**20) == 4
    assert memory.pair_bias_tile_rows(6, 6, 6, 256) == 6  # clipped to q_len
    assert memory.pair_bias_tile_rows(6, 6, 6, 1e-9) == 1  # at least one row


def _grid(*values):
    return itertools.product(*values)


def test_each_estimate_equals_the_old_formula():
    budgets = (1e-9, 7680 / 2**20, 0.1, 1, 3.7, 256, 1024.5)
    for mib in budgets:
        assert memory.budget_bytes(mib) == _old_module_budget(mib)
    for h, t, s in _grid((1, 2, 3, 8), (1, 5, 64, 384), (1, 7, 64, 2048)):
        assert memory.dense_row_bytes(h, t, s) == _old_auto_row_bytes(h, t, s)
        for tile in (1, 4096, 2 * MIB, 2 * MIB + 3):
            assert memory.xla_tile_rows(tile, h, t, s) == _old_xla_rows(tile, h, t, s)
            assert memory.logits_rows(tile, h * t * s) == _old_cache_rows(tile, h * t * s)
    for dims in _grid((1, 2, 4), (5, 24), (5, 31), (5, 64), (3, 8), (8, 16), (4, 8)):
        h, queries, keys, a, m, o, c = dims
        for k_len, cv in ((keys, c), (1, 2 * c)):
            args = h, queries, keys, a, m, o, c, cv
            assert _global(*args) == _old_global(*args)
            args = h, queries, keys, k_len, a, m, o, c, cv
            assert _attention(*args) == _old_attention(*args)
    for budget, subbatch, row in _grid(
        (1, 2, 7680, 64 * MIB + 1), (None, "auto", 1, 4, 16), (1, 1200, 8 * MIB)
    ):
        assert memory.module_tile_budget(budget, subbatch, row) == _old_bound(budget, subbatch, row)
    for shape in _grid((1, 6, 384), (1, 6, 384), (6, 128)):
        for mib in budgets:
            expected = _old_pair_bias_rows(shape, mib)
            assert memory.pair_bias_tile_rows(*shape, mib) == expected
            assert pair_bias.tile_rows(shape, memory.budget_bytes(mib)) == expected


def _rows(batch, subbatch_size, budget, row_tile, queries=5, logits=None):
    row_bytes, tile_row_bytes = row_tile
    return rows_per_tile(
        batch,
        subbatch_size,
        budget,
        row_bytes=row_bytes,
        tile_row_bytes=tile_row_bytes,
        row_queries=queries,
        row_logits=logits,
        platform="cpu",
    )


def test_rows_per_tile_from_the_estimates():
    """test_alphafold's tiling case: a 7,680-byte budget, 2 heads of 4 channels, 5 positions,
    batch 7: Attention 1 row a tile up to subbatch_size 6, 2 at 7, 5 at 16; GlobalAttention 2
    rows up to 7, 5 at 16."""
    attention = _attention(2, 5, 5, 5, 8, 8, 8, 4, 4)
    glob = _global(2, 5, 5, 8, 8, 8, 4, 4)
    expected = {None: (1, 2), 4: (1, 2), 6: (1, 2), 7: (2, 2), 16: (5, 5)}
    for subbatch_size, rows in expected.items():
        assert _rows(7, subbatch_size, 7680, attention, logits=2 * 5 * 5) == rows[0]
        assert _rows(7, subbatch_size, 7680, glob) == rows[1]
    # On CPU, cut to TILE_BYTES of float32 logits once a tile holds 1,024 queries.
    big = (MIB, MIB)
    assert TILE_BYTES // memory.logits_bytes(4 * 128 * 128) == 8
    assert _rows(1000, None, 64 * MIB, big, queries=128, logits=4 * 128 * 128) == 8
    assert _rows(1000, None, 64 * MIB, big, queries=64, logits=4 * 64 * 64) == 32


def test_module_tiles_traced():
    """The tiles modules.Attention and GlobalAttention trace on that budget (jax.eval_shape: no
    compilation): full pieces and the remainder, as before memory.py."""
    x = jnp.zeros((7, 5, 8), jnp.float32)
    mask = jnp.ones((7, 1, 1, 5), bool)
    q_mask = jnp.ones((7, 5, 1), bool)
    global_config = dict(
        zero_init=False, memory_budget_mib=7680 / 2**20, attention_implementation="xla"
    )

    def forward(x, mask, q_mask):
        attention = ga.Attention(dict(num_head=2), global_config, 8)
        glob = ga.GlobalAttention(dict(num_head=2), global_config, 8)
        return [
            (attention(x, x, mask, subbatch_size=s), glob(x, x, q_mask, subbatch_size=s))
            for s in (None, 7)
        ]

    transformed = hk.without_apply_rng(hk.transform(forward))
    params = jax.eval_shape(transformed.init, jax.random.PRNGKey(0), x, mask, q_mask)
    with ga.record_implementation_choices() as choices:
        jax.eval_shape(transformed.apply, params, x, mask, q_mask)
    assert [c["query"][0] for c in choices] == [1, 2, 1, 2, 1, 2, 1]


def _spec(batch, length, heads=4, head_dim=32):
    return jax.ShapeDtypeStruct((batch, length, heads, head_dim), jnp.float32)


def test_auto_rule_from_the_estimate():
    small = _spec(2, 64)
    row_bytes = memory.dense_row_bytes(4, 64, 64)
    assert row_bytes == 131_072

    def chosen(auto):
        impl, reason = auto.choose(small, small, small, (), None, compute_dtype=jnp.float32)
        assert "0.125 MiB" in reason
        return impl.name

    assert chosen(ga.Auto(dense_row_bytes=row_bytes)) == "xla"
    assert chosen(ga.Auto(dense_row_bytes=row_bytes - 1)) == "chunked"
    assert chosen(ga.Auto(memory_budget_bytes=row_bytes - 1)) == "chunked"


@pytest.mark.parametrize("tile_bytes, expected", [(2 * MIB, 8), (4 * 4 * 128 * 128 * 3 - 1, 2)])
def test_xla_tile_rows_used(monkeypatch, tile_bytes, expected):
    """XlaAttention tiles its batch rows by memory.xla_tile_rows."""
    seen = []

    def in_row_tiles(fn, rows, args):
        seen.append(rows)
        return fn(*args)

    monkeypatch.setattr(base, "in_row_tiles", in_row_tiles)
    q = jnp.asarray(np.zeros((20, 128, 4, 8)), jnp.float32)
    ga.XlaAttention(tile_bytes=tile_bytes)(q, q, q, (), None, scale=1.0, compute_dtype=jnp.float32)
    assert seen == [expected] == [_old_xla_rows(tile_bytes, 4, 128, 128)]


# The Pallas kernels' estimates as they were written before they moved here, kept verbatim.
def _old_vmem_estimate(self, itemsize):  # pallas_tpu._Plan.vmem_estimate
    LANES = 128  # noqa: N806
    bq, bk, n, kv = self.block_q, self.block_k, self.heads, self.kv_heads
    lanes = lambda heads, d: -(-heads * d // LANES) * LANES
    widths = lambda heads: lanes(heads, self.head_dim) + lanes(heads, self.value_dim)
    tiles = (bq * widths(n) + bk * widths(kv)) * itemsize
    pairs = sum(
        (s[1] * (bq if s[2] > 1 else 8) * (bk if s[3] > 1 else LANES)) * 4
        for s in self.bias_shapes + ((self.mask_shape,) if self.mask_shape else ())
    )
    accumulators = max(kv * bk, n * bq) * (self.head_dim + self.value_dim) * 4
    temps = 8 * max(bq, bk) * max(bq, bk) * 4
    return int(1.25 * (2 * (tiles + pairs) + accumulators + temps))


def _old_shared_memory(block_q, block_k, stages, head_dim, dtype, biases, masked):
    # pallas_tiles.shared_memory_estimate
    item = jnp.dtype(dtype).itemsize
    padded, rows = pallas_tiles._pow2_tile(head_dim), max(block_q, block_k)
    tile_bytes = block_q * block_k * (sum(jnp.dtype(b.dtype).itemsize for b in biases) + masked)
    streamed = 2 * rows * padded * item + tile_bytes
    return int(1.1 * (stages * streamed + 2 * rows * padded * item))


_PAIRS = ((), ((1, 4, 300, 260),), ((2, 1, 300, 260), (1, 4, 1, 260)), ((2, 4, 1, 1),))


def test_tpu_vmem_equals_the_old_estimate():
    """memory.tpu_vmem_bytes, and Plan.vmem_estimate through it, give the integers the plan's own
    estimate gave."""
    sd = jax.ShapeDtypeStruct
    for bq, bk, (n, kv), (h, hv), itemsize, pairs in _grid(
        (128, 256, 300), (128, 384, 260), ((1, 1), (4, 1), (4, 2), (8, 8)),
        ((8, 8), (16, 64), (100, 40), (128, 128)), (2, 4), _PAIRS,
    ):  # fmt: skip
        for mask in (None, pairs[-1] if pairs else (2, 1, 1, 260)):
            plan = types.SimpleNamespace(
                block_q=bq, block_k=bk, heads=n, kv_heads=kv, head_dim=h, value_dim=hv,
                bias_shapes=pairs, mask_shape=mask,
            )  # fmt: skip
            new = memory.tpu_vmem_bytes(
                block_q=bq, block_k=bk, heads=n, kv_heads=kv, head_dim=h, value_dim=hv,
                itemsize=itemsize, pair_shapes=pairs + ((mask,) if mask else ()),
            )  # fmt: skip
            assert new == _old_vmem_estimate(plan, itemsize)
    impl = ga.PallasTpuAttention(block_q=256, block_k=128)
    q, kv = sd((2, 300, 4, 64), jnp.bfloat16), sd((2, 260, 2, 64), jnp.bfloat16)
    biases = tuple(sd(s, jnp.float32) for s in _PAIRS[2])
    mask = sd((2, 1, 1, 260), bool)
    plan = pallas_tpu_plan.Plan.make(impl, q, kv, kv, biases, mask, 1.0, jnp.bfloat16, base.PLAIN)
    assert plan.vmem_estimate(2) == _old_vmem_estimate(plan, 2) == 4_474_880


def test_gpu_shared_memory_equals_the_old_estimate():
    """memory.gpu_shared_memory_bytes at the padded head dim gives the integers
    pallas_tiles.shared_memory_estimate gave."""
    sd = jax.ShapeDtypeStruct
    bias_sets = ((), (jnp.float32,), (jnp.bfloat16, jnp.float32), (jnp.float16,))
    for bq, bk, stages, h, dtype, bias_dtypes, masked in _grid(
        (16, 32, 64, 128), (16, 64, 128), (1, 2, 3, 4), (8, 16, 40, 64, 100, 128),
        (jnp.float32, jnp.bfloat16, jnp.float16), bias_sets, (False, True),
    ):  # fmt: skip
        biases = tuple(sd((1, 2, 3, 4), d) for d in bias_dtypes)
        new = memory.gpu_shared_memory_bytes(
            block_q=bq,
            block_k=bk,
            stages=stages,
            padded_head_dim=pallas_tiles._pow2_tile(h),
            itemsize=jnp.dtype(dtype).itemsize,
            pair_itemsize=sum(jnp.dtype(d).itemsize for d in bias_dtypes) + masked,
        )
        assert new == _old_shared_memory(bq, bk, stages, h, dtype, biases, masked)
    # 128 x 128 float32 tiles, 2 stages, head dim 128, a float32 bias and a mask.
    args = dict(block_q=128, block_k=128, stages=2, padded_head_dim=128, itemsize=4)
    assert memory.gpu_shared_memory_bytes(**args, pair_itemsize=5) == 612_761


def test_kernel_checks_use_the_estimates(monkeypatch):
    """PallasAttention.check and PallasTpuAttention.check refuse tiles by memory's estimates."""
    sd = jax.ShapeDtypeStruct
    q = sd((2, 64, 2, 32), jnp.float32)
    gpu, tpu = ga.PallasAttention(), ga.PallasTpuAttention()
    gpu.check(q, q, q, (), None, compute_dtype=jnp.float32, platform="gpu")
    tpu.check(q, q, q, (), None, compute_dtype=jnp.float32, platform="tpu")
    monkeypatch.setattr(memory, "gpu_shared_memory_bytes", lambda **kw: 10**9)
    monkeypatch.setattr(memory, "tpu_vmem_bytes", lambda **kw: 10**9)
    with pytest.raises(NotImplementedError, match="1,000,000,000 bytes of shared memory"):
        gpu.check(q, q, q, (), None, compute_dtype=jnp.float32, platform="gpu")
    with pytest.raises(NotImplementedError, match="1,000,000,000 bytes of VMEM"):
        tpu.check(q, q, q, (), None, compute_dtype=jnp.float32, platform="tpu")


def _old_chunked_tile_bytes(
    batch, heads, tq, tk, head_dim, value_dim, dtype
):  # attention/xla_chunked/implementation.py
    acc = jnp.dtype(jnp.promote_types(dtype, jnp.float32)).itemsize
    item = jnp.dtype(dtype).itemsize
    per_head = (
        3 * tq * tk * acc
        + tq * (head_dim + 2 * value_dim + 2) * acc
        + tk * (2 * head_dim + 2 * value_dim) * acc
        + tq * (head_dim + value_dim) * item
    )
    return batch * heads * per_head


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
def test_chunked_estimates_are_the_old_formulas(dtype):
    """chunked's tile working set and a block row's (tiles plus head-major copies), as
    ChunkedAttention.tiling wrote them inline, and the blocks it then picks."""
    for b, n, tq, tk, h, hv in itertools.product(
        (1, 3), (1, 4), (8, 64), (16, 128), (8, 32), (8, 16)
    ):
        want = _old_chunked_tile_bytes(b, n, tq, tk, h, hv, dtype)
        assert memory.chunked_tile_bytes(b, n, tq, tk, h, hv, dtype) == want
        t, s = 37, 29
        copies = n * (t + s) * (h + hv) * jnp.dtype(dtype).itemsize
        got = memory.chunked_block_row_bytes(n, t, s, tq, tk, h, hv, dtype)
        assert got == _old_chunked_tile_bytes(1, n, tq, tk, h, hv, dtype) + copies
    # The blocks and chunks ChunkedAttention.tiling picked before the move (float32).
    if dtype != jnp.float32:
        return
    picked = {
        2 * MIB: [(1, 128, 128), (6, 37, 29), (1, 64, 256)],
        16 * MIB: [(8, 128, 128), (30, 37, 29), (8, 64, 256)],
        64 * MIB: [(32, 128, 128), (30, 37, 29), (32, 64, 256)],
    }
    shapes = [(64, 4, 128, 128, 32, 32), (30, 8, 37, 29, 16, 8), (256, 4, 64, 256, 32, 32)]
    for block_bytes, want in picked.items():
        impl = ga.ChunkedAttention(block_bytes=block_bytes)
        assert [impl.tiling(*shape, dtype) for shape in shapes] == want
