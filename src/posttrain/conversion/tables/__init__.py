"""One conversion table per family: a tuple of rows (see :mod:`posttrain.conversion.rows`).

:data:`TABLES` maps the family name (``ModelConfig.family``) to its :class:`Table`.
"""

from __future__ import annotations

from posttrain.conversion.tables import gemma4, gpt_oss, llama3, mixtral, qwen3, qwen3_moe
from posttrain.conversion.tables.common import Table

TABLES: dict[str, Table] = {
    t.family: t
    for t in (
        llama3.TABLE,
        qwen3.TABLE,
        qwen3_moe.TABLE,
        mixtral.TABLE,
        gemma4.TABLE,
        gpt_oss.TABLE,
    )
}

__all__ = ["TABLES", "Table"]
