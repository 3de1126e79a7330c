"""posttrain.rl: the policy wrapper and its reference, rewards, the embedded task, the run
and ``posttrain grpo``. Tunix's own surfaces are pinned in ``contracts/test_tunix_rl.py``."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import _compat
from posttrain.models import build_model, get_config
from posttrain.rl import arithmetic, rewards
from posttrain.rl.run import GRPORunConfig
from posttrain.training.policy import ConfigView, TunixPolicy, has_lora, reference_of
from tests.grpo_runs import tiny

TOKENS = jnp.asarray([[5, 9, 2, 7, 1, 3]], jnp.int32)
#: A default step's prompts: --per-device-batch-size's 2 x the data-parallel shards of the
#: default mesh (every device on fsdp): 16 at 8 devices, 2 on one chip.
DEFAULT_PROMPTS = GRPORunConfig().per_device_batch_size * jax.device_count()


def test_the_config_view_answers_tunix_from_the_first_layer_type():
    """Gemma 4's sliding and full layers differ in kv heads and head_dim: the view gives
    the first layer type's (what RLCluster's CacheConfig reads) and forwards the rest."""
    cfg = get_config("gemma4-tiny")
    first, full = (cfg.attention[t] for t in ("sliding", "full"))
    assert (first.num_kv_heads, first.head_dim) != (full.num_kv_heads, full.head_dim)
    view = ConfigView(cfg)
    assert cfg.layer_types[0] == "sliding"
    assert (view.num_kv_heads, view.head_dim) == (first.num_kv_heads, first.head_dim)
    assert (view.num_layers, view.dtype, view.vocab_size) == (
        cfg.num_layers,
        cfg.dtype,
        cfg.vocab_size,
    )
    with pytest.raises(AttributeError):
        view.no_such_field  # noqa: B018


def _lora(model, rank=4):
    from posttrain import sharding
    from posttrain.lora import LoraConfig, apply_lora

    mesh = sharding.make_mesh({"fsdp": 1}, devices=jax.devices()[:1])
    return apply_lora(model, mesh, LoraConfig(rank=rank, alpha=2.0 * rank, seed=1))


def _perturb_adapters(model):
    """Non-zero B factors (fresh adapters start at B = 0, where any reference passes);
    numpy noise, so no per-shape compile."""
    rng = np.random.default_rng(0)
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        value = np.asarray(_compat.variable_value(var))
        noisy = value + 0.3 * rng.standard_normal(value.shape).astype(value.dtype)
        _compat.set_variable_value(var, jax.device_put(noisy, _compat.variable_value(var).sharding))


def test_the_lora_reference_is_the_base_model_and_shares_its_weights():
    """And the policy wrapper returns the model's logits under Tunix's call."""
    # Tunix's call of the wrapper, and CausalLM's own forward (the wrapper adds nothing).
    calls = nnx.jit(lambda p: (p(TOKENS, None, None, None)[0], p.model.forward(TOKENS)[0]))
    base = build_model(get_config("qwen3-tiny"), seed=0)
    base_logits, _ = calls(TunixPolicy(base))
    model = _lora(base)
    _perturb_adapters(model)
    actor_logits, own = calls(TunixPolicy(model))
    np.testing.assert_array_equal(np.asarray(actor_logits), np.asarray(own))
    reference = reference_of(model)
    ref_logits, _ = calls(TunixPolicy(reference))
    assert has_lora(model) and has_lora(reference)
    assert float(jnp.abs(actor_logits - base_logits).max()) > 1e-3  # the adapters matter
    np.testing.assert_allclose(np.asarray(ref_logits), np.asarray(base_logits), atol=1e-5)

    def params(m):
        return {
            p: _compat.variable_value(v)
            for p, v in nnx.to_flat_state(nnx.state(m, nnx.Param))
            if type(v) is nnx.Param
        }

    actor_params, ref_params = params(model), params(reference)
    assert actor_params.keys() == ref_params.keys() and actor_params
    assert all(ref_params[p] is actor_params[p] for p in actor_params)  # no second copy


def test_the_full_fine_tuning_reference_is_a_frozen_copy():
    model = build_model(get_config("qwen3-tiny"), seed=0)
    reference = reference_of(model)
    assert not has_lora(model)
    pairs = zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(reference, nnx.Param)),
        strict=True,
    )
    for a, b in pairs:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()


def test_built_in_rewards_by_hand():
    completions = ["7", " 12 ", "7x", "", "-3", "8"]
    answers = [7, 12, 7, 0, -3, 7]
    assert rewards.exact_answer([""] * 6, completions, answers) == [1, 1, 0, 0, 1, 0]
    assert rewards.answer_format([""] * 6, completions) == [0.25, 0.25, 0, 0, 0.25, 0.25]


def test_rewards_resolve_by_name_or_module_and_name_what_is_wrong():
    assert rewards.resolve("exact_answer") is rewards.exact_answer
    assert rewards.resolve("posttrain.rl.rewards:answer_format") is rewards.answer_format
    for spec, words in [
        ("nope", "expected a built-in"),
        ("no_such_module_x:f", "cannot import"),
        ("posttrain.rl.rewards:nothing", "has no 'nothing'"),
        ("posttrain.rl.rewards:DEFAULT", "is not callable"),
    ]:
        with pytest.raises(ValueError, match=words) as err:
            rewards.resolve(spec)
        assert spec in str(err.value)


def test_a_recorded_reward_keeps_its_name_and_signature_and_checks_its_output():
    seen = []
    wrapped = rewards.recorded(rewards.exact_answer, lambda n, v: seen.append((n, list(v))))
    assert wrapped.__name__ == "exact_answer"
    assert "answer" in __import__("inspect").signature(wrapped).parameters  # 0.1.6+ reads it
    assert wrapped(prompts=["a", "b"], completions=["1", "2"], answer=[1, 3], mode="train")
    assert seen == [("exact_answer", [1.0, 0.0])]
    wrapped(prompts=["a"], completions=["1"], answer=[1], mode="eval")
    assert len(seen) == 1  # eval calls are not train metrics

    def short(prompts, completions, **kw):
        return [1.0]

    with pytest.raises(ValueError, match="short returned 1 values for 2 completions"):
        rewards.recorded(short, lambda n, v: None)(prompts=["a", "b"], completions=["1", "2"])


def test_the_task_covers_every_problem_and_its_prompt_is_the_sft_template():
    from posttrain.tokenizer import byte_tokenizer
    from posttrain.training.data import chat_prompt
    from posttrain.tunix_sampler import TunixTokenizer

    task = arithmetic.problems()
    assert len(set(task)) == 100 and {p.answer for p in task} == set(range(19))
    tok = byte_tokenizer()
    messages = [{"role": "user", "content": "3+4="}]
    assert TunixTokenizer(tok).encode(arithmetic.Problem(3, 4).prompt) == chat_prompt(messages, tok)
    first = list(arithmetic.batches(task, 8, 20, seed=0))
    again = list(arithmetic.batches(task, 8, 20, seed=0))
    pairs = zip(first, again, strict=True)
    assert all((a["prompts"] == b["prompts"]).all() for a, b in pairs)  # seeded
    assert first[0]["prompts"].dtype.kind == "U" and first[0]["answer"].dtype == np.int32
    seen = [str(p) for b in first[:12] for p in b["prompts"]]  # 96 draws within one epoch
    assert len(set(seen)) == 96


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("num_generations", 1, "num_generations=1 \\(--num-generations\\): expected >= 2"),
        ("algorithm", "ppo", "algorithm='ppo' \\(--algorithm\\): expected grpo or dapo"),
        ("temperature", 0.0, "temperature=0.0 \\(--temperature\\)"),
        ("epsilon", 1.5, "epsilon=1.5"),
        ("beta", -1.0, "beta=-1.0"),
        ("reward", ("nope",), "reward 'nope'"),
        ("stop_after", 0, "stop_after=0"),
        ("eval_samples", -1, "eval_samples=-1"),
        ("rollout_dtype", "float16", "rollout_dtype='float16' \\(--rollout-dtype\\): expected"),
        ("rollout_dtype", "bfloat16", "rollout_dtype='bfloat16' .*--rollout-mesh too"),
        ("warmup_data_shards", 0, "warmup_data_shards=0"),
        ("grad_accum", 0, "grad_accum=0 \\(--grad-accum\\): expected >= 1"),
    ],
)
def test_the_run_config_names_the_bad_field(field, value, words, tmp_path):
    cfg = GRPORunConfig(output=str(tmp_path / "run"), **{field: value})
    with pytest.raises(ValueError, match=words):
        cfg.check()
    assert not (tmp_path / "run").exists()


def test_a_bfloat16_rollout_on_the_actors_own_mesh_is_refused_before_any_work(tmp_path):
    """Tunix shares the actor's model with a rollout on the same mesh, so no copy is
    cast: ``--rollout-dtype`` with ``--rollout-mesh fsdp=<every device>`` (the default
    actor mesh) would be silently ignored."""
    from posttrain.rl.run import run_grpo

    cfg = tiny(tmp_path, rollout_mesh={"fsdp": jax.device_count()}, rollout_dtype="bfloat16")
    with pytest.raises(ValueError, match="rollout_dtype='bfloat16' .*the actor's, whose"):
        run_grpo(cfg)
    assert not (tmp_path / "run").exists()


def test_the_policy_prefills_with_the_last_positions_logits_when_asked():
    """Tunix >= 0.1.7's sampler probes the rollout model's ``__call__`` for
    ``decode_only_last_token``: ``TunixPolicy`` has it and gives the last position's
    logits of the full call."""
    import inspect

    assert "decode_only_last_token" in inspect.signature(TunixPolicy.__call__).parameters
    policy = TunixPolicy(build_model(get_config("qwen3-tiny"), seed=2))
    tokens = jnp.arange(2 * 6, dtype=jnp.int32).reshape(2, 6) + 3
    # each call one jitted program, as the sampler runs it (eagerly, every op of the
    # forward was a dispatch of its own: 3.8 s of the gate's CPU time, now under 1 s)
    full, _ = nnx.jit(lambda p, t: p(t))(policy, tokens)
    last, _ = nnx.jit(lambda p, t: p(t, decode_only_last_token=True))(policy, tokens)
    assert last.shape == (2, 1, full.shape[-1])
    np.testing.assert_allclose(np.asarray(last), np.asarray(full[:, -1:]), rtol=1e-6, atol=1e-6)


def test_dapo_with_a_beta_is_refused():
    with pytest.raises(ValueError, match="DAPO has no KL term"):
        GRPORunConfig(algorithm="dapo", beta=0.1).check()


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--num-generations", "1"], "num_generations=1"),
        (["--reward", "mymod_missing:f"], "cannot import"),
        (["--mesh", "fsdp=0"], "mesh"),
        (["--algorithm", "ppo"], "algorithm='ppo'"),
        (["--rollout-dtype", "bfloat16"], "--rollout-mesh too"),
        pytest.param(
            ["--grad-accum", "3"],
            f"grad_accum=3 (--grad-accum): the step's {DEFAULT_PROMPTS} prompts",
            id="argv5-grad_accum=3 (--grad-accum): the step's prompts",
        ),
    ],
)
def test_the_cli_exits_2_with_one_line_and_writes_nothing(argv, words, tmp_path, capsys):
    from posttrain import cli

    out = tmp_path / "run"
    assert cli.main(["grpo", "--output", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()


@pytest.mark.slow  # the gate's real GRPO run is the contract's (one device, 2 steps)
def test_a_short_grpo_run_writes_its_outputs_and_resumes_where_it_stopped(tmp_path):
    """The embedded run in miniature on 8 fake devices (no warm-up): stop after step 1,
    rerun to step 2. The resumed run continues Tunix's global step and the metric step,
    and metrics.jsonl holds each step once."""
    from posttrain.rl.run import run_grpo

    out = tmp_path / "run"
    # the evaluation compiles our sampler: the split-mesh run does it
    cfg = tiny(tmp_path, save_every=1, stop_after=1)
    first = run_grpo(cfg)
    assert first.step == 1 and [r["step"] for r in first.history] == [1]
    second = run_grpo(dataclasses.replace(cfg, stop_after=None))
    assert second.step == 2 and [r["step"] for r in second.history] == [2]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    for record in lines:
        assert {"reward/exact_answer/mean", "reward/total/std", "loss", "kl"} <= record.keys()
        assert record["rollout_tokens"] > 0
    run = json.loads((out / "run.json").read_text())
    assert [s["resumed_from_step"] for s in run["segments"]] == [0, 1]
    assert [s["step"] for s in run["segments"]] == [1, 2]
    assert (out / "model-step2" / "config.json").exists()


@pytest.mark.slow
def test_a_split_rollout_mesh_gets_the_trainers_weights_after_every_sync(tmp_path):
    """The trainer on fsdp=4,tensor=2, the rollout on data=8 (a replicated copy, rollout
    tensor parallelism 1): after each step's sync, and after the run, the rollout's
    parameters equal the trainer's."""
    from posttrain.rl.run import run_grpo

    built = {}

    def keep(learner, policies):
        built["learner"] = learner

    cfg = tiny(tmp_path, mesh={"fsdp": 4, "tensor": 2}, rollout_mesh={"data": 8}, eval_samples=1)
    result = run_grpo(cfg, on_built=keep)
    assert result.step == 2 and result.eval_before is not None and result.eval_after is not None
    cluster = built["learner"].rl_cluster
    assert built["learner"].should_sync_weights  # a copy on the rollout mesh, synced
    trained = nnx.state(cluster.actor_trainer.model, nnx.Param)
    rollout = nnx.state(cluster.rollout.model(), nnx.Param)
    pairs = zip(jax.tree.leaves(trained), jax.tree.leaves(rollout), strict=True)
    for a, b in pairs:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    mesh = next(iter(jax.tree.leaves(rollout))).sharding.mesh
    assert dict(mesh.shape)["data"] == 8


@pytest.mark.slow
def test_a_bfloat16_rollout_copy_gets_the_trainers_weights_cast_at_every_sync(tmp_path):
    """Bug class 5: ``--rollout-dtype bfloat16`` with the rollout on data=8 and the
    trainer in float32 on fsdp=4,tensor=2, full fine-tuning: after the run's syncs the
    rollout's parameters are the trainer's cast to bfloat16, and the two steps ran."""
    from posttrain.rl.run import run_grpo

    built = {}
    cfg = tiny(
        tmp_path,
        mesh={"fsdp": 4, "tensor": 2},
        rollout_mesh={"data": 8},
        rollout_dtype="bfloat16",
    )
    result = run_grpo(cfg, on_built=lambda learner, policies: built.update(learner=learner))
    assert result.step == 2 and all(np.isfinite(r["loss"]) for r in result.history)
    cluster = built["learner"].rl_cluster
    trained = jax.tree.leaves(nnx.state(cluster.actor_trainer.model, nnx.Param))
    rollout = jax.tree.leaves(nnx.state(cluster.rollout.model(), nnx.Param))
    assert {x.dtype for x in trained} == {jnp.dtype("float32")}
    assert {x.dtype for x in rollout} == {jnp.dtype("bfloat16")}
    for a, b in zip(trained, rollout, strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


@pytest.mark.slow
def test_reference_logps_on_a_split_mesh_equal_a_direct_computation(tmp_path):
    """Bug class 6: the trainer on fsdp=4,tensor=2, the rollout on data=8, LoRA (the
    reference is the base, adapters off). The reference logps Tunix puts in each step's
    TrainExample (computed from the rollout mesh's completions) equal Tunix's
    ``compute_per_token_logps`` of the reference on the same tokens copied to the host,
    at every real completion token."""
    from posttrain.rl import tunix_rl
    from posttrain.rl.run import run_grpo

    seen, built = [], {}

    def keep(learner, policies):
        built.update(learner=learner, reference=policies[1])
        original = learner._generate_and_compute_advantage

        def capture(*args, **kwargs):
            seen.append(original(*args, **kwargs))
            return seen[-1]

        learner._generate_and_compute_advantage = capture

    cfg = tiny(
        tmp_path, mesh={"fsdp": 4, "tensor": 2}, rollout_mesh={"data": 8}, lora_rank=4, beta=0.04
    )
    run_grpo(cfg, on_built=keep)
    assert len(seen) == cfg.steps
    rollout = built["learner"].rl_cluster.rollout
    for example in seen:
        assert example.ref_per_token_logps is not None
        want = tunix_rl.per_token_logps(
            built["reference"],
            jnp.asarray(np.asarray(example.prompt_ids)),
            jnp.asarray(np.asarray(example.completion_ids)),
            pad_id=rollout.pad_id(),
            eos_id=rollout.eos_id(),
            temperature=cfg.temperature,
        )
        real = np.asarray(example.completion_mask).astype(bool)
        assert real.any()
        got = np.asarray(example.ref_per_token_logps)
        np.testing.assert_allclose(got[real], np.asarray(want)[real], atol=2e-5)


@pytest.mark.slow
def test_an_moe_policy_trains_end_to_end_with_its_load_balancing_term(tmp_path):
    """qwen3_moe-tiny, full fine-tuning, its experts over ``expert=4``: two GRPO steps
    (rollouts through the MoE's KV cache) run; the actor's loss is the wrapped one
    (``with_moe_aux_loss``, its own contract test checks the sum) and the router and
    the experts trained."""
    from posttrain.conversion import read_native_params
    from posttrain.models import flat_params
    from posttrain.rl.run import run_grpo

    built = {}

    def keep(learner, policies):  # before the first step
        built.update(learner=learner, initial=flat_params(policies[0].model))

    cfg = tiny(tmp_path, model="qwen3_moe-tiny", mesh={"fsdp": 2, "expert": 4}, lora_rank=0)
    result = run_grpo(cfg, on_built=keep)
    assert result.step == 2 and all(np.isfinite(r["loss"]) for r in result.history)
    cluster = built["learner"].rl_cluster
    assert hasattr(cluster.actor_trainer.loss_fn, "__wrapped__")  # weight x moe_aux_loss
    _, trained = read_native_params(tmp_path / "run" / "model-step2")
    initial = built["initial"]
    assert initial.keys() == trained.keys()
    moved = {k for k in initial if not np.array_equal(initial[k], trained[k])}
    assert any("router" in k for k in moved) and any("experts" in k for k in moved), moved


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["dapo", "drgrpo"])
def test_dapo_and_drgrpo_runs_train_through_their_learners(algorithm, tmp_path):
    """Two real steps through DAPOLearner / DrGRPOLearner (the project's Tunix has both)."""
    from posttrain.rl.run import run_grpo

    cfg = tiny(tmp_path, algorithm=algorithm)
    result = run_grpo(cfg)
    assert result.step == 2 and [r["step"] for r in result.history] == [1, 2]
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["settings"]["algorithm"] == algorithm


def test_a_steps_record_takes_its_rollout_figures_from_the_step_before():
    """Tunix logs update s's rollout (its completion length) at global step s - 1, beside
    update s - 1's actor figures: step s's record reads the rollout's from s - 1 and its
    loss and KL from s (each step once showed the next step's completion length)."""
    from types import SimpleNamespace

    from posttrain.rl.metrics import step_record

    records = {
        0: {"actor/completions/mean_length": 3.0},
        1: {"actor/loss": 0.5, "actor/kl": 0.1, "actor/completions/mean_length": 5.0},
        2: {"actor/loss": 0.4, "actor/kl": 0.2},
    }
    tap = SimpleNamespace(records=records, rollout_seconds={}, rollout_tokens={})
    first = step_record(1, records[1], {}, tap)
    second = step_record(2, records[2], {}, tap)
    assert (first["completions/mean_length"], first["loss"], first["kl"]) == (3.0, 0.5, 0.1)
    assert (second["completions/mean_length"], second["loss"]) == (5.0, 0.4)
