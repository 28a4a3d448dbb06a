"""Working-set estimates: the bytes a row or a tile of work needs, and how many rows a budget holds.

Every rule that sizes a tile by memory reads its figures here, each a named function saying what
it counts, so that the rules (attention.Auto, XlaAttention's row tiles, modules.rows_per_tile,
pair_bias.tile_rows) and their tests agree on one set of formulas. The estimates count float32
(FLOAT32_BYTES) for what every implementation holds in float32 whatever the compute dtype: logits,
softmax weights, accumulators. They are plain integer arithmetic on the static shapes (Python
ints), so a rule picks the same tiles on every run and platform. A leaf module: it imports nothing
from the library.

Einsum letters as elsewhere: N heads, T query positions, S key positions of one batch row.
"""

from __future__ import annotations

from numbers import Real

MIB = 2**20  # bytes in a MiB (global_config.memory_budget_mib's unit)
FLOAT32_BYTES = 4  # one float32 element: logits, softmax weights, accumulators
PAIR_BIAS_ROW_ARRAYS = 6  # pair-row-sized float32 arrays a pair-bias tile holds per row


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
