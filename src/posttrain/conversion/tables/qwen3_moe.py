"""Qwen3-MoE (HF ``Qwen3MoeForCausalLM``).

Router ``mlp.gate.weight`` ``[E, D]``. Experts: hub layout (what ``save_pretrained``
writes by default, and real checkpoints) one 2-D weight per expert,
``mlp.experts.{j}.gate_proj/up_proj/down_proj.weight``; fused layout
(``save_original_format=False``) ``mlp.experts.gate_up_proj`` ``[E, 2F, D]`` (gate
rows then up rows) and ``mlp.experts.down_proj`` ``[E, D, F]``. Reference:
transformers ``conversion_mapping.py`` "qwen2_moe" (reused by qwen3_moe).
"""

from posttrain.conversion.rows import FUSED, HUB, Row
from posttrain.conversion.tables.common import ATTENTION_ROWS, GLOBAL_ROWS, L, Table
from posttrain.conversion.transforms import (
    EXPERTS_STACK_T,
    EXPERTS_T,
    GATE_UP_CONCAT_T,
    TRANSPOSE,
)

E = L + "mlp.experts."
MOE_ROWS = (
    Row(L + "mlp.router.kernel", L + "mlp.gate.weight", TRANSPOSE),
    Row(E + "gate_proj", E + "{j}.gate_proj.weight", EXPERTS_STACK_T, HUB),
    Row(E + "up_proj", E + "{j}.up_proj.weight", EXPERTS_STACK_T, HUB),
    Row(E + "down_proj", E + "{j}.down_proj.weight", EXPERTS_STACK_T, HUB),
    Row((E + "gate_proj", E + "up_proj"), E + "gate_up_proj", GATE_UP_CONCAT_T, FUSED),
    Row(E + "down_proj", E + "down_proj", EXPERTS_T, FUSED),
)

TABLE = Table("qwen3_moe", GLOBAL_ROWS + ATTENTION_ROWS + MOE_ROWS, "Qwen3MoeForCausalLM")
