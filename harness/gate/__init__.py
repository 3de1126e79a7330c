"""The gate: the test suite's pytest side and the pre-merge gate that runs it.

* :mod:`.pytest_plugin`: the pytest plugin (entry point ``pytest11``): device source,
  markers, environment report; :mod:`.plugin_options` its options and marker
  descriptions, :mod:`.session_tuning` its hypothesis profiles and GC,
  :mod:`.chip_precision` the ``matmul_precision`` marker and ``--emulate-chip-precision``.
* :mod:`.deprecations`: upstream deprecations as a verdict of their own;
  :mod:`.deprecation_recorder` the plugin object that records them on each test.
* :mod:`.junit`: pytest's JUnit XML, read once for the gate and the matrix.
* :mod:`.gate`: ``posttrain-harness gate``: its pytest command, exit status and summary.

Imports only :mod:`harness.devices`.
"""
