"""Test helper: count reads of ``tracer.sharding``.

Under tracing, ``tracer.sharding`` raises an AttributeError whose message (jax
``DynamicJaxprTracer._origin_msg``) walks every equation traced so far; read once per
parameter it makes a pass quadratic in the model size (model building, apply_lora).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import pytest


@contextlib.contextmanager
def tracer_sharding_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Within the block, every ``tracer.sharding`` read appends the tracer's type name to
    the yielded list (the read itself still raises as before)."""
    reads: list[str] = []
    original = jax.core.Tracer.sharding

    def counting(self):
        reads.append(type(self).__name__)
        return original.fget(self)

    with monkeypatch.context() as patch:
        patch.setattr(jax.core.Tracer, "sharding", property(counting))
        yield reads
