"""Names of pytree paths: the one spelling of a parameter's dotted name.

``model.layers.0.self_attn.q_proj.kernel`` is how every checkpoint, table, adapter
file and message in this package names a parameter.
"""

from __future__ import annotations

from collections.abc import Iterable


def path_name(path: Iterable) -> str:
    """The dotted name of a pytree or NNX path.

    Entries may be JAX key-path entries (``DictKey.key``, ``SequenceKey.idx``,
    ``GetAttrKey.name``) or plain strings and integers (NNX paths):
    ``(DictKey('model'), DictKey('layers'), DictKey(0), ...)`` and
    ``('model', 'layers', 0, ...)`` both give ``model.layers.0...``.
    """
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                k = getattr(k, attr)
                break
        parts.append(str(k))
    return ".".join(parts)
