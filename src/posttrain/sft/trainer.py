"""``SFTTrainer``: Tunix's ``PeftTrainer`` with a train step that works under every
calling convention Tunix has used, exact gradient accumulation and the SFT loss.

The step body is written once (:meth:`SFTTrainerMixin._step_body`) and wrapped
into the signature the installed Tunix expects (:mod:`posttrain.sft.tunix_compat`):

- ``positional3`` (google-tunix 0.0.2-0.1.5): ``step(model, optimizer, inputs) -> (loss, aux)``;
- ``bound2`` (0.1.6-0.1.7): same parameters, ``-> (loss, aux, grad_norm)``;
- ``bound3_update`` (main since 659881fb): ``step(model, optimizer, grad_accumulator,
  inputs, is_update_step) -> (loss, aux, grad_norm)``.

Parameter names are fixed because ``nnx.jit`` donates by name (``optimizer``,
``grad_accumulator``). Gradients: ``nnx.split`` the model into the trained
variables (``nnx.LoRAParam`` when LoRA is on, else ``nnx.Param``) and the rest,
``jax.value_and_grad`` a pure function that merges them; no NNX transform is
nested inside Tunix's ``nnx.jit``.

Gradient accumulation is exact: each micro-step differentiates its share of the
step loss (:func:`posttrain.sft.loss.step_objective`, normalised by the step's
target-token count), so the shares sum to the gradient of one large batch.
With ``optax.MultiSteps`` (releases; it averages) the share is scaled by the
accumulation count; with main's ``GradientAccumulator`` every micro-step is
``add``-ed (also the first: an empty accumulator is never a reason to skip) and
the optimizer runs only under ``is_update_step``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tunix.sft import peft_trainer

from posttrain import _compat, sharding
from posttrain.sft import loss as sft_loss
from posttrain.sft import tunix_compat


class NonFiniteLossError(ValueError):
    """The loss or gradient norm of an optimizer step is NaN or infinite."""


_AUX_KEYS = ("nll_sum", "target_tokens", "moe_aux_loss", "grad_norm", "tokens")


class SFTTrainerMixin:
    """The SFT step and metrics; mix in front of a Tunix ``PeftTrainer`` class.

    Args (keyword-only, the rest go to ``PeftTrainer.__init__``):
      mesh: the mesh the model lives on; batches are placed on its data-parallel
        axes (from ``rules``); ``train`` makes it current for tracing.
      rules: logical-axis rules (default :data:`posttrain.sharding.DEFAULT_RULES`).
      moe_aux_loss_weight: weight of the MoE load-balancing loss (default:
        :func:`default_moe_aux_loss_weight`, the model config's
        ``moe.aux_loss_weight``, 0 for dense models).
      learning_rate_fn: ``step -> learning rate`` (an optax schedule), only logged;
        evaluated jitted (one compile, not one eager dispatch per op per step:
        ~1.7 s of a 20-step CPU run; values in float32), eagerly when it does not
        trace. A jitted schedule reads Python state once, when traced.
      metrics_path: JSONL file, one record per optimizer step: ``step``, ``loss``
        (exact: summed NLL / target tokens of the step), ``perplexity``,
        ``grad_norm``, ``moe_aux_loss``, ``target_tokens``, ``tokens_per_s``,
        ``step_time_s``, ``learning_rate``.
      log_every: also print one line per this many steps to stdout (for logs
        without a terminal, where Tunix's tqdm progress bar is off).
      convention: a :class:`~posttrain.sft.tunix_compat.Convention`; default:
        read from this class's ``train`` / ``jit_train_and_eval_step``.
      single_replica_saves: during ``train``, Orbax saves each replicated array from
        one replica (:func:`posttrain._compat.single_replica_array_saves`) instead of
        its replica-parallel default; same checkpoint, faster in one process on CPU.
        ``run_sft`` turns it on there (``SFTConfig.replica_parallel_saves``).

    Raises:
      posttrain.sft.tunix_compat.UnknownConventionError: at construction, when
        the trainer class calls its step in an unknown way.
    """

    def __init__(
        self,
        model,
        optimizer,
        training_config,
        *args,
        mesh: Mesh,
        rules: sharding.Rules = sharding.DEFAULT_RULES,
        moe_aux_loss_weight: float | None = None,
        learning_rate_fn: Callable[[int], float] | None = None,
        metrics_path: str | os.PathLike | None = None,
        log_every: int | None = None,
        convention: tunix_compat.Convention | None = None,
        single_replica_saves: bool = False,
        **kwargs,
    ):
        self.convention = convention or tunix_compat.detect(tunix_base(type(self)))
        listening = _compat.scalar_listeners()
        super().__init__(model, optimizer, training_config, *args, **kwargs)
        # Tunix's MetricsLogger registers its backends (TensorBoard) as process-wide
        # jax.monitoring scalar listeners; its close() drops them with
        # jax.monitoring.clear_event_listeners(), which leaves scalar listeners registered
        # (jax <= 0.10.2): every later run in the process, and every Orbax metric, went on
        # being written to this run's log. close() unregisters them.
        self._scalar_listeners = [
            new for new in _compat.scalar_listeners() if not any(new is old for old in listening)
        ]
        self.mesh = mesh
        self.rules = rules
        self.single_replica_saves = single_replica_saves
        self.grad_accum_steps = training_config.gradient_accumulation_steps or 1
        if moe_aux_loss_weight is None:
            moe_aux_loss_weight = default_moe_aux_loss_weight(model)
        self.moe_aux_loss_weight = float(moe_aux_loss_weight)
        self.learning_rate_fn = learning_rate_fn
        self._learning_rate_jit: tuple[Callable, Callable | None] | None = None
        self._wrt = nnx.LoRAParam if self._lora_enabled else nnx.Param
        self.loss_fn = self.eval_loss_fn = sft_loss.eval_loss_fn
        self._has_aux = True
        batch_axes = sharding.logical_to_spec(("activation_batch",), None, dict(mesh.shape), rules)[
            0
        ]
        self._batch_sharding = NamedSharding(mesh, PartitionSpec(batch_axes))
        self._metrics_path = os.fspath(metrics_path) if metrics_path else None
        self._log_every = log_every
        self._micro: list[dict] = []
        self._pending: dict | None = None
        self._last_update_time: float | None = None
        self.history: list[dict] = []  # the records written to metrics_path
        root = training_config.checkpoint_root_directory
        if root and not tunix_compat.checkpoint_saves_optimizer(type(self.checkpoint_manager)):
            self.checkpoint_manager = OptimizerStateCheckpoints(self.checkpoint_manager, root, self)
            self.checkpoint_manager.restore(self._train_steps)

    # --- the step -------------------------------------------------------------------------
    def _grads(self, model, inputs):
        """``(objective, terms, grads)``: this micro-step's share of the step loss
        (:func:`posttrain.sft.loss.step_objective`, MoE load-balancing term included),
        the forward terms and d(share)/d(trained variables)."""
        graphdef, trained, rest = nnx.split(model, self._wrt, ...)
        step_tokens = inputs.get("step_target_tokens")

        def share(trained_state):
            terms = sft_loss.sft_terms(nnx.merge(graphdef, trained_state, rest), **inputs)
            objective = sft_loss.step_objective(
                terms,
                step_tokens,
                moe_aux_weight=self.moe_aux_loss_weight,
                grad_accum_steps=self.grad_accum_steps,
            )
            return objective, terms

        (objective, terms), grads = jax.value_and_grad(share, has_aux=True)(trained)
        return objective, terms, grads

    def _step_body(self, model, optimizer, grad_accumulator, inputs, is_update_step):
        """One micro-step; returns ``(reported loss, aux, grad_norm)``."""
        inputs = self.gen_model_input_fn(inputs)
        _, terms, grads = self._grads(model, inputs)
        k = self.grad_accum_steps
        if grad_accumulator is None or k == 1:
            # MultiSteps (releases) averages k micro-gradients: scale each share by k so
            # the applied update is their sum. k == 1 on main: update every call.
            if k > 1:
                grads = jax.tree.map(lambda g: g * k, grads)
            # grad_norm is the norm of the applied (accumulated) gradient under every
            # convention: MultiSteps applies the window's mean at its last micro-step,
            # and only that micro-step's value is logged (see _flush).
            window = _compat.multisteps_window_gradient(optimizer.opt_state, grads)
            grad_norm = _compat.global_norm(grads if window is None else window)
            optimizer.update(model, grads)
        else:
            grad_accumulator.add(jax.tree.map(lambda g: g * k, grads))  # denom += 1

            def apply(model, optimizer, grad_accumulator):
                total = grad_accumulator.get()  # sum(k * share) / k
                norm = _compat.global_norm(total).astype(jnp.float32)
                optimizer.update(model, total)
                grad_accumulator.reset()
                return norm

            def skip(model, optimizer, grad_accumulator):
                return jnp.zeros((), jnp.float32)

            grad_norm = nnx.cond(is_update_step, apply, skip, model, optimizer, grad_accumulator)
        tokens = (
            jnp.sum(inputs["segment_ids"] > 0)
            if "segment_ids" in inputs
            else (jnp.asarray(inputs["input_tokens"].size))
        )
        aux = {**terms, "grad_norm": grad_norm, "tokens": tokens.astype(jnp.float32)}
        loss = terms["nll_sum"] / jnp.maximum(terms["target_tokens"], 1.0)
        return loss, aux, grad_norm

    def create_train_step_fn(self):
        """The step in the installed convention's signature (see the module docstring)."""
        name = self.convention.name
        body = self._step_body
        if name == "positional3":

            def train_step(model, optimizer, inputs):
                loss, aux, _ = body(model, optimizer, None, inputs, None)
                return loss, aux
        elif name == "bound2":

            def train_step(model, optimizer, inputs):
                return body(model, optimizer, None, inputs, None)
        elif name == "bound3_update":

            def train_step(model, optimizer, grad_accumulator, inputs, is_update_step=True):
                return body(model, optimizer, grad_accumulator, inputs, is_update_step)
        else:
            raise tunix_compat.UnknownConventionError(
                f"no step for convention {self.convention.describe()}"
            )
        return train_step

    def jit_train_and_eval_step(self, *args, **kwargs):
        """Tunix's jitted steps, after placing every unplaced state array on the mesh.

        Optax creates its counters (Adam's ``count``, ``MultiSteps``' ``mini_step``,
        main's accumulator ``denom``) on one device; the first step returns them
        replicated on the mesh, so the second call would trace and compile the step
        again. google-tunix 0.1.5+ places the optimizer state itself
        (``PeftTrainer._shard_optimizer``), but only from the legacy ``with mesh:``
        context, which :meth:`train` does not enter, and older releases not at all.
        """
        for holder in (self.optimizer, getattr(self, "grad_accumulator", None)):
            if holder is not None:
                _replicate_unplaced(holder, self.mesh)
        return super().jit_train_and_eval_step(*args, **kwargs)

    # --- inputs and metrics ---------------------------------------------------------------
    def _prepare_inputs(self, input_data):
        """Places each ``[batch, ...]`` leaf on the data-parallel axes (before Tunix's sharding)."""
        input_data = super()._prepare_inputs(input_data)
        return jax.tree.map(
            lambda x: (
                jax.device_put(np.asarray(x), self._batch_sharding)
                if isinstance(x, np.ndarray | jax.Array) and np.ndim(x) >= 1
                else x
            ),
            input_data,
        )

    def _post_process_train_step(self, aux) -> None:
        super()._post_process_train_step(aux)
        if not isinstance(aux, dict):
            return
        self._micro.append({k: aux[k] for k in _AUX_KEYS if k in aux})
        if len(self._micro) < self.grad_accum_steps:
            return
        now = time.perf_counter()
        record = {
            "step": self._train_steps + 1,
            "_micro": self._micro,
            "_elapsed": None if self._last_update_time is None else now - self._last_update_time,
        }
        self._last_update_time = now
        self._micro = []
        self._flush()  # the previous step is done by now; keep this one's arrays in flight
        self._pending = record

    def _learning_rate(self, step: int) -> float | None:
        fn = self.learning_rate_fn
        if fn is None:
            return None
        if self._learning_rate_jit is None or self._learning_rate_jit[0] is not fn:
            self._learning_rate_jit = (fn, jax.jit(fn))  # per schedule: it may be replaced
        jitted = self._learning_rate_jit[1]
        if jitted is not None:
            try:
                return float(jitted(step))
            except Exception:  # does not trace (Python control flow, hashing the step, ...)
                self._learning_rate_jit = (fn, None)
        return float(fn(step))

    def _flush(self) -> None:
        """Writes the pending step record (device values -> floats)."""
        record, self._pending = self._pending, None
        if record is None:
            return
        micro = jax.device_get(record.pop("_micro"))
        elapsed = record.pop("_elapsed")
        targets = float(sum(m["target_tokens"] for m in micro))
        tokens = float(sum(m["tokens"] for m in micro))
        loss = float(sum(m["nll_sum"] for m in micro)) / max(targets, 1.0)
        record.update(
            loss=loss,
            perplexity=math.exp(min(loss, 80.0)),
            grad_norm=float(micro[-1]["grad_norm"]),
            moe_aux_loss=float(np.mean([m["moe_aux_loss"] for m in micro])),
            target_tokens=int(targets),
            tokens=int(tokens),
            step_time_s=elapsed,
            tokens_per_s=None if not elapsed else tokens / elapsed,
            learning_rate=self._learning_rate(record["step"] - 1),
        )
        if not (math.isfinite(loss) and math.isfinite(record["grad_norm"])):
            raise NonFiniteLossError(
                f"step {record['step']}: loss {loss}, grad_norm {record['grad_norm']}; "
                "training stopped before writing it (a learning rate too high?)"
            )
        self.history.append(record)
        if self._log_every and record["step"] % self._log_every == 0:
            speed = f", {record['tokens_per_s']:,.0f} tokens/s" if record["tokens_per_s"] else ""
            print(
                f"step {record['step']}: loss {loss:.4f}, grad_norm {record['grad_norm']:.3f}"
                f"{speed}",
                flush=True,
            )
        if self._metrics_path:
            with open(self._metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, allow_nan=False) + "\n")

    def train(self, *args, **kwargs):
        """Tunix's ``train`` with this trainer's mesh and rules current for tracing.

        Only :mod:`posttrain.sharding`'s context is set, not JAX's mesh context:
        Tunix saves checkpoints inside ``train`` and Orbax's eager per-shard copies
        fail under ``jax.set_mesh`` on jax 0.7-0.8. Callers need no mesh context.
        With ``single_replica_saves``, Orbax saves each replicated array from one replica
        (:func:`posttrain._compat.single_replica_array_saves`) while it runs.
        """
        saves = (
            _compat.single_replica_array_saves()
            if self.single_replica_saves
            else contextlib.nullcontext()
        )
        with sharding.use_mesh(self.mesh, self.rules, jax_context=False), saves:
            return super().train(*args, **kwargs)

    def abandon(self) -> None:
        """Releases the checkpoint manager, the metrics logger and the scalar listeners
        without Tunix's ``close()`` (which would save the current, e.g. non-finite, state)."""
        self._pending = None
        try:
            self.checkpoint_manager.close()
            self.metrics_logger.close()
        finally:
            for listener in self._scalar_listeners:
                _compat.unregister_scalar_listener(listener)
            self._scalar_listeners = []

    def close(self):
        self._flush()
        try:
            super().close()
        finally:
            for listener in getattr(self, "_scalar_listeners", ()):
                _compat.unregister_scalar_listener(listener)
            self._scalar_listeners = []


def default_moe_aux_loss_weight(model) -> float:
    """The load-balancing weight ``model`` was configured with: ``model.config.moe.aux_loss_weight``
    (from HF ``router_aux_loss_coef``), 0.0 for a dense model (``moe is None``).

    Read by attribute: a misspelt field must raise, not train without load balancing.
    """
    moe = model.config.moe
    return 0.0 if moe is None else float(moe.aux_loss_weight)


def _replicate_unplaced(holder, mesh: Mesh) -> None:
    """Replicates on ``mesh`` each array of ``holder``'s state not already on a named
    sharding (in place); arrays placed on the mesh stay where they are."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(x):
        if isinstance(x, jax.Array) and not isinstance(x.sharding, NamedSharding):
            return jax.device_put(x, replicated)
        return x

    nnx.update(holder, jax.tree.map(place, nnx.state(holder)))


def tunix_base(cls: type) -> type:
    """The first class in ``cls``'s MRO, past the SFT mixin, that defines ``train``."""
    for klass in cls.__mro__:
        if "train" in vars(klass) and not issubclass(klass, SFTTrainerMixin):
            return klass
    raise TypeError(f"{cls.__name__} has no Tunix PeftTrainer base")


class OptimizerStateCheckpoints:
    """Tunix's checkpoint manager plus the optimizer state, for google-tunix <= 0.1.5.

    Those releases save and restore only the params, so a resumed run would restart
    Adam's moments and the MultiSteps counter and leave the uninterrupted run's
    losses. This wrapper saves ``nnx.state(optimizer, OptState)`` with Orbax in
    ``<checkpoint root>-optimizer/<step>`` whenever Tunix's manager saves a step,
    and restores it for the step Tunix restored. Every other attribute is Tunix's.
    """

    def __init__(self, inner, root: str, trainer) -> None:
        import orbax.checkpoint as ocp

        self._inner = inner
        self._trainer = trainer
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            os.fspath(root).rstrip("/") + "-optimizer",
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
        )

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _state(self):
        return nnx.state(self._trainer.optimizer, nnx.optimizer.OptState)

    def save(self, step, model, *args, **kwargs):
        saved = self._inner.save(step, model, *args, **kwargs)
        if saved is None:  # releases that return nothing: compare steps
            saved = self._inner.latest_step() == step
        if saved and self._manager.latest_step() != step:
            self._manager.save(step, args=self._ocp.args.PyTreeSave(self._state()), force=True)
        return saved

    def restore(self, step: int) -> None:
        """Restores the optimizer state of ``step`` (the step Tunix restored), if saved."""
        if not step:
            return
        if step not in self._manager.all_steps():
            raise RuntimeError(
                f"Tunix restored step {step} but {self._manager.directory} has no optimizer "
                f"state for it (steps {sorted(self._manager.all_steps())}); resuming would "
                "restart the optimizer"
            )
        target = self._state()
        restored = self._manager.restore(
            step,
            args=self._ocp.args.PyTreeRestore(
                item=target,
                restore_args=self._ocp.checkpoint_utils.construct_restore_args(target=target),
            ),
        )
        nnx.update(self._trainer.optimizer, restored)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
        self._inner.close()


def sft_trainer_class(base: type) -> type:
    """``SFTTrainerMixin`` over ``base`` (a ``PeftTrainer`` class, e.g. an emulated one)."""
    return type(f"SFTTrainer[{base.__name__}]", (SFTTrainerMixin, base), {})


class SFTTrainer(SFTTrainerMixin, peft_trainer.PeftTrainer):
    __doc__ = SFTTrainerMixin.__doc__
