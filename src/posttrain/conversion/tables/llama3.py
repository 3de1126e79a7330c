"""Llama 3 (HF ``LlamaForCausalLM``): nothing fused; optional attention / MLP biases."""

from posttrain.conversion.tables.common import ATTENTION_ROWS, DENSE_MLP_ROWS, GLOBAL_ROWS, Table

TABLE = Table("llama3", GLOBAL_ROWS + ATTENTION_ROWS + DENSE_MLP_ROWS, "LlamaForCausalLM")
