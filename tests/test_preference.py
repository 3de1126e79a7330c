"""posttrain.preference: preference data, the MoE term of the objective, the run and
``posttrain dpo``. Tunix's own surfaces are pinned in ``contracts/test_tunix_dpo.py``."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, processors

from posttrain.preference import data
from posttrain.preference.default_data import HELD_OUT_EVERY, pydoc_pairs
from posttrain.preference.run import DPORunConfig
from posttrain.tokenizer import byte_tokenizer

#: The default global batch: --per-device-batch-size's 1 x the data-parallel shards of the
#: default mesh (every device on fsdp): 8 at 8 devices, 1 on one chip.
DEFAULT_BATCH = DPORunConfig().per_device_batch_size * jax.device_count()


def _write(tmp_path, lines) -> str:
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


GOOD = {"prompt": "Say hi.", "chosen": "Hi!", "rejected": "No."}


# --- data -----------------------------------------------------------------------------


def test_both_trl_forms_read_as_the_same_pair(tmp_path):
    conversational = {
        "prompt": [{"role": "user", "content": "Say hi."}],
        "chosen": [{"role": "assistant", "content": "Hi!"}],
        "rejected": [{"role": "assistant", "content": "No."}],
    }
    a, b = data.read_preference_jsonl(_write(tmp_path, [GOOD, "", conversational]))
    assert (a.prompt, a.chosen, a.rejected) == (b.prompt, b.chosen, b.rejected)
    assert a.where.endswith("line 1") and b.where.endswith("line 3")


@pytest.mark.parametrize(
    "line, words",
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected an object with 'prompt', 'chosen' and 'rejected'"),
        ({"prompt": "p", "chosen": "c"}, "got ['chosen', 'prompt']"),
        ({**GOOD, "chosen": 3}, "chosen: expected a string or a non-empty list"),
        ({**GOOD, "prompt": []}, "prompt: expected a string or a non-empty list"),
        ({**GOOD, "rejected": [{"role": "assistant"}]}, "rejected: message 0 needs string"),
        ({**GOOD, "prompt": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
        ({**GOOD, "chosen": [{"role": "user", "content": "x"}]}, "expected assistant turns only"),
        ({**GOOD, "chosen": ""}, "chosen is empty; expected some text"),
        ({**GOOD, "rejected": " \n"}, "rejected is empty; expected some text"),
        ({**GOOD, "prompt": ""}, "prompt is empty; expected some text"),
        ({**GOOD, "rejected": "Hi!"}, "chosen and rejected are the same"),
        (
            {**GOOD, "rejected": [{"role": "assistant", "content": "Hi!"}]},
            "chosen and rejected are the same",
        ),
    ],
)
def test_bad_data_is_one_line_naming_the_file_and_line(tmp_path, line, words):
    path = _write(tmp_path, [GOOD, line])
    with pytest.raises(ValueError) as error:
        data.read_preference_jsonl(path)
    message = str(error.value)
    assert "\n" not in message and f"{path}, line 2" in message and words in message, message


def test_an_empty_or_missing_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no preference pairs"):
        data.read_preference_jsonl(_write(tmp_path, [""]))
    with pytest.raises(ValueError, match="does not exist"):
        data.read_preference_jsonl(str(tmp_path / "nope.jsonl"))


def test_prompts_are_left_padded_and_completions_right_padded_with_exact_masks():
    tok = byte_tokenizer()
    pair = data.validate_pair(GOOD, where="x")
    arrays = data.encode_pairs([pair], tok, max_prompt_length=40, max_response_length=8, pad_id=7)
    prompt = data.encode_prompt(pair.prompt, tok, [])
    chosen = data.encode_completion(pair.chosen, tok)
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert tok.decode(chosen, skip_special_tokens=False) == "Hi!<|im_end|>"
    np.testing.assert_array_equal(arrays["prompt_ids"][0, 40 - len(prompt) :], prompt)
    np.testing.assert_array_equal(arrays["prompt_ids"][0, : 40 - len(prompt)], 7)
    np.testing.assert_array_equal(
        arrays["prompt_mask"][0], [0] * (40 - len(prompt)) + [1] * len(prompt)
    )
    np.testing.assert_array_equal(arrays["chosen_ids"][0, : len(chosen)], chosen)
    np.testing.assert_array_equal(
        arrays["chosen_mask"][0], [1] * len(chosen) + [0] * (8 - len(chosen))
    )


def test_long_pairs_keep_the_prompt_end_and_the_completion_start_or_are_rejected():
    tok = byte_tokenizer()
    pair = data.validate_pair(
        {"prompt": "x" * 50, "chosen": "abcdefghij", "rejected": "z"}, where="f.jsonl, line 9"
    )
    arrays = data.encode_pairs([pair], tok, max_prompt_length=12, max_response_length=4)
    assert tok.decode(arrays["prompt_ids"][0].tolist(), skip_special_tokens=False).endswith(
        "<|im_start|>assistant\n"
    )
    assert tok.decode(arrays["chosen_ids"][0].tolist()) == "abcd"
    assert arrays["prompt_mask"].all() and arrays["chosen_mask"].all()
    with pytest.raises(
        ValueError, match=r"f.jsonl, line 9: prompt has \d+ tokens, more than max_prompt_length=12"
    ):
        data.encode_pairs(
            [pair], tok, max_prompt_length=12, max_response_length=40, overflow="reject"
        )
    with pytest.raises(ValueError, match="f.jsonl, line 9: chosen has 11 tokens"):
        data.encode_pairs(
            [pair], tok, max_prompt_length=80, max_response_length=4, overflow="reject"
        )


def _bos_tokenizer() -> Tokenizer:
    """The byte tokenizer with a post-processor that puts ``<|reserved_0|>`` (a BOS)
    before every text, as Llama 3's ``tokenizer.json`` does with ``<|begin_of_text|>``."""
    tok = byte_tokenizer()
    bos = tok.token_to_id("<|reserved_0|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|reserved_0|> $A", special_tokens=[("<|reserved_0|>", bos)]
    )
    return tok


def test_the_prompt_carries_exactly_one_bos():
    """The tokenizer's BOS once, first (google-tunix <= 0.1.5 gave DPO prompts two:
    ``shared/research/tunix-rl.md`` 7, bug 2); none for a tokenizer without one."""
    tok = _bos_tokenizer()
    bos = tok.token_to_id("<|reserved_0|>")
    assert tok.encode("Say hi.").ids[0] == bos  # the post-processor adds it to any text
    assert data.bos_prefix(tok) == [bos] and data.bos_prefix(byte_tokenizer()) == []
    pair = data.validate_pair(GOOD, where="x")
    for tokenizer, want in ((tok, 1), (byte_tokenizer(), 0)):
        arrays = data.encode_pairs([pair], tokenizer, max_prompt_length=48, max_response_length=8)
        real = arrays["prompt_ids"][0][arrays["prompt_mask"][0] > 0]
        assert int(np.sum(real == bos)) == want and (real[0] == bos) == bool(want)
        # truncation keeps the BOS in front of the prompt's end
        short = data.encode_pairs([pair], tokenizer, max_prompt_length=12, max_response_length=8)
        assert (short["prompt_ids"][0][0] == bos) == bool(want)
        for name in ("chosen_ids", "rejected_ids"):
            assert bos not in arrays[name][0]


def test_batched_encoding_equals_encoding_each_pair(monkeypatch):
    """``encode_pairs`` encodes every piece of a chunk of pairs in one call: the same ids
    as encoding each pair on its own, across chunk boundaries."""
    monkeypatch.setattr(data, "_ENCODE_CHUNK", 7)
    tok = byte_tokenizer()
    train, _ = pydoc_pairs()
    pairs = [*train[:20], data.validate_pair(GOOD, where="x")]
    arrays = data.encode_pairs(pairs, tok, max_prompt_length=128, max_response_length=200)
    for row, pair in enumerate(pairs):
        prompt = data.encode_prompt(pair.prompt, tok, [])
        np.testing.assert_array_equal(arrays["prompt_ids"][row, 128 - len(prompt) :], prompt)
        for name in ("chosen", "rejected"):
            ids = data.encode_completion(getattr(pair, name), tok)
            np.testing.assert_array_equal(arrays[f"{name}_ids"][row, : len(ids)], ids)
            assert arrays[f"{name}_mask"][row].sum() == len(ids)


@pytest.mark.host
def test_pairs_split_into_interleaved_shards_and_one_shard_is_the_unsharded_order():
    """Pair i goes to shard i mod N; each process tokenises only its shards; a global
    micro-batch takes B/N pairs of each shard, in shard order (each shard shuffled on its
    own); with one shard the stream and the held-out pass are the unsharded ones."""
    from posttrain.preference.run import pair_arrays
    from posttrain.training import data as sft_data

    cfg = DPORunConfig(max_prompt_length=48, max_response_length=48)
    tok = byte_tokenizer()
    whole, held_whole = pair_arrays(cfg, tok, "bytes")
    (arrays,) = whole.arrays.values()
    n = whole.total
    assert whole.here == n == len(arrays["prompt_ids"]) > 16
    # One shard: exactly data.batches over every pair (the order before shards existed).
    got = whole.batches(8, 2, seed=3)
    want = sft_data.batches(arrays, 8, 2, seed=3)
    for _ in range(5):
        a, b = next(got), next(want)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert held_whole.whole_batches(8) == held_whole.total // 8
    # Two shards, read by two "processes": each holds every other pair.
    halves = [pair_arrays(cfg, tok, "bytes", 2, [s])[0] for s in (0, 1)]
    assert [h.total for h in halves] == [n, n]
    assert [h.here for h in halves] == [(n + 1) // 2, n // 2]
    for s, half in enumerate(halves):
        np.testing.assert_array_equal(half.arrays[s]["chosen_ids"], arrays["chosen_ids"][s::2])
    both = pair_arrays(cfg, tok, "bytes", 2, [0, 1])[0]
    first = next(both.batches(8, 1, seed=0))
    parts = [next(h.batches(8, 1, seed=0)) for h in halves]
    for k in first:  # the global micro-batch is shard 0's 4 pairs, then shard 1's
        np.testing.assert_array_equal(first[k], np.concatenate([p[k] for p in parts]))
    assert both.whole_batches(8) == n // 2 // 4


def test_a_process_parses_only_its_shards_pairs(tmp_path):
    """A bad line in shard 1 is not shard 0's reader's error; shard 1's names it."""
    from posttrain.preference.run import pair_arrays

    path = _write(tmp_path, [GOOD, GOOD, GOOD, {"prompt": "p"}])
    cfg = DPORunConfig(data=path, max_prompt_length=48, max_response_length=48)
    mine, _ = pair_arrays(cfg, byte_tokenizer(), "bytes", 2, [0])
    assert (mine.total, mine.here) == (4, 2)
    with pytest.raises(ValueError, match=f"{path}, line 4: expected an object"):
        pair_arrays(cfg, byte_tokenizer(), "bytes", 2, [1])


def test_too_few_held_out_pairs_fail_before_anything_is_written(tmp_path):
    from posttrain.preference.run import run_dpo

    one = _write(tmp_path, [GOOD])
    out = tmp_path / "run"
    # 2 pairs per shard: a global batch of at least 2 on any mesh (1 on one device would
    # take the one pair)
    with pytest.raises(ValueError, match=f"--eval-data {one} has 1 pairs, fewer than one"):
        run_dpo(DPORunConfig(eval_data=one, per_device_batch_size=2, output=str(out)))
    assert not out.exists()
    with pytest.raises(ValueError, match="--eval-data '/no/such.jsonl' does not exist"):
        run_dpo(DPORunConfig(eval_data="/no/such.jsonl", output=str(out)))


def test_the_embedded_pairs_hold_out_one_in_eight_and_reject_off_topic_reversed_answers():
    train, held_out = pydoc_pairs()
    assert len(held_out) == (len(train) + len(held_out)) // HELD_OUT_EVERY
    questions = {p.prompt[0]["content"] for p in train}
    assert not questions & {p.prompt[0]["content"] for p in held_out}
    for pair in train[:20]:
        assert pair.chosen[0]["content"] != pair.rejected[0]["content"]
        words = pair.rejected[0]["content"].split()
        assert " ".join(reversed(words)) != pair.chosen[0]["content"]


# --- the objective ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("algorithm", "kto", "algorithm='kto'"),
        ("beta", 0.0, "beta=0.0"),
        ("label_smoothing", 0.5, "label_smoothing=0.5"),
        ("lambda_orpo", float("nan"), "lambda_orpo=nan"),
        ("max_prompt_length", 0, "max_prompt_length=0"),
        ("overflow", "drop", "overflow='drop'"),
        ("steps", 0, "steps=0"),
        ("data_shards", 0, "data_shards=0"),
    ],
)
def test_the_run_config_names_the_bad_field(field, value, words, tmp_path):
    cfg = DPORunConfig(output=str(tmp_path / "run"), **{field: value})
    with pytest.raises(ValueError, match=words):
        cfg.check()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--beta", "-1"], "beta=-1.0"),
        (["--algorithm", "ipo"], "algorithm='ipo'"),
        (["--mesh", "fsdp=0"], "mesh"),
        (["--data", "/nonexistent.jsonl"], "does not exist"),
        pytest.param(
            ["--data-shards", "3"],
            f"global batch {DEFAULT_BATCH} does not divide into it",
            id="argv4-the global batch does not divide into it",
        ),
    ],
)
def test_the_cli_exits_2_with_one_line_and_writes_nothing(argv, words, tmp_path, capsys):
    from posttrain import cli

    out = tmp_path / "run"
    assert cli.main(["dpo", "--output", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


def test_bad_data_through_the_cli_names_the_file_and_line(tmp_path, capsys):
    from posttrain import cli

    path = _write(tmp_path, [GOOD, GOOD, {"prompt": "p"}])
    out = tmp_path / "run"
    assert cli.main(["dpo", "--data", path, "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}, line 3" in err[0], err


@pytest.mark.slow  # two MoE compiles; the contracts run a real DPO step in the gate
def test_the_moe_load_balancing_term_enters_the_objective_and_the_router_gradient():
    """objective = Tunix's DPO loss + weight x the policy's moe_aux_loss on the same
    tokens, and the router's gradient changes with the weight."""
    import optax
    from flax import nnx

    from contracts.test_tunix_dpo import PROMPT, RESPONSE, config
    from posttrain import sharding
    from posttrain.models import build_model, get_config
    from posttrain.preference import tunix_dpo
    from posttrain.preference.trainer import DPOTrainer
    from posttrain.training.policy import TunixPolicy, reference_of
    from posttrain.training.trainer import SFTOptions

    mesh = sharding.make_mesh({"fsdp": 4, "expert": 2})
    model = build_model(get_config("qwen3_moe-tiny"), mesh, seed=0)
    train, _ = pydoc_pairs()
    arrays = data.encode_pairs(
        train[:8], byte_tokenizer(), max_prompt_length=PROMPT, max_response_length=RESPONSE
    )
    policy = TunixPolicy(model)

    def objective_and_router_grad(weight):
        trainer = DPOTrainer(
            policy,
            reference_of(policy),
            optax.sgd(0.1),
            config(),
            options=SFTOptions(mesh=mesh, moe_aux_loss_weight=weight),
        )
        with sharding.use_mesh(mesh, jax_context=False):
            example = trainer._prepare_inputs(dict(arrays))
            inputs = trainer.gen_model_input_fn(example)
            objective, terms, grads = trainer._grads(trainer.model, inputs)
            dpo, _ = tunix_dpo.loss_and_metrics(tunix_dpo.loss_fn()(trainer.model, **inputs))
            _, aux = model.forward(example.input_ids, example.positions, example.attention_mask)
        router = [
            np.asarray(v[...])
            for p, v in nnx.to_flat_state(grads)
            if any("router" in str(k) for k in p)
        ]
        assert router, "no router parameters in the gradient"
        return float(objective), float(dpo), float(aux["moe_aux_loss"]), router

    w = 0.5
    objective, dpo, aux, router = objective_and_router_grad(w)
    assert aux > 0
    np.testing.assert_allclose(objective, dpo + w * aux, rtol=1e-5)
    objective0, dpo0, _, router0 = objective_and_router_grad(0.0)
    np.testing.assert_allclose(objective0, dpo0, rtol=1e-6)
    assert any(not np.allclose(a, b) for a, b in zip(router, router0, strict=True))


# --- the run ------------------------------------------------------------------------------


def _tiny(tmp_path, **overrides) -> DPORunConfig:
    fields = dict(
        steps=2,
        max_prompt_length=48,
        max_response_length=48,
        output=str(tmp_path / "run"),
    )
    return DPORunConfig(**{**fields, **overrides})


@pytest.mark.slow  # the gate's real DPO run is the contract's
def test_a_short_lora_run_writes_its_outputs_and_resumes_where_it_stopped(tmp_path):
    from posttrain.preference.run import run_dpo

    out = tmp_path / "run"
    cfg = _tiny(tmp_path, lora_rank=4, save_every=1, stop_after=1)
    first = run_dpo(cfg)
    assert [r["step"] for r in first.history] == [1]
    assert first.before["preference_accuracy"] == 0.0  # the policy is its reference
    second = run_dpo(dataclasses.replace(cfg, stop_after=None))
    assert [r["step"] for r in second.history] == [2]
    assert second.before == first.before  # the run's start, recorded then
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    assert {"rewards_chosen", "reward_margin", "preference_accuracy", "tokens_per_s"} <= lines[
        1
    ].keys()
    assert (out / "model-step2" / "config.json").exists()
    assert (out / "adapter-step2").exists()
    run = json.loads((out / "run.json").read_text())
    assert run["evaluation"]["after"]["pairs"] > 0
    assert run["evaluation"]["before"] == first.before
    with pytest.raises(ValueError, match="beta 0.1 -> 0.2"):
        run_dpo(dataclasses.replace(cfg, beta=0.2))


def test_a_run_from_an_export_continues_with_the_tokenizer_its_run_recorded(tmp_path):
    """``posttrain dpo --model runs/sft/model-step60`` after ``posttrain sft --tokenizer
    T``: the tokenizer is T (the export holds none), not the embedded one."""
    from posttrain.training.loading import run_tokenizer

    tok = byte_tokenizer()
    tok.add_special_tokens(["<|extra|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    run = tmp_path / "runs" / "sft"
    (run / "model-step60").mkdir(parents=True)
    (run / "run.json").write_text(
        json.dumps({"settings": {"tokenizer": str(tmp_path / "tokenizer.json")}})
    )
    model = str(run / "model-step60")
    got = run_tokenizer(DPORunConfig(model=model), model)
    assert got.get_vocab_size() == byte_tokenizer().get_vocab_size() + 1
    (run / "run.json").write_text(json.dumps({"settings": {"tokenizer": None}}))
    assert run_tokenizer(DPORunConfig(model=model), model).get_vocab_size() == 264
