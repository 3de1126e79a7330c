"""One GRPO step through Tunix, split into its phases: our policy against Tunix's own
Qwen3 model of the same size, in the same run.

Usage::

    python benchmarks/grpo.py [--steps 6] [--prompts 16] [--generations 8] [--new-tokens 6] \
        [--devices 8]

Both models are qwen3-tiny's shape (2 layers, d_model 72, 8 heads, 4 kv heads,
head_dim 10, d_ff 88, tied embeddings, vocab 264). Both run under Tunix's `RLCluster`
and `GRPOLearner` with the vanilla rollout, the same optimizer, prompts (the embedded
addition task), rewards and batch, on 8 fake CPU devices by default, or with `--devices
real` on whatever JAX finds (our model: every device on `fsdp`; Tunix's: its own
`("fsdp", "tp")` axes, N x 1). The phases are timed by wrapping
the cluster's `generate` (rollout), `get_ref_per_token_logps` (reference) and
`update_actor` (the update, until the actor's weights are written: it returns nothing
to wait on, and on a TPU its steps would otherwise run on into the next phase). The first
step compiles and is excluded; the figures are medians over the other steps.

Printed: per phase, ms per step for each model and ours / Tunix's (target <= 1.0 for
the whole step), and rollout tokens/s.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time


def _timed(cluster, name: str, log: dict) -> None:
    import jax
    from flax import nnx

    inner = getattr(cluster, name)

    @functools.wraps(inner)
    def call(*args, **kwargs):
        started = time.perf_counter()
        out = inner(*args, **kwargs)
        jax.block_until_ready(jax.tree.leaves(getattr(out, "tokens", out)))
        if name == "update_actor":  # returns nothing: wait for the updated weights
            jax.block_until_ready(nnx.state(cluster.actor_trainer.model))
        log.setdefault(name, []).append(time.perf_counter() - started)
        if name == "generate":
            log.setdefault("tokens", []).append(sum(len(t) for t in out.tokens))
        return out

    setattr(cluster, name, call)


def run(policy, reference, mesh, args) -> dict:
    import numpy as np
    import optax

    from posttrain.rl import arithmetic, rewards, tunix_rl
    from posttrain.tokenizer import byte_tokenizer
    from posttrain.tunix_sampler import TunixTokenizer

    tok = TunixTokenizer(byte_tokenizer())
    training = tunix_rl.training_config(
        actor_optimizer=optax.adamw(5e-4),
        eval_every_n_steps=args.steps + 1,
        max_steps=args.steps,
        mini_batch_size=args.prompts,
        micro_batch_size=args.prompts,
    )
    rollout = tunix_rl.rollout_config(
        max_tokens_to_generate=args.new_tokens,
        max_prompt_length=32,
        kv_cache_size=32 + args.new_tokens,
        temperature=1.0,
        seed=0,
        eos_tokens=[tok.eos_id()],
    )
    cluster = tunix_rl.cluster(
        actor=policy,
        reference=reference,
        tokenizer=tok,
        meshes={"actor": mesh, "reference": mesh, "rollout": mesh},
        training=training,
        rollout=rollout,
    )
    config = tunix_rl.algo_config("grpo", num_generations=args.generations)
    fns = [rewards.exact_answer, rewards.answer_format]
    learner = tunix_rl.learner("grpo", cluster, config, fns)
    log: dict = {}
    for name in ("generate", "get_ref_per_token_logps", "update_actor"):
        _timed(cluster, name, log)
    steps: list[float] = []
    data = arithmetic.batches(arithmetic.problems(), args.prompts, args.steps, seed=0)

    def marked():
        for batch in data:
            steps.append(time.perf_counter())
            yield batch
        steps.append(time.perf_counter())

    learner.train(marked())
    log["step"] = list(np.diff(steps))
    return log


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=6)
    parser.add_argument("--devices", default="8", help="N fake CPU devices, or real (a TPU)")
    args = parser.parse_args(argv)
    from _timing import fake_devices

    fake_devices(args.devices)

    import jax
    import numpy as np
    from _tunix_models import tunix_qwen3_config
    from flax import nnx
    from tunix.models.qwen3 import model as tunix_qwen3

    from posttrain import sharding
    from posttrain.models import build_model, get_config
    from posttrain.training.policy import TunixPolicy, reference_of

    cfg = get_config("qwen3-tiny")
    ours_mesh = sharding.make_mesh(None)
    with sharding.use_mesh(ours_mesh):
        model = build_model(cfg, ours_mesh, seed=0)
        ours = run(TunixPolicy(model), TunixPolicy(reference_of(model)), ours_mesh, args)

    theirs_cfg = tunix_qwen3_config(cfg)
    theirs_mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1, 1), ("fsdp", "tp"))
    actor = tunix_qwen3.Qwen3(theirs_cfg, rngs=nnx.Rngs(0))  # RLCluster places it
    reference = tunix_qwen3.Qwen3(theirs_cfg, rngs=nnx.Rngs(0))
    theirs = run(actor, reference, theirs_mesh, args)

    print(
        f"GRPO step, qwen3-tiny shape, {args.prompts} prompts x {args.generations} completions, "
        f"{args.new_tokens} new tokens, {jax.device_count()} {jax.devices()[0].platform} "
        f"devices; medians of steps 2-{args.steps}"
    )
    print(f"{'phase':<28}{'ours ms':>10}{'Tunix ms':>10}{'ours/Tunix':>12}")
    for name, label in [
        ("generate", "rollout"),
        ("get_ref_per_token_logps", "reference logps"),
        ("update_actor", "update"),
        ("step", "whole step"),
    ]:
        a = statistics.median(ours[name][1:]) * 1e3
        b = statistics.median(theirs[name][1:]) * 1e3
        print(f"{label:<28}{a:>10.1f}{b:>10.1f}{a / b:>12.2f}")
    for who, log in (("ours", ours), ("Tunix", theirs)):
        tokens = sum(log["tokens"][1:])
        seconds = sum(log["generate"][1:])
        print(f"rollout tokens/s ({who}): {tokens / seconds:,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
