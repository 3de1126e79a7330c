"""HF <-> native checkpoint conversion: declarative tables, one engine, streaming I/O.

* :mod:`posttrain.hf_schema`: the transforms, rows, tables and HF config fields that
  each family (:mod:`posttrain.families`) declares its layout in.
* :mod:`.hf_config`: ``from_hf_config`` / ``to_hf_config`` (the fields every family has).
* :mod:`.plan`: plans from headers only (every key proven used exactly once);
  :mod:`.engine` the streaming run; :mod:`.safetensors_io` the reader, writer and
  atomic directories.
* :mod:`.native`: the native directory format and ``load_native``.
* :mod:`.parity`: logits of HF ``transformers`` vs native (needs torch; imported lazily).

Importing this package imports neither torch nor transformers.
"""

import importlib

# Public name -> defining module. Resolved on first access (PEP 562), so importing one
# submodule (``errors``, say) does not import the engine, which imports the models, which
# read the families.
_EXPORTS = {
    "ConversionError": "errors",
    "NativeMeta": "native",
    "Summary": "engine",
    "abstract_params": "native",
    "convert_hf_to_native": "engine",
    "convert_native_to_hf": "engine",
    "family_of": "hf_config",
    "from_hf_config": "hf_config",
    "hf_to_native_params": "engine",
    "load_native": "native",
    "native_to_hf_params": "engine",
    "plan_to_hf": "plan",
    "plan_to_native": "plan",
    "read_native_params": "native",
    "save_native": "native",
    "to_hf_config": "hf_config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
