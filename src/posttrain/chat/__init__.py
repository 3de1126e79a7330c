"""A checkpoint's own formats: its chat template (:mod:`.template`), the assistant mask
computed from the template's rendering (:mod:`.encode`), and its stop tokens and sampling
defaults (:mod:`.generation_config`). See ``docs/formats.md``."""

from posttrain.chat.encode import (
    MaskError,
    assistant_spans,
    check_conversation,
    encode_conversations,
    encode_prompt,
    prompt_text,
    split_completion,
    split_completions,
    token_mask,
    unpadded,
)
from posttrain.chat.generation_config import (
    DEFAULT_STOP_TOKENS,
    CheckpointFormats,
    check_template_tokens,
    checkpoint_formats,
    resolve_sampling,
    run_stop_ids,
    sampling_defaults,
    stop_ids,
    stop_ids_with_source,
    write_generation_config,
)
from posttrain.chat.template import (
    CHATML,
    ChatTemplate,
    TemplateError,
    chatml,
    load_template,
    resolve_template,
    save_template,
    special_tokens,
)

__all__ = [
    "CHATML",
    "DEFAULT_STOP_TOKENS",
    "ChatTemplate",
    "CheckpointFormats",
    "MaskError",
    "TemplateError",
    "assistant_spans",
    "chatml",
    "check_template_tokens",
    "checkpoint_formats",
    "check_conversation",
    "encode_conversations",
    "encode_prompt",
    "load_template",
    "prompt_text",
    "resolve_sampling",
    "resolve_template",
    "run_stop_ids",
    "sampling_defaults",
    "save_template",
    "special_tokens",
    "split_completion",
    "split_completions",
    "stop_ids",
    "stop_ids_with_source",
    "token_mask",
    "unpadded",
    "write_generation_config",
]
