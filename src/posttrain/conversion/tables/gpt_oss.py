"""GPT-OSS (HF ``GptOssForCausalLM``).

Attention biases and sinks; router ``mlp.router.{weight, bias}``; experts already
``[E, in, out]`` with gate/up interleaved in the columns of ``gate_up_proj``
``[E, D, 2F]`` and its bias ``[E, 2F]``; ``down_proj`` ``[E, F, D]`` and its bias
``[E, D]`` as they are. One layout (no transformers conversion mapping). MXFP4
checkpoints (``*_blocks`` / ``*_scales``) are rejected by the engine.
"""

from posttrain.conversion.rows import Row
from posttrain.conversion.tables.common import ATTENTION_ROWS, GLOBAL_ROWS, L, Table
from posttrain.conversion.transforms import (
    GATE_UP_INTERLEAVED,
    GATE_UP_INTERLEAVED_BIAS,
    IDENTITY,
    TRANSPOSE,
)

N = L + "mlp."
MOE_ROWS = (
    Row(N + "router.kernel", N + "router.weight", TRANSPOSE),
    Row(N + "router.bias", N + "router.bias", IDENTITY),
    Row(
        (N + "experts.gate_proj", N + "experts.up_proj"),
        N + "experts.gate_up_proj",
        GATE_UP_INTERLEAVED,
    ),
    Row(
        (N + "experts.gate_proj_bias", N + "experts.up_proj_bias"),
        N + "experts.gate_up_proj_bias",
        GATE_UP_INTERLEAVED_BIAS,
    ),
    Row(N + "experts.down_proj", N + "experts.down_proj", IDENTITY),
    Row(N + "experts.down_proj_bias", N + "experts.down_proj_bias", IDENTITY),
)

TABLE = Table("gpt_oss", GLOBAL_ROWS + ATTENTION_ROWS + MOE_ROWS, "GptOssForCausalLM")
