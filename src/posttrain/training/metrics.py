"""Per-step SFT metrics: the micro-step buffer, ``metrics.jsonl`` and the stdout line;
the finiteness checks before a record or a checkpoint is written.

One record per optimizer step, written when the next step has been dispatched (so
reading the device values never stalls the step in flight). Its time is taken when its
values have arrived, not when the step was dispatched: dispatch returns at once, and a
step timed at dispatch read 4 ms on a v5e whose step took 563 ms (issue 54).

=================  =====================================================================
``step``           optimizer step, from 1
``loss``           summed NLL of the step's micro-batches / their target tokens (exact)
``perplexity``     ``exp(min(loss, 80))``
``grad_norm``      global norm of the applied (accumulated) gradient
``moe_aux_loss``   mean of the micro-steps' load-balancing losses (unweighted; 0 if dense)
``target_tokens``  tokens that carry a loss, summed over the micro-steps
``tokens``         non-padding tokens, summed
``step_time_s``    wall time between the moments this step's and the previous step's
                   results were ready on the host (``null`` for the first)
``tokens_per_s``   ``tokens / step_time_s``
``learning_rate``  the schedule at this step (``null`` without one)
=================  =====================================================================

Values are strict JSON (``allow_nan=False``): a non-finite loss or gradient norm stops
training with :class:`NonFiniteLossError` before its record is written.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from posttrain import _compat

AUX_KEYS = ("nll_sum", "target_tokens", "moe_aux_loss", "grad_norm", "tokens")


class NonFiniteLossError(ValueError):
    """The loss or gradient norm of an optimizer step is NaN or infinite."""


class LearningRate:
    """``step -> float`` of an optax schedule, evaluated jitted: one compile, not one
    eager dispatch per op per step (~1.7 s of a 20-step CPU run; values in float32).

    A schedule that does not trace (Python control flow on the step, hashing it ...)
    raises a ``TypeError`` subclass under ``jax.jit`` (``ConcretizationTypeError``,
    ``TracerIntegerConversionError``, an unhashable tracer); it is then evaluated
    eagerly from that call on. A jitted schedule reads Python state once, when traced.
    """

    def __init__(self, fn: Callable[[int], float] | None) -> None:
        self.fn = fn
        self._jitted = None if fn is None else jax.jit(fn)

    def __call__(self, step: int) -> float | None:
        if self.fn is None:
            return None
        if self._jitted is not None:
            try:
                return float(self._jitted(step))
            except TypeError:
                self._jitted = None
        return float(self.fn(step))


class StepMetrics:
    """Collects the micro-steps of each optimizer step and writes its record.

    Args:
      grad_accum_steps: micro-steps per optimizer step.
      learning_rate_fn: ``step -> learning rate`` (an optax schedule), only logged.
      metrics_path: JSONL file the records are appended to (``None``: none written).
      log_every: also print one line per this many steps to stdout (``None``: never).
    """

    def __init__(
        self,
        grad_accum_steps: int,
        learning_rate_fn: Callable[[int], float] | None = None,
        metrics_path: str | os.PathLike | None = None,
        log_every: int | None = None,
    ) -> None:
        self.grad_accum_steps = grad_accum_steps
        self.learning_rate = LearningRate(learning_rate_fn)
        self.metrics_path = os.fspath(metrics_path) if metrics_path else None
        self.log_every = log_every
        self.history: list[dict] = []  # the records written
        self._micro: list[dict] = []
        self._pending: dict | None = None
        self._last_ready: float | None = None  # when the previous record's values arrived

    #: the aux keys of a micro-step that :meth:`summarise` reads
    keys: tuple[str, ...] = AUX_KEYS

    def summarise(self, micro: list[dict]) -> dict:
        """The record fields of one optimizer step from its micro-steps' aux values
        (floats): at least ``loss``, ``grad_norm`` and ``tokens``."""
        targets = float(sum(m["target_tokens"] for m in micro))
        loss = float(sum(m["nll_sum"] for m in micro)) / max(targets, 1.0)
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 80.0)),
            "grad_norm": float(micro[-1]["grad_norm"]),
            "moe_aux_loss": float(np.mean([m["moe_aux_loss"] for m in micro])),
            "target_tokens": int(targets),
            "tokens": int(sum(m["tokens"] for m in micro)),
        }

    def line(self, record: dict) -> str:
        """The progress line's body for one record."""
        return f"loss {record['loss']:.4f}, grad_norm {record['grad_norm']:.3f}"

    def add(self, aux: dict, step: int) -> None:
        """Buffers one micro-step's ``aux`` (device values); after the last micro-step of
        optimizer step ``step`` (from 1), writes the previous step's record."""
        self._micro.append({k: aux[k] for k in self.keys if k in aux})
        if len(self._micro) < self.grad_accum_steps:
            return
        record = {"step": step, "_micro": self._micro}
        self._micro = []
        self.flush()  # the previous step is done by now; keep this one's arrays in flight
        self._pending = record

    def discard(self) -> None:
        """Drops the pending record unwritten (training abandoned)."""
        self._pending = None

    def flush(self) -> None:
        """Writes the pending step record (device values -> floats).

        Raises:
          NonFiniteLossError: its loss or gradient norm is NaN or infinite.
        """
        record, self._pending = self._pending, None
        if record is None:
            return
        micro = jax.device_get(record.pop("_micro"))  # waits for the step's results
        ready = time.perf_counter()
        elapsed = None if self._last_ready is None else ready - self._last_ready
        self._last_ready = ready
        record.update(self.summarise(micro))
        tokens = record["tokens"]
        record.update(
            step_time_s=elapsed,
            tokens_per_s=None if not elapsed else tokens / elapsed,
            learning_rate=self.learning_rate(record["step"] - 1),
        )
        loss = record["loss"]
        if not (math.isfinite(loss) and math.isfinite(record["grad_norm"])):
            raise NonFiniteLossError(
                f"step {record['step']}: loss {loss}, grad_norm {record['grad_norm']}; "
                "training stopped before writing it (a learning rate too high?)"
            )
        self.history.append(record)
        if self.log_every and record["step"] % self.log_every == 0:
            speed = f", {record['tokens_per_s']:,.0f} tokens/s" if record["tokens_per_s"] else ""
            print(f"step {record['step']}: {self.line(record)}{speed}", flush=True)
        if self.metrics_path:
            with open(self.metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, allow_nan=False) + "\n")


class CheckedSaves:
    """Tunix's checkpoint manager whose saves first call ``check(step)``, for the steps
    it will actually write (:func:`posttrain._compat.checkpoint_due`); every other
    attribute is the manager's."""

    def __init__(self, inner, check) -> None:
        self._inner = inner
        self._check = check

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def save(self, step, model, *args, **kwargs):
        if _compat.checkpoint_due(self._inner, step, kwargs.get("force", False)):
            self._check(step)
        return self._inner.save(step, model, *args, **kwargs)


@jax.jit
def all_finite(tree) -> jax.Array:
    """Whether every element of every array in ``tree`` is finite (bool ``[]``)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)
