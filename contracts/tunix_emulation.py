"""Emulated Tunix ``PeftTrainer`` conventions that no installed release has.

Only calling conventions are emulated; everything else is the installed Tunix, so
every convention is exercised whichever release the environment has.
Each class follows the observable behaviour recorded in
``shared/research/tunix-conventions.md`` (jit + donation, what is bound, how
``train()`` calls the step and unpacks it, who decides the update step):

- :class:`Positional3PeftTrainer`: google-tunix 0.0.2-0.1.5. The jitted step is
  not bound; ``train()`` calls ``train_step(model, optimizer, example)`` and
  unpacks 2 values; ``optax.MultiSteps`` (from the installed ``__init__``) does
  the accumulation.
- :class:`Bound2PeftTrainer`: google-tunix 0.1.6-0.1.7. The jitted step is bound
  to ``(model, optimizer)`` (``cached_partial``); ``train()`` calls
  ``train_step(example)`` and unpacks 3 values; MultiSteps accumulates.
- :class:`MainPeftTrainer`: Tunix main from 659881fb (2026-07-17) to c7d8950f.
  No MultiSteps; a :class:`GradientAccumulator` (``add``/``get``/``reset``) is
  bound with model and optimizer, donated by name, and ``train()`` calls
  ``train_step(example, is_update_step=jnp.array(bool))``, the flag being the
  example's ``is_update_step`` if present, else ``iter_steps % GA == 0``
  (``iter_steps`` incremented before the call).

:func:`posttrain.training.tunix_compat.detect` reads these classes' own ``train`` and
``jit_train_and_eval_step`` like any release, so they double as its test input.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.sft import peft_trainer

from posttrain import _compat
from posttrain.training import tunix_compat


class GradientAccumulator(nnx.Module):
    """Tunix main's accumulator (PT@c7d8950f:201): float32 sums and a denominator.

    ``add(grads, denom=None)`` adds grads into the buffers and ``denom`` (1.0 if
    None) into the denominator; ``get()`` is sum / denom (0 when denom is 0) cast
    to the parameter dtypes; ``reset()`` zeroes both. With
    ``allocate_grads=False`` the buffers are an empty dict.
    """

    def __init__(self, model, wrt, *, allocate_grads: bool = True, accumulator_dtype=jnp.float32):
        leaves, self._treedef = jax.tree.flatten(nnx.state(model, wrt))  # static treedef
        self._dtypes = tuple(x.dtype for x in leaves)
        self.grads = nnx.List(
            [nnx.Variable(jnp.zeros_like(x, dtype=accumulator_dtype)) for x in leaves]
            if allocate_grads
            else []
        )
        self.denom = nnx.Variable(jnp.zeros((), jnp.float32))

    def add(self, grads, denom=None) -> None:
        for buf, g in zip(self.grads, jax.tree.leaves(grads), strict=True):
            buf[...] = buf[...] + g.astype(buf[...].dtype)
        self.denom[...] = self.denom[...] + (1.0 if denom is None else denom)

    def get(self):
        d = self.denom[...]
        safe = jnp.where(d == 0, 1.0, d)
        return jax.tree.unflatten(
            self._treedef,
            [
                jnp.where(d == 0, 0.0, buf[...] / safe).astype(dt)
                for buf, dt in zip(self.grads, self._dtypes, strict=True)
            ],
        )

    def reset(self) -> None:
        for buf in self.grads:
            buf[...] = jnp.zeros_like(buf[...])
        self.denom[...] = jnp.zeros((), jnp.float32)


def _step_loop(trainer, train_ds, call_step) -> None:
    """The part of ``PeftTrainer.train`` the conventions share: skip, stop, shard, book-keep.

    ``call_step(example) -> (loss, aux, is_update_step)``.
    """
    index = 0
    for example in train_ds:
        if index < trainer._iter_steps:  # resume: skip what was trained
            index += 1
            continue
        index += 1
        max_steps = trainer.config.max_steps
        if max_steps is not None and trainer._train_steps >= max_steps:
            break
        example = trainer._prepare_inputs(example)
        loss, aux, update = call_step(example)
        trainer._post_process_train_step(aux)
        if update:
            trainer._train_steps += 1
            # The installed manager's save: the optimizer is its 3rd parameter from 0.1.6 on.
            manager = trainer.checkpoint_manager
            optimizer = (
                (trainer.optimizer,)
                if tunix_compat.checkpoint_saves_optimizer(
                    type(getattr(manager, "_inner", manager))
                )
                else ()
            )
            manager.save(
                trainer._train_steps,
                trainer.model,
                *optimizer,
                save_only_lora_params=trainer._lora_enabled,
            )
    trainer.close()


class Positional3PeftTrainer(peft_trainer.PeftTrainer):
    """google-tunix 0.0.2-0.1.5 (PT@v0.1.5:640-700): unbound step, 3 args, 2 results."""

    def jit_train_and_eval_step(self, skip_jit: bool = False):
        train_step = self.create_train_step_fn()
        eval_step = self.create_eval_step_fn()
        if skip_jit:
            return train_step, eval_step
        if self._jitted_train_step_fn is None:
            self._jitted_train_step_fn = nnx.jit(train_step, donate_argnames=("optimizer",))
            self._jitted_eval_step_fn = nnx.jit(eval_step)
        return self._jitted_train_step_fn, self._jitted_eval_step_fn

    def train(self, train_ds, eval_ds=None, skip_jit: bool = False) -> None:
        train_step, _ = self.jit_train_and_eval_step(skip_jit)
        ga = self.config.get_with_default("gradient_accumulation_steps", 1) or 1

        def call(train_example):
            train_loss, aux = train_step(self.model, self.optimizer, train_example)
            self._iter_steps += 1
            return train_loss, aux, self._iter_steps % ga == 0

        _step_loop(self, train_ds, call)


class Bound2PeftTrainer(peft_trainer.PeftTrainer):
    """google-tunix 0.1.6-0.1.7 (PT@v0.1.7:405-435, 707): (model, optimizer) bound, 3 results."""

    def jit_train_and_eval_step(self, skip_jit: bool = False, cache_nnx_graph: bool = False):
        train_step = self.create_train_step_fn()
        eval_step = self.create_eval_step_fn()
        if skip_jit:
            return train_step, eval_step
        if self._jitted_train_step_fn is None:
            self._jitted_train_step_fn = nnx.jit(train_step, donate_argnames=("optimizer",))
            self._jitted_eval_step_fn = nnx.jit(eval_step)

            def maybe_cache_and_partial(f, *args):
                if cache_nnx_graph:
                    return functools.partial(nnx.cached_partial(f, *args))
                return functools.partial(f, *args)

            self._jitted_train_step_fn = maybe_cache_and_partial(
                self._jitted_train_step_fn, self.model, self.optimizer
            )
            self._jitted_eval_step_fn = maybe_cache_and_partial(
                self._jitted_eval_step_fn, self.model
            )
        return self._jitted_train_step_fn, self._jitted_eval_step_fn

    def train(
        self, train_ds, eval_ds=None, skip_jit: bool = False, *, cache_nnx_graph: bool = True
    ) -> None:
        train_step, _ = self.jit_train_and_eval_step(skip_jit, cache_nnx_graph)
        ga = self.config.get_with_default("gradient_accumulation_steps", 1) or 1

        def call(train_example):
            train_loss, aux, grad_norm = train_step(train_example)
            self._iter_steps += 1
            return train_loss, aux, self._iter_steps % ga == 0

        _step_loop(self, train_ds, call)


class MainPeftTrainer(peft_trainer.PeftTrainer):
    """Tunix main (PT@c7d8950f): GradientAccumulator bound to the step, ``is_update_step`` kwarg."""

    def __init__(self, model, optimizer, training_config, *args, **kwargs):
        # Main builds no MultiSteps: hide GA from the installed __init__, then restore it.
        ga = training_config.gradient_accumulation_steps
        super().__init__(
            model,
            optimizer,
            dataclasses.replace(training_config, gradient_accumulation_steps=None),
            *args,
            **kwargs,
        )
        self.config = training_config
        self._iter_steps = self._train_steps * (ga or 1)
        wrt = nnx.LoRAParam if self._lora_enabled else nnx.Param
        self.grad_accumulator = GradientAccumulator(model, wrt, allocate_grads=(ga or 1) > 1)

    def _train_step(self, model, optimizer, grad_accumulator, inputs, is_update_step):
        """Main's own step (PT@c7d8950f:556-602), for the plain (non-LossOutput) loss."""
        inputs = self.gen_model_input_fn(inputs)
        grad_fn = nnx.value_and_grad(
            self.loss_fn,
            argnums=nnx.DiffState(0, nnx.LoRAParam) if self._lora_enabled else 0,
            has_aux=True,
        )
        out, grads = grad_fn(model, **inputs)
        loss, aux = out if self._has_aux else (out, None)
        if (self.config.gradient_accumulation_steps or 1) == 1:
            grad_norm = _compat.global_norm(grads)
            optimizer.update(model, grads)
            return loss, aux, grad_norm
        grad_accumulator.add(grads, denom=None)

        def apply(model, optimizer, grad_accumulator):
            g = grad_accumulator.get()
            norm = _compat.global_norm(g).astype(jnp.float32)
            optimizer.update(model, g)
            grad_accumulator.reset()
            return norm

        def skip(model, optimizer, grad_accumulator):
            return jnp.zeros((), jnp.float32)

        grad_norm = nnx.cond(is_update_step, apply, skip, model, optimizer, grad_accumulator)
        return loss, aux, grad_norm

    def jit_train_and_eval_step(self, skip_jit: bool = False, cache_nnx_graph: bool = False):
        train_step = self.create_train_step_fn()
        eval_step = self.create_eval_step_fn()
        if skip_jit:
            return train_step, eval_step
        if self._jitted_train_step_fn is None:
            self._jitted_train_step_fn = nnx.jit(
                train_step, donate_argnames=("optimizer", "grad_accumulator")
            )
            self._jitted_eval_step_fn = nnx.jit(eval_step)

            def maybe_cache_and_partial(f, *args):
                if cache_nnx_graph:
                    return functools.partial(nnx.cached_partial(f, *args))
                return functools.partial(f, *args)

            self._jitted_train_step_fn = maybe_cache_and_partial(
                self._jitted_train_step_fn, self.model, self.optimizer, self.grad_accumulator
            )
            self._jitted_eval_step_fn = maybe_cache_and_partial(
                self._jitted_eval_step_fn, self.model
            )
        return self._jitted_train_step_fn, self._jitted_eval_step_fn

    def train(
        self, train_ds, eval_ds=None, skip_jit: bool = False, *, cache_nnx_graph: bool = True
    ) -> None:
        train_step, _ = self.jit_train_and_eval_step(skip_jit, cache_nnx_graph)
        ga = self.config.get_with_default("gradient_accumulation_steps", 1) or 1

        def call(train_example):
            self._iter_steps += 1
            flag = None
            if isinstance(train_example, dict):
                flag = train_example.get("is_update_step")
            if flag is None:
                flag = self._iter_steps % ga == 0
            is_update_step = bool(flag)
            train_loss, aux, grad_norm = train_step(
                train_example, is_update_step=jnp.array(is_update_step, dtype=jnp.bool_)
            )
            return train_loss, aux, is_update_step

        _step_loop(self, train_ds, call)


EMULATED = {
    "positional3": Positional3PeftTrainer,
    "bound2": Bound2PeftTrainer,
    "bound3_update": MainPeftTrainer,
}
"""The emulated ``PeftTrainer`` classes by convention name."""


ERA_BASES: tuple[str, ...] = ("positional3", "bound2")
"""Installed conventions an emulation can stand on: each emulated class subclasses the
installed ``PeftTrainer`` and takes its ``__init__`` (``optax.MultiSteps`` accumulation,
the step's parameter names); a base that already has main's accumulator path
(``bound3_update``) gives the emulation of an older convention parameters and an
accumulation it never had."""


def not_applicable(name: str, installed: str | None = None) -> str | None:
    """Why emulated convention ``name`` means nothing over the installed release (None
    when it does, and for ``installed``); ``installed``: that release's convention
    (default: detected)."""
    if name not in EMULATED:
        return None
    installed = installed or installed_convention()
    if installed in ERA_BASES:
        return None
    return (
        f"n/a: the {name} emulation subclasses the installed PeftTrainer, whose convention "
        f"is {installed}; it needs a base of its era ({' or '.join(ERA_BASES)})"
    )


def contract_bases() -> dict[str, type | None]:
    """Convention -> the ``PeftTrainer`` class the convention contracts build on:
    ``installed`` (None: the installed release's own ``train()``) and every emulated
    convention the installed release does not have. The matrix picks instead, through
    ``POSTTRAIN_CONTRACT_CONVENTIONS=installed|<name>,...|all``: ``installed`` for a
    release row, the emulated convention for an emulated row."""
    every = {"installed": None, **EMULATED}
    chosen = os.environ.get("POSTTRAIN_CONTRACT_CONVENTIONS")
    if chosen:
        names = chosen.split(",")
        return every if "all" in names else {k: v for k, v in every.items() if k in names}
    installed = installed_convention()
    return {k: v for k, v in every.items() if k != installed}


def installed_convention() -> str | None:
    """The installed Tunix's convention (``tunix_compat.detect``), or None where detecting
    it raises: the contracts' collection never depends on it (``tests/test_tunix_compat.py``
    holds ``detect`` itself). A collection error drops every test id of a file: the
    contracts would vanish from the matrix, and mutmut read each such mutant as a timeout.
    Without a convention every emulation runs, and the one that is the installed
    release's shows its difference as failures."""
    try:
        return tunix_compat.detect().name
    except Exception:  # noqa: BLE001 - tests/test_tunix_compat.py reports it
        return None


def by_convention(bases, *, emulated_slow: bool = False, in_gate: tuple[str, ...] = ()) -> list:
    """``bases``' names as pytest parameters, each marked with its convention (the
    ``convention`` marker: the matrix picks a row's tests by it), and skipped with the
    reason where the emulation means nothing over the installed base
    (:func:`not_applicable`: the report's n/a). ``emulated_slow``: the emulated
    conventions also marked ``slow`` (the gate runs the installed one; the matrix runs
    every marker), except those named in ``in_gate``."""
    import pytest

    params = []
    for name in bases:
        marks = [pytest.mark.convention(name)]
        if emulated_slow and name != "installed" and name not in in_gate:
            marks.append(pytest.mark.slow)
        reason = not_applicable(name)
        if reason:
            marks.append(pytest.mark.skip(reason=reason))
        params.append(pytest.param(name, marks=marks))
    return params
