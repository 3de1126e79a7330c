"""The report: the matrix's rows as ``compat-matrix.json``, ``.md`` and ``.html``.

* :mod:`.report`: build, load, merge and write the report; :mod:`.shape` the shape
  a report must have to be merged or rendered.
* :mod:`.markdown`, :mod:`.html`: its two renderings.
* :mod:`.drift`: its "newer upstream releases" section; :mod:`.fits` its "fits" section
  (``python -m harness.report.fits`` plans the seed configurations).

Imports :mod:`harness.matrix` (the cells' vocabulary, redaction) and the rooms below it.
"""
