"""The programs a plan compiles: the trainer's own step, and generation's prefill + decode.

SFT: the step is :class:`posttrain.training.trainer.SFTTrainer`'s, built by the trainer itself
(``create_train_step_fn`` under the installed Tunix's calling convention) and jitted by the
trainer's own ``jit_train_step`` (``nnx.jit`` donating the model and the optimizer: the
program ``SFTTrainer.jit_train_and_eval_step`` runs), then lowered on the abstract model
and optimizer state instead of called. What had to change to build the trainer on an
abstract model (google-tunix 0.1.7, flax 0.12.8):

- ``nnx.Optimizer`` (inside ``PeftTrainer.__init__``) calls the transformation's
  ``init`` on the model's state; an abstract transformation (:func:`abstract_init`) runs
  it under ``jax.eval_shape``, so Adam's moments are ``ShapeDtypeStruct`` too, with the
  parameters' ``logical_axes`` (flax's ``to_opt_state`` copies them).
- Tunix wraps the transformation in ``optax.MultiSteps`` for gradient accumulation, whose
  ``init`` allocates the accumulator eagerly; the plan wraps it itself, inside the
  abstract transformation, passes ``gradient_accumulation_steps=None`` and sets the
  trainer's ``grad_accum_steps`` (what the step reads), so the state and the step are
  the ones Tunix would build.

Generate: :func:`posttrain.generate._generate`, the jitted prefill + decode loop
``posttrain generate`` runs, lowered with abstract prompts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from posttrain import generate, sharding
from posttrain.config import choices
from posttrain.layers import kv_cache, splash_costs
from posttrain.plan import abstract
from posttrain.plan.options import Optimizer
from posttrain.training import chunked_loss

#: the optimizers a plan builds (``posttrain sft``'s is AdamW)
OPTIMIZERS: tuple[str, ...] = choices(Optimizer)


@dataclasses.dataclass(frozen=True)
class Program:
    """A jitted program with the abstract arguments to lower it on.

    Attributes:
      jitted: an ``nnx.jit`` / ``jax.jit`` function with ``.lower``.
      args, kwargs: its abstract arguments.
      kinds: ``kind -> bytes one device holds`` of the arguments by kind (parameters,
        optimizer state, inputs, KV cache ...), computed from the shardings.
      model_flops: the step's model FLOPs over the whole slice (``2 N`` per token
        forward, ``4 N`` more backward for full fine-tuning, ``2 N`` for LoRA, whose
        weights get no gradient): the numerator of MFU.
      attention_flops: attention's own matmul FLOPs over the whole slice
        (:func:`posttrain.plan.abstract.attention_flops`), which ``model_flops`` leaves
        out; the step estimate counts both.
      resident: bytes one device holds for the workflow outside these arguments
        (:attr:`posttrain.plan.report.Figures.resident`).
      uncounted: ``(FLOPs, bytes accessed)`` per device the compiled costs leave out: what
        a while loop's cost counts once (the decode steps after the first; the SFT loss's
        chunks after the first, :func:`posttrain.training.chunked_loss.uncounted_costs`),
        and custom calls as none (splash attention's kernels,
        :func:`posttrain.layers.splash_costs.uncounted_costs`).
      cost_source: the figures' ``cost_source`` when ``uncounted`` is not zero.
    """

    jitted: object
    args: tuple
    kwargs: dict
    kinds: dict
    model_flops: float
    attention_flops: float = 0.0
    resident: int = 0
    uncounted: tuple[float, float] = (0.0, 0.0)
    cost_source: str = "compiled prefill + first decode step, later steps analytic"


def make_optimizer(name: str, learning_rate: float = 1e-5) -> optax.GradientTransformation:
    """The optax transformation ``name`` (one of :data:`OPTIMIZERS`).

    Raises:
      ValueError: an unknown name.
    """
    if name == "adamw":
        return optax.adamw(learning_rate)
    if name == "sgd":
        return optax.sgd(learning_rate)
    if name == "adafactor":
        return optax.adafactor(learning_rate)
    raise ValueError(f"optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}")


def abstract_init(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` whose ``init`` returns ``ShapeDtypeStruct`` leaves (``jax.eval_shape``)."""
    return optax.GradientTransformation(lambda params: jax.eval_shape(tx.init, params), tx.update)


def sft_inputs(mesh: Mesh, batch: int, seq: int, rules=sharding.DEFAULT_RULES) -> dict:
    """The SFT micro-batch ``posttrain.training.data.batches`` yields, abstract and placed on the
    trainer's batch sharding: ``[batch, seq]`` int32 tokens, mask, positions, segment ids
    and ``[batch]`` step target counts.

    Raises:
      ValueError: ``batch`` does not divide by the data-parallel size, or ``seq`` by the
        sequence-parallel size (naming both).
    """
    dp = sharding.data_parallel_size(mesh, rules)
    sp = sharding.sequence_parallel_size(mesh, rules)
    if batch % dp or seq % sp:
        raise ValueError(
            f"batch={batch} must divide by the data-parallel size {dp} and seq={seq} by the "
            f"sequence-parallel size {sp}"
        )
    rows = sharding.batch_sharding(mesh, rules)
    fields = ("input_tokens", "input_mask", "positions", "segment_ids")
    inputs = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=rows) for k in fields}
    inputs["step_target_tokens"] = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
    return inputs


def sft_program(
    model,
    mesh: Mesh,
    *,
    optimizer: str,
    batch: int,
    seq: int,
    grad_accum: int,
    rules=sharding.DEFAULT_RULES,
) -> Program:
    """SFTTrainer's train step on the abstract ``model`` (LoRA or not), ready to lower.

    Args:
      model: an abstract ``CausalLM`` (:func:`posttrain.plan.abstract.abstract_model`,
        LoRA through :func:`posttrain.lora.abstract.abstract_lora`), not yet placed.
      mesh: the slice's mesh.
      optimizer: one of :data:`OPTIMIZERS`.
      batch, seq: one micro-batch ``[batch, seq]`` (global).
      grad_accum: micro-batches per optimizer step.

    Raises:
      NotImplementedError: the installed Tunix calls its step with a gradient
        accumulator (main's ``bound3_update``), whose state this plan does not build yet.
    """
    from tunix.sft import peft_trainer

    from posttrain.training.trainer import SFTOptions, SFTTrainer

    tx = make_optimizer(optimizer)
    if grad_accum > 1:
        tx = optax.MultiSteps(tx, grad_accum)
    config = peft_trainer.TrainingConfig(eval_every_n_steps=10**9, max_steps=10**9)
    trainer = SFTTrainer(
        model, abstract_init(tx), config, options=SFTOptions(mesh=mesh, rules=rules)
    )
    try:
        if trainer.convention.name == "bound3_update":
            raise NotImplementedError(
                "this Tunix binds a gradient accumulator to the step (bound3_update); "
                "plan builds the released conventions' state only"
            )
        trainer.grad_accum_steps = grad_accum
        abstract.place(trainer.model, mesh, rules)
        abstract.place(trainer.optimizer, mesh, rules)
        inputs = sft_inputs(mesh, batch, seq, rules)
        jitted = trainer.jit_train_step()
        trained = nnx.LoRAParam if trainer._lora_enabled else nnx.Param
        kinds = {
            "parameters": abstract.device_bytes(nnx.state(trainer.model)),
            "optimizer state": abstract.device_bytes(nnx.state(trainer.optimizer)),
            "gradients": abstract.device_bytes(nnx.state(trainer.model, trained)),
            "inputs": abstract.device_bytes(inputs),
        }
        n = abstract.active_matmul_params(trainer.model)
        per_token = 2 * n * (2 if trainer._lora_enabled else 3)
        flops = per_token * batch * seq
        cfg, mesh_shape = trainer.model.config, dict(mesh.shape)
        loss = chunked_loss.uncounted_costs(
            cfg, batch, seq, mesh_shape, rules, head_trained=not trainer._lora_enabled
        )
        kernel = splash_costs.uncounted_costs(cfg, batch, seq, mesh_shape, rules, backward=True)
        uncounted = (loss[0] + kernel[0], loss[1] + kernel[1])
        args = (trainer.model, trainer.optimizer, inputs)
        source = "compiled, the loss's chunks after the first analytic"
        if kernel[0]:
            source += f", {splash_costs.COST_SOURCE}"
        return Program(
            jitted,
            args,
            {},
            kinds,
            flops,
            abstract.attention_flops(cfg, batch, seq, backward=True),
            uncounted=uncounted,
            cost_source=source,
        )
    finally:
        trainer.abandon()


def generate_program(
    model, mesh: Mesh, *, batch: int, prompt: int, new_tokens: int, rules=sharding.DEFAULT_RULES
) -> Program:
    """``posttrain generate``'s jitted prefill + decode loop on the abstract ``model``:
    ``[batch, prompt]`` prompts, ``new_tokens`` sampled greedily, cache of
    ``prompt + new_tokens`` slots.

    Raises:
      ValueError: ``batch`` does not divide by the data-parallel size.
    """
    dp = sharding.data_parallel_size(mesh, rules)
    if batch % dp:
        raise ValueError(f"batch={batch} must divide by the data-parallel size {dp}")
    abstract.place(model, mesh, rules)
    spec = sharding.logical_to_spec(
        ("activation_batch", None), (batch, prompt), dict(mesh.shape), rules
    )
    rows = NamedSharding(mesh, spec)
    tokens = jax.ShapeDtypeStruct((batch, prompt), jnp.int32, sharding=rows)
    real = jax.ShapeDtypeStruct((batch, prompt), jnp.bool_, sharding=rows)
    seed = jax.ShapeDtypeStruct(
        (), jnp.uint32, sharding=NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    cfg = generate.SamplingConfig(max_new_tokens=new_tokens, temperature=0.0)
    cache_size = prompt + new_tokens
    cache = kv_cache.cache_bytes(model.config, batch, cache_size, model.config.dtype)
    index = 4 * batch * model.config.num_layers  # each layer's int32 end_index [B]
    kinds = {
        "parameters": abstract.device_bytes(nnx.state(model)),
        # keys and values [B, S, K, H] over the batch's and the kv heads' axes (KV_AXES);
        # the write indices are not constrained: counted whole, as if replicated
        "KV cache": (cache - index) // (dp * _kv_head_shards(model.config, mesh, rules)) + index,
    }
    n = abstract.active_matmul_params(model)
    # each later decode step: 2 N per row over the slice; reads the weights and the cache
    steps = new_tokens - 1
    uncounted = (steps * 2 * n * batch / mesh.size, steps * float(sum(kinds.values())))
    return Program(
        generate._generate,
        (model, tokens, real, seed),
        {"cfg": cfg, "cache_size": cache_size},
        kinds,
        2 * n * batch * cache_size,
        abstract.attention_flops(model.config, batch, cache_size, backward=False),
        uncounted=uncounted,
    )


def _kv_head_shards(cfg, mesh: Mesh, rules) -> int:
    """How many ways the cache's kv-heads dimension is split (the ``activation_kv_heads``
    axes that divide every layer's kv heads)."""
    axes = sharding.rules_dict(rules).get("activation_kv_heads", ())
    n = sharding.axis_product(dict(mesh.shape), axes)
    heads = [a.num_kv_heads for a in cfg.attention.values()]
    return n if all(h % n == 0 for h in heads) else 1
