"""Qwen3 dense (HF ``Qwen3ForCausalLM``): Llama rows plus per-head q/k norms (``QK_NORM``)."""

from posttrain.conversion.tables.common import ATTENTION_ROWS, DENSE_MLP_ROWS, GLOBAL_ROWS, Table

TABLE = Table("qwen3", GLOBAL_ROWS + ATTENTION_ROWS + DENSE_MLP_ROWS, "Qwen3ForCausalLM")
