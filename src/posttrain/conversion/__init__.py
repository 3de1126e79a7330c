"""HF <-> native checkpoint conversion: declarative tables, one engine, streaming I/O.

* :mod:`.transforms`: the closed registry of tensor transforms, each with its inverse.
* :mod:`.rows`: table rows, their conditions, expansion for a config.
* :mod:`.tables`: one table (a tuple of rows) per family.
* :mod:`.hf_config`: ``from_hf_config`` / ``to_hf_config``, the one place HF names are read.
* :mod:`.engine`: plans (headers only, every key proven used exactly once) and the
  streaming run; :mod:`.safetensors_io` the reader, writer and atomic directories.
* :mod:`.native`: the native directory format and ``load_native``.
* :mod:`.parity`: logits of HF ``transformers`` vs native (needs torch; imported lazily).

Importing this package imports neither torch nor transformers.
"""

from posttrain.conversion.engine import (
    Summary,
    convert_hf_to_native,
    convert_native_to_hf,
    hf_to_native_params,
    native_to_hf_params,
    plan_to_hf,
    plan_to_native,
)
from posttrain.conversion.errors import ConversionError
from posttrain.conversion.hf_config import family_of, from_hf_config, to_hf_config
from posttrain.conversion.native import (
    NativeMeta,
    abstract_params,
    load_native,
    read_native_params,
    save_native,
)
from posttrain.conversion.tables import TABLES

__all__ = [
    "ConversionError",
    "NativeMeta",
    "Summary",
    "TABLES",
    "abstract_params",
    "convert_hf_to_native",
    "convert_native_to_hf",
    "family_of",
    "from_hf_config",
    "hf_to_native_params",
    "load_native",
    "native_to_hf_params",
    "plan_to_hf",
    "plan_to_native",
    "read_native_params",
    "save_native",
    "to_hf_config",
]
