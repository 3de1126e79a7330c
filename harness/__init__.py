"""The harness that keeps ``posttrain`` working while its upstreams move, in rooms.

From the top (a room imports only the rooms below it; pyproject's import-linter
contracts keep it so):

* :mod:`harness.cli`: the ``posttrain-harness`` command's parser and dispatch;
  :mod:`harness.subcommands` the bodies of its subcommands other than the gate.
* :mod:`harness.bisect`: name the upstream commit that broke a contract or run cell.
* :mod:`harness.tools`: the developer tools no command imports (mutation testing, the
  docs' commands and figures, the profiler trace's ops).
* :mod:`harness.report`: the matrix report (JSON, Markdown, HTML) and its sections
  (upstream drift, the plan fits).
* :mod:`harness.matrix`: the compatibility matrix's rows, environments and run cells.
* :mod:`harness.gate`: the test suite's pytest plugin and the pre-merge gate over it.
* :mod:`harness.devices`: the JAX device source, and the local multi-process launcher.

Importing this package imports no JAX and changes no global state.
"""

from __future__ import annotations

__all__ = ["configure_devices"]


def __getattr__(name: str):
    """``harness.configure_devices``, imported when first asked for: importing ``harness``
    leaves its rooms unimported, so ``python -m harness.devices.compile_cache`` runs a
    module that no package import ran first (runpy warns then)."""
    if name == "configure_devices":
        from harness.devices.devices import configure_devices

        return configure_devices
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
