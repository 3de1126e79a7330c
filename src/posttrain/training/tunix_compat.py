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

What Tunix's ``nnx.jit`` of the step donates is read from the same source
(:func:`donated_by`: ``optimizer`` in every release, ``optimizer, grad_accumulator`` on
main); :func:`bind_like` binds another jitted step the way Tunix bound its own.

Also here, the other pieces that exist because Tunix releases differ:
:func:`tunix_base` (which class's convention to read), :func:`checkpoint_saves_optimizer`
and :class:`OptimizerStateCheckpoints` (the optimizer state google-tunix <= 0.1.5
does not checkpoint).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
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
      donated: the step's arguments Tunix's ``nnx.jit`` donates (:func:`donated_by`).
    """

    name: str
    bound: tuple[str, ...]
    call_args: tuple[str, ...]
    call_keywords: tuple[str, ...]
    returns: int
    donated: tuple[str, ...] = ("optimizer",)

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


def _is_train_step_assign(node: ast.AST) -> bool:
    """``self._jitted_train_step_fn = <call>``."""
    if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
        return False
    target = node.targets[0]
    return isinstance(target, ast.Attribute) and target.attr == "_jitted_train_step_fn"


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _donated(jit_fn: ast.FunctionDef) -> tuple[str, ...]:
    """The ``donate_argnames`` of the ``nnx.jit`` assigned to ``_jitted_train_step_fn``.

    Raises:
      UnknownConventionError: they are not a literal (a string or a tuple of strings).
    """
    for node in ast.walk(jit_fn):
        if _is_train_step_assign(node) and _call_name(node.value) == "jit":
            for keyword in node.value.keywords:
                if keyword.arg != "donate_argnames":
                    continue
                try:
                    names = ast.literal_eval(keyword.value)
                except ValueError:
                    raise UnknownConventionError(
                        f"the train step's donate_argnames={ast.unparse(keyword.value)} "
                        "is not a literal"
                    ) from None
                return (names,) if isinstance(names, str) else tuple(names)
            return ()
    return ()


def _bound_attributes(jit_fn: ast.FunctionDef) -> tuple[str, ...]:
    """``self.<attr>`` arguments bound with the jitted train step (partial / cached_partial)."""
    for node in ast.walk(jit_fn):
        if not _is_train_step_assign(node) or _call_name(node.value) == "jit":
            continue
        return tuple(a.attr for a in node.value.args[1:] if isinstance(a, ast.Attribute))
    return ()


def detect_from_source(train_source: str, jit_source: str) -> Convention:
    """Reads the convention from the source of ``train`` and ``jit_train_and_eval_step``.

    Returns a :class:`Convention`; its ``name`` is ``unknown`` when the shape is
    not in :data:`KNOWN`.

    Raises:
      UnknownConventionError: the sources have no recognisable step call.
    """
    call, returns = _step_call(_function_ast(train_source))
    jit_fn = _function_ast(jit_source)
    bound = _bound_attributes(jit_fn)
    args = tuple(ast.unparse(a) for a in call.args)
    keywords = tuple(k.arg for k in call.keywords if k.arg)
    name = KNOWN.get((bound, len(args), keywords, returns), "unknown")
    return Convention(name, bound, args, keywords, returns, _donated(jit_fn))


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


def donated_by(trainer_cls: type) -> tuple[str, ...]:
    """The train-step arguments ``trainer_cls``'s own ``jit_train_and_eval_step`` donates
    (its ``nnx.jit(train_step, donate_argnames=...)``), read from its source: google-tunix
    0.0.2-0.1.7 ``("optimizer",)``, main ``("optimizer", "grad_accumulator")``. The plan
    jits a Tunix trainer's step (GRPO's actor) with these.

    Raises:
      UnknownConventionError: they are not a literal.
    """
    return _donated(_function_ast(inspect.getsource(trainer_cls.jit_train_and_eval_step)))


def bind_like(built, jitted, bound: tuple):
    """``jitted`` (an ``nnx.jit`` of the train step) bound as Tunix bound ``built``, its own
    jitted step from ``jit_train_and_eval_step``: nothing (``positional3``: ``built`` is the
    ``nnx.jit`` itself), ``functools.partial(jitted, *bound)``, or, under
    ``cache_nnx_graph``, ``functools.partial(nnx.cached_partial(jitted, *bound))``
    (google-tunix 0.1.6+ and main; ``train()`` reads ``.func.jitted_fn`` of either, and
    ``.jitted_fn`` of the unbound one up to 0.1.5).

    Args:
      built: Tunix's jitted train step.
      jitted: the step to bind instead.
      bound: the objects the convention binds (``Convention.bound``: the trainer's model,
        optimizer[, gradient accumulator]).

    Raises:
      UnknownConventionError: ``built`` is a partial that binds other objects.
    """
    from flax import nnx

    if not isinstance(built, functools.partial):
        return jitted
    if not built.args:  # the cached partial hides what it binds: the convention names it
        return functools.partial(nnx.cached_partial(jitted, *bound))
    if len(built.args) != len(bound) or any(
        a is not b for a, b in zip(built.args, bound, strict=True)
    ):
        raise UnknownConventionError(
            f"Tunix bound {len(built.args)} objects to its train step, not the "
            f"convention's {len(bound)}"
        )
    return functools.partial(jitted, *bound)


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
