"""Working-set estimates: the bytes a row or a tile of work needs, and how many rows a budget holds.

Every rule that sizes a tile by memory reads its figures here, each a named function saying what
it counts, so that the rules (attention.Auto, XlaAttention's row tiles, modules.rows_per_tile,
pair_bias.tile_rows, chunked_plan's blocks and chunks, the Pallas kernels' shared-memory and VMEM
checks) and their tests agree on one set of formulas. The estimates count float32
(FLOAT32_BYTES) for what every implementation holds in float32 whatever the compute dtype: logits,
softmax weights, accumulators. They are plain integer arithmetic on the static shapes (Python
ints), so a rule picks the same tiles on every run and platform. A leaf module: it imports nothing
from the library.

Einsum letters as elsewhere: N heads, T query positions, S key positions of one batch row.
"""

from __future__ import annotations

from numbers import Real
from typing import Any

import jax.numpy as jnp

MIB = 2**20  # bytes in a MiB (global_config.memory_budget_mib's unit)
FLOAT32_BYTES = 4  # one float32 element: logits, softmax weights, accumulators
PAIR_BIAS_ROW_ARRAYS = 6  # pair-row-sized float32 arrays a pair-bias tile holds per row
# The working-set budget (global_config.memory_budget_mib's default; the chunked tiles' and
# 'auto''s limits when no other is given).
DEFAULT_MEMORY_BUDGET_BYTES = 256 * MIB
# Float32 logits per tile of rows on CPU: a tile near this size stays in cache (docs/benchmarks.md,
# "On CPU: glibc's allocator": larger buffers are mapped afresh on every call). XlaAttention's
# tile_bytes default and the modules' own row tiles.
TILE_BYTES = 2 * MIB


def budget_bytes(memory_budget_mib: Real) -> int:
    """A budget in MiB (global_config.memory_budget_mib, any real number) in whole bytes, rounded
    down: int(memory_budget_mib * 2**20)."""
    return int(memory_budget_mib * MIB)


def logits_bytes(count: int) -> int:
    """count float32 logits: 4 * count bytes."""
    return FLOAT32_BYTES * count


def dense_logits_bytes(heads: int, q_len: int, kv_len: int) -> int:
    """One batch row's float32 logits in dense attention: 4 * N * T * S bytes."""
    return logits_bytes(heads * q_len * kv_len)


def dense_row_bytes(heads: int, q_len: int, kv_len: int) -> int:
    """One batch row's dense working set as attention.Auto counts it, its float32 logits and
    softmax weights: 2 * 4 * N * T * S bytes."""
    return 2 * dense_logits_bytes(heads, q_len, kv_len)


def logits_rows(tile_bytes: int, row_logits: int) -> int:
    """Whole rows of row_logits float32 logits each in tile_bytes: tile_bytes // (4 * row_logits),
    0 when one row alone exceeds it."""
    return tile_bytes // logits_bytes(row_logits)


def xla_tile_rows(tile_bytes: int, heads: int, q_len: int, kv_len: int) -> int:
    """Batch rows in one of XlaAttention's tiles: as many rows' float32 logits as tile_bytes
    holds, at least one: max(1, tile_bytes // (4 * N * T * S))."""
    return max(1, logits_rows(tile_bytes, heads * q_len * kv_len))


def attention_row_bytes(
    *, heads: int, queries: int, keys: int, k_len: int, key_dim: int, value_dim: int
) -> int:
    """AF2's dense working set for one row of modules.Attention, in float32: logits and weights
    (queries x k_len per head), q, the gate and the weighted average per query, k and v per key:

      4 * h * (2 * queries * k_len + queries * (key_dim + 2 * value_dim))
      + 4 * h * keys * (key_dim + value_dim)

    queries and keys count the row's query and key positions (over any extra axes), k_len the
    keys each query attends to; key_dim and value_dim are per head."""
    per_queries = 2 * queries * k_len + queries * (key_dim + 2 * value_dim)
    row = FLOAT32_BYTES * heads * per_queries
    return row + FLOAT32_BYTES * heads * keys * (key_dim + value_dim)


def attention_tile_row_bytes(
    *,
    heads: int,
    queries: int,
    keys: int,
    q_channels: int,
    m_channels: int,
    output_dim: int,
    key_dim: int,
    value_dim: int,
) -> int:
    """Ours for one row of modules.Attention in a training step, in float32, without the logits
    (every implementation holds only a tile of those): per query the input, output, q, gate,
    weighted and gated averages; per key the input, k and v and the op's head-major copies of
    them; and a cotangent of each:

      2 * 4 * (queries * (a + o + h * (2 * key_dim + 3 * value_dim))
               + keys * (m + 2 * h * (key_dim + value_dim)))

    a = q_channels, m = m_channels, o = output_dim; key_dim and value_dim per head."""
    per_query = q_channels + output_dim + heads * (2 * key_dim + 3 * value_dim)
    per_key = m_channels + 2 * heads * (key_dim + value_dim)
    return 2 * FLOAT32_BYTES * (queries * per_query + keys * per_key)


def global_attention_row_bytes(
    *, heads: int, queries: int, keys: int, key_dim: int, value_dim: int, output_dim: int
) -> int:
    """AF2's working set for one row of modules.GlobalAttention, in float32: the gate and the
    gated average per query, k and v (one shared head) per key:

      4 * queries * (2 * h * value_dim + o) + 4 * keys * (key_dim + value_dim)

    key_dim and value_dim per head (the shared key/value head's widths)."""
    row = FLOAT32_BYTES * (queries * (2 * heads * value_dim + output_dim))
    return row + FLOAT32_BYTES * keys * (key_dim + value_dim)


def global_attention_tile_row_bytes(
    *,
    heads: int,
    queries: int,
    keys: int,
    q_channels: int,
    m_channels: int,
    key_dim: int,
    value_dim: int,
    output_dim: int,
) -> int:
    """Ours for one row of modules.GlobalAttention in a training step: its row_bytes
    (global_attention_row_bytes) and the inputs, and a cotangent of each:

      2 * (row_bytes + 4 * (queries * a + keys * m))"""
    row = global_attention_row_bytes(
        heads=heads,
        queries=queries,
        keys=keys,
        key_dim=key_dim,
        value_dim=value_dim,
        output_dim=output_dim,
    )
    return 2 * (row + FLOAT32_BYTES * (queries * q_channels + keys * m_channels))


def module_tile_budget(memory_budget_bytes: int, subbatch_size, row_bytes: int) -> int:
    """The memory bound on one tile of a module's forward (modules.rows_per_tile): half of
    memory_budget_bytes, the other half being for what the tiles assemble (the loop's stacked
    outputs and input cotangents), at least 1; with an int subbatch_size (AF2's inference
    subbatching) the larger of that and subbatch_size * row_bytes, the memory AF2's dense
    attention takes for that many rows. subbatch_size None or 'auto': the budget alone."""
    bound = max(1, memory_budget_bytes // 2)
    if subbatch_size not in (None, "auto"):
        bound = max(bound, subbatch_size * row_bytes)
    return bound


def one_call(platform: str, working_set_bytes: int, budget_bytes: int) -> bool:
    """Whether a module's tiled work runs as one call: on a GPU where its whole working set fits
    the whole budget (one call assembles nothing, and a loop of tiles only serializes kernels that
    fill the device); elsewhere the tile rules decide (modules.rows_per_tile, pair-bias tiles)."""
    return platform == "gpu" and working_set_bytes <= budget_bytes


def pair_bias_row_bytes(k_len: int, c_z: int) -> int:
    """One pair row's working set while its bias is computed: about PAIR_BIAS_ROW_ARRAYS (6)
    float32 arrays of the row (the normed pair, LayerNorm temporaries, cotangents):
    6 * 4 * k_len * c_z bytes."""
    return PAIR_BIAS_ROW_ARRAYS * FLOAT32_BYTES * k_len * c_z


def pair_bias_tile_rows(q_len: int, k_len: int, c_z: int, budget_mib: Real) -> int:
    """Pair rows per bias tile (pair_bias.tile_rows): the rows whose pair_bias_row_bytes fit a
    quarter of the budget (the rest holds the attention's tiles and the pair's cotangent),
    clipped to [1, q_len]: max(1, min(q_len, int(budget_mib * 2**20) // (4 * 6 * 4 * k_len * c_z)))."""
    quarters = 4 * pair_bias_row_bytes(k_len, c_z)
    return max(1, min(q_len, budget_bytes(budget_mib) // quarters))


# The Pallas kernels' own estimates: what their check() compares with the hardware's limit
# (pallas_tpu.VMEM_LIMIT, pallas_tiles.SHARED_MEMORY_LIMIT) before a compile would fail.
TPU_LANES = 128  # a TPU vector register's lanes: a VMEM tile's last dimension pads to them
TPU_SUBLANES = 8  # its sublanes: a VMEM tile's second-last dimension pads to them


def tpu_vmem_bytes(
    *,
    block_q: int,
    block_k: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    value_dim: int,
    itemsize: int,
    pair_shapes: tuple,
) -> int:
    """About the VMEM of the largest Pallas TPU kernel (dk/dv, pallas_tpu_plan.Plan.vmem_estimate)
    for bq x bk tiles, N query and K key/value heads of head_dim and value_dim, inputs of itemsize
    bytes, and the biases' and mask's shapes pair_shapes ([B|1, N|1, T|1, S|1] each):

      int(1.25 * (2 * (tiles + pairs) + accumulators + temps))

    tiles: the q, do, k, v tiles ([rows, heads * width], lanes padded to TPU_LANES), double
    buffered as the pairs: each bias and mask tile counted float32 ([N|1, bq|8, bk|128], a
    broadcast dimension taking a vreg's sublanes or lanes); accumulators: float32, the larger
    of the dk/dv and dq ones; temps: eight float32 [max(bq, bk)]^2 arrays of one head (logits,
    weights, their gradient, the column/row conversions); 25 % on top."""
    bq, bk, n, kv = block_q, block_k, heads, kv_heads
    lanes = lambda count, d: -(-count * d // TPU_LANES) * TPU_LANES
    widths = lambda count: lanes(count, head_dim) + lanes(count, value_dim)
    tiles = (bq * widths(n) + bk * widths(kv)) * itemsize
    pairs = sum(
        s[1] * (bq if s[2] > 1 else TPU_SUBLANES) * (bk if s[3] > 1 else TPU_LANES) * FLOAT32_BYTES
        for s in pair_shapes
    )
    accumulators = max(kv * bk, n * bq) * (head_dim + value_dim) * FLOAT32_BYTES
    temps = 8 * max(bq, bk) * max(bq, bk) * FLOAT32_BYTES
    return int(1.25 * (2 * (tiles + pairs) + accumulators + temps))


def gpu_shared_memory_bytes(
    *,
    block_q: int,
    block_k: int,
    stages: int,
    padded_head_dim: int,
    itemsize: int,
    pair_itemsize: int,
) -> int:
    """An upper estimate of a Pallas GPU kernel's shared memory per block (attention/pallas_triton/implementation.py's check),
    bytes: per pipeline stage the two streamed key/value (or query/output-gradient) tiles and the
    bias and mask tiles, plus the two resident tiles, with a 10 % margin (checked against ptxas:
    benchmark_results/gpu_kernels/):

      int(1.1 * (stages * (2 * r * d * item + bq * bk * pair) + 2 * r * d * item))

    r = max(bq, bk); d = padded_head_dim (the larger head dim padded as in the tiles); item =
    itemsize, the compute dtype's; pair = pair_itemsize, the biases' itemsizes summed plus 1 for
    a mask (int8)."""
    rows = max(block_q, block_k)
    tile_bytes = block_q * block_k * pair_itemsize
    streamed = 2 * rows * padded_head_dim * itemsize + tile_bytes
    return int(1.1 * (stages * streamed + 2 * rows * padded_head_dim * itemsize))


# Float32 [B, N, tq, tk] buffers live at once in the chunked backward (p, dp, ds), which is also
# enough for its forward (logits, probabilities).
CHUNKED_TILE_BUFFERS = 3


def chunked_tile_bytes(
    batch: int,
    num_heads: int,
    query_chunk: int,
    key_chunk: int,
    head_dim: int,
    value_dim: int,
    dtype: Any,
) -> int:
    """The chunked implementation's per-tile working set that chunked_plan.choose_chunk_sizes
    keeps under the budget, in bytes.

    For every batch-head (B * N of them), with 4 bytes per float32 (8 for float64 inputs):
      3 * tq * tk * 4            logits/probabilities tiles (s and p; p, dp and ds in the backward,
                                 whose batch-summed bias gradient tile is no larger than ds),
      tq * (H + 2 * Hv + 2) * 4  query-chunk accumulators: dq, the output and dO rows, max and sum,
      tk * (2 * H + 2 * Hv) * 4  key-chunk accumulators dk, dv and the k, v tiles,
      tq * (H + Hv) * itemsize   the q and dO tiles.
    The first line dominates. It is an upper estimate: at B=1024, N=4, tiles 32x32 (193 MiB here)
    XLA reported under 100 MiB of temporaries besides the saved output.

    Args:
      batch: B.
      num_heads: N.
      query_chunk: tq.
      key_chunk: tk.
      head_dim: H.
      value_dim: Hv.
      dtype: the inputs' dtype.

    Returns:
      The estimate in bytes.
    """
    acc = jnp.dtype(jnp.promote_types(dtype, jnp.float32)).itemsize  # accumulation dtype
    item = jnp.dtype(dtype).itemsize
    per_head = (
        CHUNKED_TILE_BUFFERS * query_chunk * key_chunk * acc
        + query_chunk * (head_dim + 2 * value_dim + 2) * acc
        + key_chunk * (2 * head_dim + 2 * value_dim) * acc
        + query_chunk * (head_dim + value_dim) * item
    )
    return batch * num_heads * per_head


def chunked_block_row_bytes(
    heads, q_len, kv_len, query_chunk, key_chunk, head_dim, value_dim, dtype
) -> int:
    """One batch row of a chunked block: its tiles (chunked_tile_bytes) and its head-major
    copies of q, k, v and dO in the compute dtype: N * (T + S) * (H + Hv) * itemsize more."""
    copies = heads * (q_len + kv_len) * (head_dim + value_dim) * jnp.dtype(dtype).itemsize
    tiles = chunked_tile_bytes(1, heads, query_chunk, key_chunk, head_dim, value_dim, dtype)
    return tiles + copies
