"""``SFTTrainer``: Tunix's ``PeftTrainer`` with the step of :mod:`posttrain.training.step`
(every calling convention Tunix has used, exact gradient accumulation, the SFT loss) and
the trainer's own plumbing around it: :class:`SFTOptions`, batches placed on the mesh's
data-parallel axes, the optimizer's counters replicated, a checkpoint refused for
non-finite weights, per-step records, and a ``close`` that drops Tunix's listeners.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tunix.sft import peft_trainer
from typing_extensions import override

from posttrain import _compat, sharding
from posttrain.training import loss as sft_loss
from posttrain.training import tunix_compat
from posttrain.training.metrics import CheckedSaves, NonFiniteLossError, StepMetrics, all_finite
from posttrain.training.step import SFTStep

__all__ = [
    "NonFiniteLossError",
    "SFTOptions",
    "SFTTrainer",
    "SFTTrainerMixin",
    "default_moe_aux_loss_weight",
    "sft_trainer_class",
]


@dataclasses.dataclass(frozen=True)
class SFTOptions:
    """What :class:`SFTTrainer` adds to Tunix's ``PeftTrainer`` arguments.

    Attributes:
      mesh: the mesh the model lives on; batches are placed on its data-parallel
        axes (from ``rules``); ``train`` makes it current for tracing.
      rules: logical-axis rules (default :data:`posttrain.sharding.DEFAULT_RULES`).
      moe_aux_loss_weight: weight of the MoE load-balancing loss (default:
        :func:`default_moe_aux_loss_weight`, the model config's
        ``moe.aux_loss_weight``, 0 for dense models).
      learning_rate_fn: ``step -> learning rate`` (an optax schedule), only logged
        (:class:`posttrain.training.metrics.LearningRate`).
      metrics_path: JSONL file, one record per optimizer step
        (:mod:`posttrain.training.metrics` lists the fields).
      log_every: also print one line per this many steps to stdout (for logs
        without a terminal, where Tunix's tqdm progress bar is off).
      convention: a :class:`~posttrain.training.tunix_compat.Convention`; default:
        read from the trainer class's ``train`` / ``jit_train_and_eval_step``.
      single_replica_saves: during ``train``, Orbax saves each replicated array from
        one replica (:func:`posttrain._compat.single_replica_array_saves`) instead of
        its replica-parallel default; same checkpoint, faster in one process on CPU.
        ``run_sft`` turns it on there (``SFTConfig.replica_parallel_saves``).
      process_local_batches: host batches hold only this process's rows of each global
        batch (``posttrain.training.data.sharded_batches``), placed with
        ``jax.make_array_from_process_local_data``; otherwise (default) every process
        holds the whole global batch. The same in one process.
      frozen: an ``nnx`` filter of trained variables that stay as they are (a vision
        tower under ``posttrain sft --vision``): not differentiated, a zero update
        (Tunix's optimizer holds every ``Param`` / ``LoRAParam``). None: none.
    """

    mesh: Mesh
    rules: sharding.Rules = sharding.DEFAULT_RULES
    moe_aux_loss_weight: float | None = None
    learning_rate_fn: Callable[[int], float] | None = None
    metrics_path: str | os.PathLike | None = None
    log_every: int | None = None
    convention: tunix_compat.Convention | None = None
    single_replica_saves: bool = False
    process_local_batches: bool = False
    frozen: Any = None


class SFTTrainerMixin(SFTStep):
    """The SFT step (:class:`~posttrain.training.step.SFTStep`) with the trainer's Tunix
    plumbing (options, placement, checked saves, metrics, closing); mix in front of a Tunix
    ``PeftTrainer`` class.

    Args:
      model, optimizer, training_config, *args, **kwargs: Tunix's ``PeftTrainer``'s.
      options: :class:`SFTOptions` (keyword-only).

    Raises:
      posttrain.training.tunix_compat.UnknownConventionError: at construction, when
        the trainer class calls its step in an unknown way.
    """

    #: the per-step record writer (:mod:`posttrain.training.metrics`)
    metrics_class: type[StepMetrics] = StepMetrics

    def __init__(self, model, optimizer, training_config, *args, options: SFTOptions, **kwargs):
        self.convention = options.convention or tunix_compat.detect(
            tunix_compat.tunix_base(type(self), SFTTrainerMixin)
        )
        listening = _compat.scalar_listeners()
        self._init_tunix(model, optimizer, training_config, *args, **kwargs)
        # Tunix's MetricsLogger registers its backends (TensorBoard) as process-wide
        # jax.monitoring scalar listeners; its close() drops them with
        # jax.monitoring.clear_event_listeners(), which leaves scalar listeners registered
        # (jax <= 0.10.2): every later run in the process, and every Orbax metric, went on
        # being written to this run's log. close() unregisters them.
        self._scalar_listeners = [
            new for new in _compat.scalar_listeners() if not any(new is old for old in listening)
        ]
        self.mesh = options.mesh
        self.rules = options.rules
        self.single_replica_saves = options.single_replica_saves
        self.process_local_batches = options.process_local_batches
        self.grad_accum_steps = training_config.gradient_accumulation_steps or 1
        weight = options.moe_aux_loss_weight
        self.moe_aux_loss_weight = float(
            default_moe_aux_loss_weight(model) if weight is None else weight
        )
        self.metrics = self.metrics_class(
            self.grad_accum_steps, options.learning_rate_fn, options.metrics_path, options.log_every
        )
        self._wrt = nnx.LoRAParam if self._lora_enabled else nnx.Param
        self._frozen = options.frozen
        #: the variables training changes: the trained kind less ``options.frozen``
        self.learned = (
            self._wrt if self._frozen is None else nnx.All(self._wrt, nnx.Not(self._frozen))
        )
        self.loss_fn = self.eval_loss_fn = self._eval_loss_fn()
        self._has_aux = True
        self._batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
        root = training_config.checkpoint_root_directory
        if root and not tunix_compat.checkpoint_saves_optimizer(type(self.checkpoint_manager)):
            self.checkpoint_manager = tunix_compat.OptimizerStateCheckpoints(
                self.checkpoint_manager, root, lambda: self.optimizer
            )
            self.checkpoint_manager.restore(self._train_steps)
        self.checkpoint_manager = CheckedSaves(self.checkpoint_manager, self._check_before_save)

    def _init_tunix(self, model, optimizer, training_config, *args, **kwargs):
        """The Tunix trainer's ``__init__`` (the DPO trainer's takes a reference too)."""
        super().__init__(model, optimizer, training_config, *args, **kwargs)

    def _eval_loss_fn(self):
        """Tunix's ``loss_fn(model, **inputs) -> (loss, aux)`` for the eval step (and the
        ``loss_fn`` attribute); the train step uses :meth:`_objective`."""
        return sft_loss.eval_loss_fn

    def _check_before_save(self, step: int) -> None:
        """Before checkpoint ``step`` is written: its record (and the finiteness check of
        its loss and gradient norm) is written now, not one step later, and the trained
        weights after its update must be finite.

        Raises:
          NonFiniteLossError: either is not (a resumed run would restart from it).
        """
        self.metrics.flush()
        if not bool(all_finite(nnx.state(self.model, self.learned))):
            raise NonFiniteLossError(
                f"step {step}: the updated weights are not finite (a learning rate too "
                "high?); training stopped before checkpointing them"
            )

    @property
    def history(self) -> list[dict]:
        """The step records written so far (:mod:`posttrain.training.metrics`)."""
        return self.metrics.history

    @override
    def jit_train_and_eval_step(self, *args, **kwargs):
        """Tunix's jitted steps, after placing every unplaced state array on the mesh, the
        train step jitted by :meth:`~posttrain.training.step.SFTStep.jit_train_step`
        (donating the model too) and bound as Tunix bound its own.

        Optax creates its counters (Adam's ``count``, ``MultiSteps``' ``mini_step``,
        main's accumulator ``denom``) on one device; the first step returns them
        replicated on the mesh, so the second call would trace and compile the step
        again. google-tunix 0.1.5+ places the optimizer state itself
        (``PeftTrainer._shard_optimizer``), but only from the legacy ``with mesh:``
        context, which :meth:`train` does not enter, and older releases not at all.

        Tunix jits the step inline (``nnx.jit(train_step, donate_argnames=("optimizer",
        ...))``, no hook for what is donated); its jitted step, built on the first call,
        is replaced once (``skip_jit`` returns Tunix's unjitted step as it is).
        """
        for holder in (self.optimizer, getattr(self, "grad_accumulator", None)):
            if holder is not None:
                replicate_unplaced(holder, self.mesh)
        fresh = self._jitted_train_step_fn is None
        train_step, eval_step = super().jit_train_and_eval_step(*args, **kwargs)
        if fresh and train_step is self._jitted_train_step_fn:  # jitted just now
            bound = tuple(getattr(self, name) for name in self.convention.bound)
            train_step = tunix_compat.bind_like(train_step, self.jit_train_step(), bound)
            self._jitted_train_step_fn = train_step
        return train_step, eval_step

    # --- inputs and metrics ---------------------------------------------------------------
    @override
    def _prepare_inputs(self, input_data):
        """Places each ``[batch, ...]`` leaf on the data-parallel axes (before Tunix's sharding).

        Host arrays are placed from the whole global batch, which every process holds
        (each process writes its own devices' shards), or, with
        ``SFTOptions.process_local_batches`` across processes, from this process's rows
        of it; device arrays (a Tunix trainer's prepared inputs, global across
        processes) are resharded on device, never read back to the host."""
        return jax.tree.map(self._place_rows, super()._prepare_inputs(input_data))

    def _place_rows(self, x):
        """One input leaf on the batch sharding (:meth:`_prepare_inputs`): a host
        ``[batch, ...]`` array from this process's rows with
        ``SFTOptions.process_local_batches`` across processes, else from the whole global
        batch; a device array resharded on device; anything else unchanged."""
        if not isinstance(x, np.ndarray | jax.Array) or np.ndim(x) < 1:
            return x
        if isinstance(x, np.ndarray) and self.process_local_batches and jax.process_count() > 1:
            return jax.make_array_from_process_local_data(self._batch_sharding, x)
        return jax.device_put(x, self._batch_sharding)

    @override
    def _post_process_train_step(self, aux) -> None:
        """Tunix's bookkeeping, then this micro-step's terms to :attr:`metrics`."""
        super()._post_process_train_step(aux)
        if isinstance(aux, dict):
            self.metrics.add(aux, step=self._train_steps + 1)

    @override
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
        self.metrics.discard()
        try:
            self.checkpoint_manager.close()
            self.metrics_logger.close()
        finally:
            for listener in self._scalar_listeners:
                _compat.unregister_scalar_listener(listener)
            self._scalar_listeners = []

    @override
    def close(self):
        self.metrics.flush()
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


def replicate_unplaced(holder, mesh: Mesh) -> None:
    """Replicates on ``mesh`` each array of ``holder``'s state not already on a named
    sharding (in place); arrays placed on the mesh stay where they are."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(x):
        if isinstance(x, jax.Array) and not isinstance(x.sharding, NamedSharding):
            return jax.device_put(x, replicated)
        return x

    nnx.update(holder, jax.tree.map(place, nnx.state(holder)))


def sft_trainer_class(base: type) -> type:
    """``SFTTrainerMixin`` over ``base`` (a ``PeftTrainer`` class, e.g. an emulated one)."""
    return type(f"SFTTrainer[{base.__name__}]", (SFTTrainerMixin, base), {})


class SFTTrainer(SFTTrainerMixin, peft_trainer.PeftTrainer):
    __doc__ = SFTTrainerMixin.__doc__
