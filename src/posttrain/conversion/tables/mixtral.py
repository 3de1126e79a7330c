"""Mixtral (HF ``MixtralForCausalLM``).

Hub layout: ``block_sparse_moe.gate.weight`` router and per-expert
``block_sparse_moe.experts.{j}.w1`` (gate), ``w3`` (up), ``w2`` (down). Fused layout
(``save_original_format=False``): ``mlp.gate.weight``, ``mlp.experts.gate_up_proj``
``[E, 2F, D]`` (w1 rows then w3 rows), ``mlp.experts.down_proj`` ``[E, D, F]``.
Reference: transformers ``conversion_mapping.py`` "mixtral".
"""

from posttrain.conversion.rows import FUSED, HUB, Row
from posttrain.conversion.tables.common import ATTENTION_ROWS, GLOBAL_ROWS, L, Table
from posttrain.conversion.transforms import (
    EXPERTS_STACK_T,
    EXPERTS_T,
    GATE_UP_CONCAT_T,
    TRANSPOSE,
)

N = L + "mlp."  # native
HUB_E = L + "block_sparse_moe.experts.{j}."
MOE_ROWS = (
    Row(N + "router.kernel", L + "block_sparse_moe.gate.weight", TRANSPOSE, HUB),
    Row(N + "experts.gate_proj", HUB_E + "w1.weight", EXPERTS_STACK_T, HUB),
    Row(N + "experts.up_proj", HUB_E + "w3.weight", EXPERTS_STACK_T, HUB),
    Row(N + "experts.down_proj", HUB_E + "w2.weight", EXPERTS_STACK_T, HUB),
    Row(N + "router.kernel", L + "mlp.gate.weight", TRANSPOSE, FUSED),
    Row(
        (N + "experts.gate_proj", N + "experts.up_proj"),
        L + "mlp.experts.gate_up_proj",
        GATE_UP_CONCAT_T,
        FUSED,
    ),
    Row(N + "experts.down_proj", L + "mlp.experts.down_proj", EXPERTS_T, FUSED),
)

TABLE = Table("mixtral", GLOBAL_ROWS + ATTENTION_ROWS + MOE_ROWS, "MixtralForCausalLM")
