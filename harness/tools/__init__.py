"""Tools: developer tools that no command of the harness imports, and that import no room.

* :mod:`.mutants`: mutation testing (``python -m harness.tools.mutants``);
  :mod:`.mutant_targets` what it mutates with which tests (the harness's own modules':
  :mod:`.harness_targets`), :mod:`.mutant_sources` the sources it mutates (jitted
  functions made reachable).
* :mod:`.docs_run`: the docs' commands run as written (``python -m
  harness.tools.docs_run``); :mod:`.docs_figures` the figures they quote.
* :mod:`.op_profile`: where a compiled step's time goes, from a profiler trace (the
  benchmarks').
* :mod:`.divergence`: where float32 error enters a computation on an accelerator against
  the CPU, equation by equation (``python -m harness.tools.divergence``; its cases are
  ``tests/divergence_cases.py``).
* :mod:`.local_imports`: every import inside a function listed, by kind, with its reason
  (``python -m harness.tools.local_imports``, the lint step).
"""
