"""How the installed Tunix ``PeftTrainer`` calls its train step, read from Tunix's own code.

The convention is determined once, from the source of ``PeftTrainer.train``
(how it calls the step and how many values it unpacks) and of
``PeftTrainer.jit_train_and_eval_step`` (which trainer attributes it binds to
the jitted step), never from a version string. Known shapes
(``shared/research/tunix-conventions.md``):

=================  ==============================  ======================================  =======
name               bound to the jitted step        per-call arguments                      returns
=================  ==============================  ======================================  =======
``positional3``    nothing                         ``(model, optimizer, inputs)``          2
``bound2``         ``model, optimizer``            ``(inputs)``                            3
``bound3_update``  ``model, optimizer,             ``(inputs, is_update_step=...)``        3
                   grad_accumulator``
=================  ==============================  ======================================  =======

Releases: ``positional3`` in google-tunix 0.0.2-0.1.5, ``bound2`` in 0.1.6-0.1.7,
``bound3_update`` on main from commit 659881fb (2026-07-17; not released).
Anything else is :class:`UnknownConventionError` at trainer construction,
naming what was found.

Also here, the other pieces that exist because Tunix releases differ:
:func:`tunix_base` (which class's convention to read), :func:`checkpoint_saves_optimizer`
and :class:`OptimizerStateCheckpoints` (the optimizer state google-tunix <= 0.1.5
does not checkpoint).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap


class UnknownConventionError(RuntimeError):
    """The installed Tunix calls the train step in a way this package does not know."""


@dataclasses.dataclass(frozen=True)
class Convention:
    """One way ``PeftTrainer.train`` drives the train step.

    Attributes:
      name: ``positional3``, ``bound2``, ``bound3_update`` or ``unknown``.
      bound: trainer attributes bound to the jitted step, in order (e.g.
        ``("model", "optimizer")``).
      call_args: positional argument expressions at the call site in ``train``.
      call_keywords: keyword names at the call site (e.g. ``("is_update_step",)``).
      returns: number of values ``train`` unpacks from the step.
    """

    name: str
    bound: tuple[str, ...]
    call_args: tuple[str, ...]
    call_keywords: tuple[str, ...]
    returns: int

    @property
    def step_parameters(self) -> tuple[str, ...]:
        """Parameter names the step must have: bound attributes, then the call's."""
        if self.name == "positional3":
            return ("model", "optimizer", "inputs")
        return (*self.bound, "inputs", *self.call_keywords)

    def describe(self) -> str:
        bound = ", ".join(self.bound) or "nothing"
        call = ", ".join([*self.call_args, *(f"{k}=..." for k in self.call_keywords)])
        return f"binds ({bound}), calls step({call}), unpacks {self.returns} values"


KNOWN: dict[tuple[tuple[str, ...], int, tuple[str, ...], int], str] = {
    # (bound, number of positional call args, keywords, returns) -> name
    ((), 3, (), 2): "positional3",
    (("model", "optimizer"), 1, (), 3): "bound2",
    (("model", "optimizer", "grad_accumulator"), 1, ("is_update_step",), 3): "bound3_update",
}


def _function_ast(source: str) -> ast.FunctionDef:
    tree = ast.parse(textwrap.dedent(source))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            return node
    raise UnknownConventionError("no function definition in the given source")


def _step_call(train_fn: ast.FunctionDef) -> tuple[ast.Call, int]:
    """The ``train_step(...)`` call in ``train`` and the number of targets it is unpacked to."""
    for node in ast.walk(train_fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            if isinstance(func, ast.Name) and func.id == "train_step":
                target = node.targets[0]
                count = len(target.elts) if isinstance(target, ast.Tuple) else 1
                return node.value, count
    raise UnknownConventionError("PeftTrainer.train has no `... = train_step(...)` call")


def _bound_attributes(jit_fn: ast.FunctionDef) -> tuple[str, ...]:
    """``self.<attr>`` arguments bound with the jitted train step (partial / cached_partial)."""
    for node in ast.walk(jit_fn):
        if not isinstance(node, ast.Assign):
            continue
        target = node.targets[0]
        if not (isinstance(target, ast.Attribute) and target.attr == "_jitted_train_step_fn"):
            continue
        call = node.value
        if not isinstance(call, ast.Call):
            continue
        func = call.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in ("jit", "nnx.jit"):
            continue
        return tuple(a.attr for a in call.args[1:] if isinstance(a, ast.Attribute))
    return ()


def detect_from_source(train_source: str, jit_source: str) -> Convention:
    """Reads the convention from the source of ``train`` and ``jit_train_and_eval_step``.

    Returns a :class:`Convention`; its ``name`` is ``unknown`` when the shape is
    not in :data:`KNOWN`.

    Raises:
      UnknownConventionError: the sources have no recognisable step call.
    """
    call, returns = _step_call(_function_ast(train_source))
    bound = _bound_attributes(_function_ast(jit_source))
    args = tuple(ast.unparse(a) for a in call.args)
    keywords = tuple(k.arg for k in call.keywords if k.arg)
    name = KNOWN.get((bound, len(args), keywords, returns), "unknown")
    return Convention(name, bound, args, keywords, returns)


def detect(trainer_cls: type | None = None) -> Convention:
    """The convention of ``trainer_cls`` (default: the installed ``PeftTrainer``).

    Raises:
      UnknownConventionError: the shape is not one of :data:`KNOWN`; the
        message describes what was found.
    """
    if trainer_cls is None:
        from tunix.sft import peft_trainer

        trainer_cls = peft_trainer.PeftTrainer
    found = detect_from_source(
        inspect.getsource(trainer_cls.train), inspect.getsource(trainer_cls.jit_train_and_eval_step)
    )
    if found.name == "unknown":
        raise UnknownConventionError(
            f"{trainer_cls.__module__}.{trainer_cls.__qualname__} uses an unknown train-step "
            f"convention: {found.describe()}; known: {sorted(KNOWN.values())}"
        )
    return found


def checkpoint_saves_optimizer(manager_cls: type | None = None) -> bool:
    """Whether Tunix's ``CheckpointManager.save`` takes the optimizer (google-tunix >= 0.1.6).

    Up to 0.1.5 ``save(step, model, save_only_lora_params, force[, custom_metadata])``
    writes the params only, so a resumed run restarts its optimizer state;
    :class:`posttrain.training.trainer.SFTTrainer` then checkpoints the optimizer itself.
    """
    if manager_cls is None:
        from tunix.sft import checkpoint_manager

        manager_cls = checkpoint_manager.CheckpointManager
    return "optimizer" in inspect.signature(manager_cls.save).parameters


#: Tunix's ``TrainingInput`` field for a vision model's images (google-tunix >= 0.1.6).
IMAGE_FIELD = "images"


def image_field(training_input: type | None = None) -> str | None:
    """The name of the installed ``TrainingInput``'s images field (``images``: google-tunix
    >= 0.1.6, which its default loss passes to the model as ``images=``), None without one.
    ``posttrain sft --vision`` puts each batch's images there (:mod:`posttrain.vision.run`).
    """
    if training_input is None:
        from tunix.sft import peft_trainer

        training_input = peft_trainer.TrainingInput
    names = {f.name for f in dataclasses.fields(training_input)}
    return IMAGE_FIELD if IMAGE_FIELD in names else None


def tunix_base(cls: type, mixin: type) -> type:
    """The first class in ``cls``'s MRO, past ``mixin`` (the SFT step's), that defines
    ``train``: the Tunix trainer whose convention :func:`detect` reads.

    Raises:
      TypeError: ``cls`` has no such base.
    """
    for klass in cls.__mro__:
        if "train" in vars(klass) and not issubclass(klass, mixin):
            return klass
    raise TypeError(f"{cls.__name__} has no Tunix PeftTrainer base")


class OptimizerStateCheckpoints:
    """Tunix's checkpoint manager plus the optimizer state, for google-tunix <= 0.1.5
    (where :func:`checkpoint_saves_optimizer` is false).

    Those releases save and restore only the params, so a resumed run would restart
    Adam's moments and the MultiSteps counter and leave the uninterrupted run's
    losses. This wrapper saves ``nnx.state(optimizer, OptState)`` with Orbax in
    ``<checkpoint root>-optimizer/<step>`` whenever Tunix's manager saves a step,
    and restores it for the step Tunix restored. Every other attribute is Tunix's.

    Args:
      inner: Tunix's checkpoint manager.
      root: its checkpoint root directory.
      optimizer: ``() -> nnx.Optimizer``, the trainer's current optimizer.
    """

    def __init__(self, inner, root: str, optimizer) -> None:
        import orbax.checkpoint as ocp

        self._inner = inner
        self._optimizer = optimizer
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            os.fspath(root).rstrip("/") + "-optimizer",
            options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
        )

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _state(self):
        from flax import nnx

        return nnx.state(self._optimizer(), nnx.optimizer.OptState)

    def save(self, step, model, *args, **kwargs):
        saved = self._inner.save(step, model, *args, **kwargs)
        if saved is None:  # releases that return nothing: compare steps
            saved = self._inner.latest_step() == step
        if saved and self._manager.latest_step() != step:
            self._manager.save(step, args=self._ocp.args.PyTreeSave(self._state()), force=True)
        return saved

    def restore(self, step: int) -> None:
        """Restores the optimizer state of ``step`` (the step Tunix restored), if saved.

        Raises:
          RuntimeError: Tunix restored ``step`` but no optimizer state was saved for it.
        """
        from flax import nnx

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
        nnx.update(self._optimizer(), restored)

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
        self._inner.close()
