"""``DPOTrainer``: Tunix's DPO/ORPO trainer with our train step, exact gradient
accumulation, the MoE load-balancing term and one record per optimizer step.

Tunix's ``DPOTrainer`` subclasses ``PeftTrainer``; ours puts
:class:`~posttrain.training.trainer.SFTTrainerMixin`'s step in front of it (so every calling
convention the SFT step survives, ``positional3`` / ``bound2`` / ``bound3_update``, is
handled once) and replaces only the objective:

- Tunix prepares each micro-batch (``DPOTrainer._prepare_inputs``: the chosen and
  rejected completions stacked into one ``[2 x pairs, prompt + response]`` batch, the
  reference log-probabilities computed there) and its ``dpo_loss_fn`` computes the DPO
  or ORPO loss; both are the installed release's own.
- The micro-step's objective is ``loss + moe_aux_loss_weight x moe_aux_loss``,
  unscaled: Tunix's losses are means over the micro-batch's pairs and every micro-batch
  has the same number of pairs, so their mean (what the accumulators average) is the
  loss of one large batch under every convention (:mod:`posttrain.training.step`).
- The MoE term: Tunix's loss sees logits only (its forward runs inside its jitted
  ``compute_logps``, which returns log-probabilities alone; a variable written there
  cannot be carried out of it into the gradient's trace: flax's ``TraceContextError``).
  So an MoE policy runs its forward once more on the same ``TrainExample`` (tokens,
  positions, mask), inside the same jitted step, where XLA may share it. Weight: the
  model config's ``moe.aux_loss_weight``, as for SFT; dense models skip it.
- The eval loss is the train loss (google-tunix <= 0.1.2 set only ``loss_fn``, so its
  eval ran PeftTrainer's default loss on DPO inputs).
- ``rewards/*`` are beta-scaled log-ratios on every release (0.0.2-0.1.2 report them
  raw; :func:`posttrain.preference.tunix_dpo.rewards_are_scaled`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.preference import tunix_dpo
from posttrain.training.metrics import StepMetrics
from posttrain.training.trainer import SFTOptions, SFTTrainerMixin

__all__ = ["DPOTrainer", "PreferenceMetrics", "dpo_trainer_class"]


class PreferenceMetrics(StepMetrics):
    """One record per optimizer step (``metrics.jsonl``), the means over its micro-steps:

    =======================  ===========================================================
    ``step``                 optimizer step, from 1
    ``loss``                 the objective: DPO or ORPO loss + weighted MoE term
    ``rewards_chosen``       beta x (policy - reference) log-probability of the chosen
                             completion (ORPO: lambda x its log-probability), mean
    ``rewards_rejected``     the same for the rejected completion
    ``reward_margin``        ``rewards_chosen - rewards_rejected``
    ``preference_accuracy``  share of pairs with ``rewards_chosen > rewards_rejected``
    ``logps_chosen``         the policy's summed completion log-probability, mean
    ``logps_rejected``       the same for the rejected completion
    ``grad_norm``            global norm of the applied (accumulated) gradient
    ``moe_aux_loss``         the load-balancing loss (unweighted; 0 if dense)
    ``tokens``               non-padding tokens through the policy (prompt twice)
    ``step_time_s``          time between this and the previous record's results being ready
    ``tokens_per_s``         ``tokens / step_time_s``
    ``learning_rate``        the schedule at this step
    =======================  ===========================================================
    """

    NAMES = {
        "rewards/chosen": "rewards_chosen",
        "rewards/rejected": "rewards_rejected",
        "rewards/margin": "reward_margin",
        "rewards/accuracy": "preference_accuracy",
        "log_probs/chosen": "logps_chosen",
        "log_probs/rejected": "logps_rejected",
    }
    keys = ("loss", *NAMES, "moe_aux_loss", "grad_norm", "tokens")

    def summarise(self, micro: list[dict]) -> dict:
        def mean(key):
            return float(np.mean([m[key] for m in micro]))

        return {
            "loss": mean("loss"),
            **{name: mean(key) for key, name in self.NAMES.items()},
            "grad_norm": float(micro[-1]["grad_norm"]),
            "moe_aux_loss": mean("moe_aux_loss"),
            "tokens": int(sum(m["tokens"] for m in micro)),
        }

    def line(self, record: dict) -> str:
        return (
            f"loss {record['loss']:.4f}, accuracy {record['preference_accuracy']:.2f}, "
            f"margin {record['reward_margin']:.3f}, grad_norm {record['grad_norm']:.3f}"
        )


class DPOTrainerMixin(SFTTrainerMixin):
    """The preference step; mix in front of Tunix's DPO trainer class.

    Args:
      model: a :class:`~posttrain.training.policy.TunixPolicy` (the trained policy).
      ref_model: the reference (:func:`posttrain.training.policy.reference_of`), or None for
        ORPO (google-tunix >= 0.1.4 accepts it).
      optimizer, training_config: Tunix's (``training_config`` from
        :func:`posttrain.preference.tunix_dpo.training_config`).
      options: :class:`~posttrain.training.trainer.SFTOptions` (keyword-only).

    Raises:
      posttrain.training.tunix_compat.UnknownConventionError: an unknown step convention.
      posttrain.preference.tunix_dpo.UnknownPreferenceShapeError: an unknown DPO shape.
    """

    metrics_class = PreferenceMetrics

    def __init__(self, model, ref_model, optimizer, training_config, *, options: SFTOptions):
        self._reference = ref_model
        self._tunix_loss = tunix_dpo.loss_fn()
        self._scale_rewards = not tunix_dpo.rewards_are_scaled()
        self._beta = training_config.beta
        super().__init__(model, optimizer, training_config, options=options)

    def _init_tunix(self, model, optimizer, training_config, *args, **kwargs):
        super(SFTTrainerMixin, self).__init__(
            model, self._reference, optimizer, training_config, *args, **kwargs
        )

    def _eval_loss_fn(self):
        def loss_fn(model, **inputs):
            return self._preference_loss(model, inputs)

        return loss_fn

    def _preference_loss(self, model, inputs):
        """``(Tunix's loss + weight x moe_aux_loss, metrics)`` on prepared ``inputs``."""
        loss, metrics = tunix_dpo.loss_and_metrics(self._tunix_loss(model, **inputs))
        if self._scale_rewards:  # 0.0.2-0.1.2 report raw log-ratios (and have no ORPO)
            for key in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
                metrics[key] = metrics[key] * self._beta
        moe = _moe_aux_loss(model, inputs["train_example"])
        total = loss + self.moe_aux_loss_weight * moe if self.moe_aux_loss_weight else loss
        return total, {**metrics, "loss": total, "moe_aux_loss": moe}

    def _objective(self, model, inputs):
        return self._preference_loss(model, inputs)

    def _report(self, terms, inputs, grad_norm):
        mask = inputs["train_example"].attention_mask  # [2 x pairs, T, T], causal x real
        tokens = jnp.sum(jnp.diagonal(mask, axis1=1, axis2=2) > 0).astype(jnp.float32)
        return terms["loss"], {**terms, "grad_norm": grad_norm, "tokens": tokens}

    def _prepare_inputs(self, input_data):
        """Places the pair arrays on the data-parallel axes first, so Tunix's reference
        forward runs sharded; then Tunix's preparation and the SFT step's placement.

        Host arrays hold the whole global batch, or, with
        ``SFTOptions.process_local_batches`` across processes, this process's rows of it
        (``posttrain.preference.run.ShardedPairs``), placed with
        ``jax.make_array_from_process_local_data``."""
        if isinstance(input_data, dict):
            input_data = {k: self._place_rows(np.asarray(v)) for k, v in input_data.items()}
        return super()._prepare_inputs(input_data)


def _moe_aux_loss(policy, example) -> jax.Array:
    """The policy's unweighted ``moe_aux_loss`` on Tunix's ``TrainExample`` (its tokens,
    positions and mask), float32 ``[]``; 0 for a dense model (no forward run)."""
    if policy.model.config.moe is None:
        return jnp.zeros((), jnp.float32)
    _, aux = policy.model.forward(example.input_ids, example.positions, example.attention_mask)
    return jnp.asarray(aux["moe_aux_loss"], jnp.float32)


def dpo_trainer_class(base: type | None = None) -> type:
    """``DPOTrainerMixin`` over ``base`` (default: the installed Tunix DPO trainer)."""
    base = base or tunix_dpo.trainer_class()
    return type(f"DPOTrainer[{base.__name__}]", (DPOTrainerMixin, base), {})


DPOTrainer = dpo_trainer_class()
