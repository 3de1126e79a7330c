"""The harness that keeps ``posttrain`` working while its upstreams move.

* :mod:`harness.devices` sets the JAX device source (N fake CPU devices, or the
  real accelerators) before JAX starts, and reports the environment.
* :mod:`harness.pytest_plugin` applies it to every pytest run (``--devices``),
  registers the markers and hypothesis profiles and reports versions.
* :mod:`harness.cli` is the ``posttrain-harness`` command's parser; :mod:`harness.gate`
  runs the pre-merge gate and :mod:`harness.subcommands` the others (devices, launch,
  matrix, bisect, report merge); :mod:`harness.mutants` the mutation runs and their
  targets.

Importing this package imports no JAX and changes no global state.
"""

from __future__ import annotations

from harness.devices import configure_devices

__all__ = ["configure_devices"]
