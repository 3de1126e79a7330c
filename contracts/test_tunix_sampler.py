"""Contracts on Tunix's sampler driving our model (``posttrain.tunix_sampler``): the matrix's
generate cells. Each release row runs them against its installed Tunix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("tunix.generate.sampler", reason="google-tunix is not installed")

from posttrain import generate, tunix_sampler  # noqa: E402
from posttrain.models import build_model, get_config  # noqa: E402
from posttrain.tokenizer import byte_tokenizer  # noqa: E402

PROMPTS = ["hello there", "hi", "a longer prompt, left-padded"]
STEPS = 12  # past the tiny presets' sliding window (8)


def _greedy_both(model, **options):
    """Tunix's ``Sampler`` and our ``generate``, greedy, over ``model`` on
    :data:`PROMPTS` (``options`` go to the sampler): ``(sampler, its output, the
    prompts' ids, our Generation, the pad id)``."""
    tok = byte_tokenizer()
    eos = tok.token_to_id("<|im_end|>")
    sampler = tunix_sampler.make_sampler(model, tok, cache_size=64)
    theirs = tunix_sampler.run(
        sampler,
        PROMPTS,
        max_generation_steps=STEPS,
        max_prompt_length=32,
        temperature=0.0,
        eos_tokens=[eos],  # the tokenizer's eos_id() too, for releases without the option
        **options,
    )
    ids = [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]
    pad = tok.token_to_id("<|pad|>")  # TunixTokenizer's: a token the model never generates
    sampling = generate.SamplingConfig(max_new_tokens=STEPS, eos_ids=(eos,), pad_id=pad)
    return sampler, theirs, ids, generate.generate(model, ids, sampling), pad


@pytest.mark.contract("tunix.generate.sampler.Sampler")
@pytest.mark.parametrize(
    "name", ["qwen3-tiny", pytest.param("gemma4-tiny", marks=pytest.mark.slow)]
)  # the matrix runs the slow tier too
def test_tunix_sampler_greedy_equals_ours(name):
    """The installed release's Sampler (init_cache, prefill and decode calls, masks,
    end_index slots) generates our greedy tokens, token for token; Gemma 4's full layers
    have their own kv heads and head_dim (the sampler must use our init_cache). A
    release that probes for ``decode_only_last_token`` (0.1.7+) finds it and prefills
    with the last position's logits only."""
    sampler, theirs, _, ours, pad = _greedy_both(build_model(get_config(name), seed=1))
    probe = getattr(sampler, "_supports_decode_only_last_token", None)  # 0.1.7+
    assert probe is None or probe is True
    assert all(pad not in ours.row(i) for i in range(len(PROMPTS)))
    for i, tokens in enumerate(theirs.tokens):
        assert [int(t) for t in tokens] == ours.row(i)[:STEPS], i


def _sampler_returns_logprobs() -> bool:
    import inspect

    from tunix.generate import sampler as sampler_lib

    return "return_logprobs" in inspect.signature(sampler_lib.Sampler.__call__).parameters


@pytest.mark.contract("tunix.generate.sampler return_logprobs and the trainer's logps")
@pytest.mark.slow  # the matrix runs it in every row; the gate's sampler contract is greedy
@pytest.mark.skipif(
    not _sampler_returns_logprobs(),
    reason="this google-tunix's Sampler has no return_logprobs (0.1.6+)",
)
def test_the_samplers_logprobs_equal_ours_and_the_trainers():
    """Greedy over our model: the installed Sampler's per-token logprobs of its
    completions equal our ``generate``'s and Tunix's trainer logps of the same
    completions (``compute_per_token_logps``, T = 1): the rollout's and the learner's
    numbers for one sequence agree (bug class 4's other half)."""
    from posttrain.rl import tunix_rl
    from posttrain.training.policy import TunixPolicy

    model = build_model(get_config("qwen3-tiny"), seed=1)
    _, theirs, ids, ours, _ = _greedy_both(model, return_logprobs=True)
    policy, wrapped = TunixPolicy(model), tunix_sampler.TunixTokenizer(byte_tokenizer())
    for i, tokens in enumerate(theirs.tokens):
        n = len(tokens)
        got = np.asarray(theirs.logprobs[i][:n], np.float32)
        assert n > 0 and np.all(got < 0), got
        np.testing.assert_allclose(got, ours.logprobs[i, :n], atol=1e-5, err_msg=str(i))
        trainer = tunix_rl.per_token_logps(
            policy,
            jnp.asarray([ids[i]], jnp.int32),
            jnp.asarray([list(tokens)], jnp.int32),
            pad_id=wrapped.pad_id(),
            eos_id=wrapped.eos_id(),
        )
        np.testing.assert_allclose(got, np.asarray(trainer)[0], atol=2e-5, err_msg=str(i))


@pytest.mark.contract("tunix.generate.tokenizer_adapter.TokenizerAdapter")
def test_our_tokenizer_passes_tunix_tokenizer_adapter():
    adapter_lib = pytest.importorskip("tunix.generate.tokenizer_adapter")
    adapter = adapter_lib.TokenizerAdapter(tunix_sampler.TunixTokenizer(byte_tokenizer()))
    ids = adapter.encode("héllo")
    assert list(ids) == byte_tokenizer().encode("héllo", add_special_tokens=False).ids
    assert adapter.decode(ids) == "héllo"
    assert adapter.eos_id() == byte_tokenizer().token_to_id("<|im_end|>")
    assert adapter.pad_id() == byte_tokenizer().token_to_id("<|pad|>")


@pytest.mark.contract("tunix.generate.sampler decode call (positional <= 0.1.5, keywords 0.1.6+)")
# the matrix runs it in every row; in the gate the positional decode call is
# tests/test_generate.py's incremental decoding, the keyword one the installed Sampler's
# (0.1.7: the greedy contract above)
@pytest.mark.slow
def test_positional_and_keyword_decode_calls_agree():
    """Emulated drift: google-tunix <= 0.1.5 decodes with ``model(tok, pos, cache, mask)``,
    0.1.6+ with ``positions=``, ``cache=``, ``attention_mask=`` keywords."""
    model = build_model(get_config("gpt_oss-tiny"), seed=1)
    call = nnx.jit(lambda m, *args, **kwargs: m(*args, **kwargs))  # the binding is Python's
    tokens = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
    positions = jnp.arange(4)[None]
    slots = jnp.arange(16)
    mask = (slots[None, :] <= jnp.arange(4)[:, None])[None]
    _, cache = call(model, tokens, positions, model.init_cache(1, 16, "float32"), mask)
    step_mask = (slots <= 4)[None, None]
    last, pos = tokens[:, -1:], positions[:, -1:] + 1
    a, cache_a = call(model, last, pos, cache, step_mask)
    b, cache_b = call(model, last, positions=pos, cache=cache, attention_mask=step_mask)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for x, y in zip(jax.tree.leaves(cache_a), jax.tree.leaves(cache_b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


class _Calls:
    """Where the callbacks land: a plain object, so every nnx copy of the module shares
    it (flax 0.11 treats a list attribute as graph data and copies it)."""

    def __init__(self):
        self.lengths: list[int] = []


class _Counting(nnx.Module):
    """A model that counts its executed calls (a host callback per call: the sampler
    traces each call site once and runs it many times)."""

    def __init__(self, model, calls: _Calls):
        self.model = model
        self.config = model.config
        self._calls = calls

    def init_cache(self, batch, cache_size, dtype=None):
        return self.model.init_cache(batch, cache_size, dtype)

    def __call__(self, input_tokens, positions=None, cache=None, attention_mask=None):
        jax.debug.callback(lambda t: self._calls.lengths.append(int(t)), input_tokens.shape[1])
        return self.model(input_tokens, positions, cache, attention_mask)


@pytest.mark.contract("tunix.generate.sampler model calls per generate")
@pytest.mark.slow  # the matrix runs it in every row
def test_the_sampler_calls_the_model_once_per_step_plus_one():
    """Bug class 1 (shared/research/tunix-rl.md 7): with N new tokens and no EOS, every
    release's decode loop runs N times after the prefill, one more than the N - 1 it
    needs (its last token is never used); main (f8a25bef) runs N - 1. The adapter reads
    which from the loop's condition (``tunix_sampler.decode_calls``); this pins that the
    model sees exactly that many calls, and that either way the output has N tokens."""
    calls = _Calls()
    model = _Counting(build_model(get_config("qwen3-tiny"), seed=1), calls)
    tok = tunix_sampler.TunixTokenizer(byte_tokenizer(), eos="<|reserved_3|>")
    sampler = tunix_sampler.make_sampler(model, tok, cache_size=32)
    steps = 4
    out = tunix_sampler.run(
        sampler, ["hello"], max_generation_steps=steps, max_prompt_length=8, temperature=0.0
    )
    jax.effects_barrier()
    assert len(out.tokens[0]) == steps
    lengths = calls.lengths
    assert tunix_sampler.decode_calls(steps) in (steps, steps - 1)
    decodes = [1] * tunix_sampler.decode_calls(steps)
    assert lengths[0] > 1 and lengths[1:] == decodes, lengths  # prefill, then the decodes


@pytest.mark.contract("tunix.generate.sampler BOS and EOS handling")
@pytest.mark.slow  # the matrix runs it in every row
def test_prompts_start_with_one_bos_and_completions_end_before_the_eos():
    """Bug class 2: a tokenizer whose ``bos_id()`` is set gets exactly one BOS at the
    first non-pad prompt position on every release (``TunixTokenizer.encode`` never adds
    one, so releases <= 0.1.5, which prepend without deduplicating, do not double it).
    And the completion stops *before* the EOS: a model whose every logit is 0 picks id 0
    greedily; with id 0 as the EOS the completion is empty (the GRPO loss therefore never
    sees the stop token: documented in docs/rl.md)."""
    tok = byte_tokenizer()
    bos = tok.token_to_id("<|endoftext|>")
    wrapped = tunix_sampler.TunixTokenizer(tok, bos="<|endoftext|>")
    model = build_model(get_config("qwen3-tiny"), seed=1)
    sampler = tunix_sampler.make_sampler(model, wrapped, cache_size=32)
    out = tunix_sampler.run(
        sampler,
        ["hi", "a longer one"],
        max_generation_steps=2,
        max_prompt_length=16,
        temperature=0.0,
    )
    for row in np.asarray(out.padded_prompt_tokens):
        real = [int(t) for t in row if t != wrapped.pad_id()]
        assert real[0] == bos and real.count(bos) == 1, real

    zero = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    nnx.update(model, zero)
    eos0 = tunix_sampler.TunixTokenizer(tok, eos=tok.id_to_token(0))
    sampler = tunix_sampler.make_sampler(model, eos0, cache_size=32)
    out = tunix_sampler.run(
        sampler, ["hi"], max_generation_steps=3, max_prompt_length=8, temperature=0.0
    )
    assert [int(t) for t in out.tokens[0]] == []
