"""The language a family writes its HF layout in: what each HF tensor and config field
is in the native model. Each family (:mod:`posttrain.families`) declares its table and
config hooks with it; :mod:`posttrain.conversion` runs them. It imports neither, so the
layers go conversion -> models -> families -> hf_schema with no loop (pyproject's
import contracts).

* :mod:`.transforms`: the closed registry of tensor transforms, each with its inverse.
* :mod:`.rows`: table rows, their conditions, expansion for a config.
* :mod:`.table`: the :class:`~.table.Table` type and the rows families share; each
  family's table lives in its module.
* :mod:`.hf_fields`: the readers and writers of HF ``config.json`` fields that the
  families' ``from_hf`` / ``to_hf`` hooks share (``posttrain.conversion.hf_config`` holds
  the part every family has).
* :mod:`.errors`: :class:`~.errors.ConversionError`, the one exception type of
  conversion.
"""
