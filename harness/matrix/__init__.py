"""The matrix: the Tunix compatibility matrix's rows, run one cached environment each.

* :mod:`.entries`: ``compat/entries.toml`` read, checked and selected (the rows);
  :mod:`.sources`: Tunix from a git URL or a local directory.
* :mod:`.envs`: one cached environment per entry.
* :mod:`.matrix`: a row: its environment, contracts and run cells; :mod:`.progress` what
  it is doing, live.
* :mod:`.run_cells`: the short real runs per entry (:mod:`.distill_cell`,
  :mod:`.vision_cell` two of them).

Imports :mod:`harness.gate` (JUnit, deprecations) and :mod:`harness.devices`.
"""
