"""Devices: where JAX runs (the bottom room; it imports no other).

* :mod:`.devices`: the device source (N fake CPU devices, or the real accelerators), set
  once before JAX starts, and the facts reports name (versions, backend, devices).
* :mod:`.compile_cache`: JAX's persistent compilation cache of the suites' runs, kept
  under a size before each run.
* :mod:`.launch`: ``posttrain-harness launch``, N local processes forming one JAX runtime.
"""
