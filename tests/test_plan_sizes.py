"""``posttrain.plan.sizes``: each bound at its edge, each refusal's line in full.

The bounds (int32 counts and dimensions, int64 array bytes) are checked before anything is
built, so these call :func:`sizes.check` on the options and a config alone: no compile,
milliseconds a case. The byte figures are written out (4 bytes an element): 2**63 - 1 is
odd and every array's bytes a multiple of 4, so an array of 2**61 elements is the first
one refused.
"""

from __future__ import annotations

import dataclasses

import pytest

from posttrain.models import get_config
from posttrain.plan import sizes
from posttrain.plan.options import PlanOptions

pytestmark = pytest.mark.host  # integer bounds on options and a config: no device, no JAX

MAX = 2**31 - 1  # int32


def _options(**fields) -> PlanOptions:
    return PlanOptions(**{"model": "qwen3-tiny", "topology": "v5p-8", "seq": 1, **fields})


def _config(name: str = "qwen3-tiny", *, attention=None, moe=None, **fields):
    """A preset with ``fields`` replaced, each attention config's fields by ``attention``
    ({layer type: {field: value}}) and the MoE config's by ``moe``."""
    cfg = get_config(name)
    if attention:
        changed = {
            kind: dataclasses.replace(a, **attention.get(kind, {}))
            for kind, a in cfg.attention.items()
        }
        fields["attention"] = changed
    if moe:
        fields["moe"] = dataclasses.replace(cfg.moe, **moe)
    return dataclasses.replace(cfg, **fields)


def _refusal(options, cfg, batch) -> str:
    with pytest.raises(ValueError) as error:
        sizes.check(options, cfg, batch)
    return str(error.value)


@pytest.mark.parametrize(
    ("field", "flag"),
    [
        ("per_device_batch_size", "--per-device-batch-size"),
        ("new_tokens", "--new-tokens"),
        ("grad_accum", "--grad-accum"),
        ("lora_rank", "--lora-rank"),
    ],
)
def test_each_count_is_accepted_at_int32_max_and_refused_past_it(field, flag):
    """A count of the options equal to 2**31 - 1 passes (an SFT row of one token holds
    no new tokens); one more is refused naming the field, its flag and the bound."""
    cfg = _config()
    sizes.check(_options(**{field: MAX}), cfg, batch=1)
    assert _refusal(_options(**{field: MAX + 1}), cfg, batch=1) == (
        f"{field}={MAX + 1} ({flag}): expected at most {MAX} (2**31 - 1)"
    )


def test_the_global_batch_names_the_flag_it_came_from():
    """The global batch at 2**31 - 1 passes; past it the refusal names --batch when it was
    given, else the product it was made of."""
    cfg = _config()
    sizes.check(_options(), cfg, batch=MAX)
    derived = "--per-device-batch-size x the data-parallel size"
    assert _refusal(_options(), cfg, batch=MAX + 1) == (
        f"batch={MAX + 1} ({derived}): expected at most {MAX} (2**31 - 1)"
    )
    assert _refusal(_options(batch=MAX + 1), cfg, batch=MAX + 1) == (
        f"batch={MAX + 1} (--batch): expected at most {MAX} (2**31 - 1)"
    )


@pytest.mark.parametrize("workflow", ["generate", "dpo", "grpo"])
def test_a_row_holds_the_prompt_and_what_follows_it(workflow):
    """generate, DPO and GRPO rows hold seq + new_tokens tokens: at 2**31 - 1 the row
    passes its own bound (and is then refused for its attention scores); one more token
    is refused as a row."""
    cfg = _config()
    at_bound = _refusal(_options(workflow=workflow, seq=MAX - 10, new_tokens=10), cfg, 1)
    assert at_bound.startswith(f"batch=1, seq={MAX - 10} (--seq): the attention scores "), at_bound
    assert _refusal(_options(workflow=workflow, seq=MAX - 10, new_tokens=11), cfg, 1) == (
        f"tokens per row: seq={MAX - 10} + new_tokens=11 = {MAX + 1}; "
        f"expected at most {MAX} (2**31 - 1: positions are int32)"
    )


def test_an_sft_row_is_its_sequence_alone():
    """An SFT row is seq tokens, new_tokens set or not: seq = 2**31 - 1 reaches the
    arrays' check (its attention scores, [1, 8, seq, seq])."""
    message = _refusal(_options(seq=MAX, new_tokens=100), _config(), 1)
    assert message == (
        f"batch=1, seq={MAX} (--seq): the attention scores [batch=1, num_heads=8, "
        f"seq={MAX}, seq={MAX}] would be 1.48e+20 bytes; an array must be under 2**63 "
        "bytes (XLA counts them in int64)"
    )


def test_the_logits_are_refused_from_2_to_the_61_elements():
    """[batch, seq, vocab] float32 logits: 2**30 x 1 x (2**31 - 1) elements are 2**63 -
    2**32 bytes, under the bound; one more row is over it."""
    cfg = _config(vocab_size=MAX)
    sizes.check(_options(), cfg, batch=2**30)
    assert _refusal(_options(), cfg, batch=2**30 + 1) == (
        f"batch={2**30 + 1}, seq=1 (--seq): the logits [batch={2**30 + 1}, seq=1, "
        f"vocab_size={MAX}] would be 9.22e+18 bytes; an array must be under 2**63 bytes "
        "(XLA counts them in int64)"
    )


def test_the_tokens_are_refused_before_the_larger_arrays():
    """[batch, seq] tokens of (2**31 - 1) x (2**30 + 1): over 2**61 elements, named first."""
    assert _refusal(_options(seq=2**30 + 1), _config(), MAX) == (
        f"batch={MAX}, seq={2**30 + 1} (--seq): the tokens [batch={MAX}, seq={2**30 + 1}] "
        "would be 9.22e+18 bytes; an array must be under 2**63 bytes (XLA counts them in "
        "int64)"
    )


@pytest.mark.parametrize("wide", ["sliding", "full"])
def test_the_attention_scores_take_the_most_heads_of_any_layer_type(wide):
    """[batch, heads, seq, seq] with the most heads of any layer type (Gemma 4's sliding
    and full attention): 2**21 heads x 2**20 x 2**20 is 2**61 elements, refused; 2**21 -
    1 heads pass."""
    narrow = {"full": "sliding", "sliding": "full"}[wide]
    cfg = _config(
        "gemma4-tiny",
        attention={wide: {"num_heads": 2**21, "num_kv_heads": 1}, narrow: {"num_heads": 8}},
    )
    assert _refusal(_options(seq=2**20), cfg, 1) == (
        f"batch=1, seq={2**20} (--seq): the attention scores [batch=1, num_heads={2**21}, "
        f"seq={2**20}, seq={2**20}] would be 9.22e+18 bytes; an array must be under 2**63 "
        "bytes (XLA counts them in int64)"
    )
    fewer = _config("gemma4-tiny", attention={wide: {"num_heads": 2**21 - 1, "num_kv_heads": 1}})
    sizes.check(_options(seq=2**20), fewer, 1)


def test_the_embedding_names_the_model():
    """[vocab, d_model] of (2**31 - 1)^2 float32: the refusal leads with the model, the
    array holds no count of the options."""
    cfg = _config(vocab_size=MAX, d_model=MAX)
    assert _refusal(_options(), cfg, 1) == (
        f"--model qwen3-tiny: the embedding [vocab_size={MAX}, d_model={MAX}] would be "
        "1.84e+19 bytes; an array must be under 2**63 bytes (XLA counts them in int64)"
    )


def test_an_expert_stack_is_checked_for_moe_models_only():
    """[num_experts, d_model, moe_d_ff] float32: 2**31 - 1 experts of 72 x (2**31 - 1)
    are 1.33e+21 bytes. At 2**25 experts of 72 wide the widest stack under 2**61 elements
    is 2**33 // 9 (2**36 / 72) wide; one more is over."""
    moe = _config("qwen3_moe-tiny", moe={"num_experts": MAX, "moe_d_ff": MAX})
    assert _refusal(_options(model="qwen3_moe-tiny"), moe, 1) == (
        f"--model qwen3_moe-tiny: an expert stack [num_experts={MAX}, d_model=72, "
        f"moe_d_ff={MAX}] would be 1.33e+21 bytes; an array must be under 2**63 bytes (XLA "
        "counts them in int64)"
    )
    widest = 2**33 // 9
    sizes.check(
        _options(), _config("qwen3_moe-tiny", moe={"num_experts": 2**25, "moe_d_ff": widest}), 1
    )
    over = _config("qwen3_moe-tiny", moe={"num_experts": 2**25, "moe_d_ff": widest + 1})
    assert "an expert stack" in _refusal(_options(), over, 1)


def _with_heads(n):
    return _config(attention={"full": {"num_heads": n, "num_kv_heads": 1}})


def _with_head_dim(n):
    return _config(attention={"full": {"head_dim": n}})


def _with_experts(n):
    return _config("qwen3_moe-tiny", moe={"num_experts": n})


def _with_expert_width(n):
    return _config("qwen3_moe-tiny", moe={"moe_d_ff": n})


@pytest.mark.parametrize(
    ("name", "made", "edge"),
    [
        ("num_heads", _with_heads, MAX),
        ("head_dim", _with_head_dim, MAX - 1),  # even for RoPE's halves
        ("num_experts", _with_experts, MAX),
        ("moe_d_ff", _with_expert_width, MAX),
    ],
)
def test_each_model_dimension_is_refused_past_int32(name, made, edge):
    """The attention's heads and head_dim and the experts' count and width (the
    dimensions ModelConfig does not bound itself): the largest int32 passes, 2**31 is
    refused naming the field and the bound."""
    sizes.check(_options(), made(edge), 1)
    assert _refusal(_options(), made(MAX + 1), 1) == (
        f"{name}={MAX + 1}: expected at most {MAX} (2**31 - 1: token ids and indices are int32)"
    )


@pytest.mark.parametrize("wide", ["sliding", "full"])
def test_a_dimension_of_either_layer_type_is_checked(wide):
    """Gemma 4's sliding and full attention: whichever holds 2**31 heads or a head_dim of
    2**31 is refused, the other layer type's small one does not hide it."""
    narrow = {"full": "sliding", "sliding": "full"}[wide]
    heads = _config(
        "gemma4-tiny",
        attention={wide: {"num_heads": MAX + 1, "num_kv_heads": 1}, narrow: {"num_heads": 8}},
    )
    assert _refusal(_options(), heads, 1).startswith(f"num_heads={MAX + 1}: expected at most")
    dims = _config("gemma4-tiny", attention={wide: {"head_dim": 2**31}, narrow: {"head_dim": 12}})
    assert _refusal(_options(), dims, 1).startswith(f"head_dim={2**31}: expected at most")
