"""Table rows, their conditions, and expanding a table for one model config.

A :class:`Row` pairs native parameter path templates with an HF key template
and a :class:`~posttrain.hf_schema.transforms.Transform`, plus an optional
condition. ``{i}`` in a template is the layer index (the row then expands once
per layer), ``{v}`` a vision tower layer's (once per ``cfg.vision.num_layers``),
``{j}`` the expert index (per-expert transforms expand it to
``0..E-1`` in numeric order). Expanding a table gives :class:`Entry` objects
with concrete keys; :func:`expand` proves that no key is produced twice on
either side, and the engine proves the native side covers the model exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from posttrain.config import AttentionConfig, ModelConfig
from posttrain.hf_schema.errors import ConversionError
from posttrain.hf_schema.transforms import Transform


@dataclasses.dataclass(frozen=True)
class Site:
    """Where a row is being expanded: the config, the on-disk layout, the layer type."""

    cfg: ModelConfig
    layout: str
    layer_type: str | None = None

    @property
    def attn(self) -> AttentionConfig:
        return self.cfg.attention[self.layer_type]


@dataclasses.dataclass(frozen=True)
class Condition:
    """A named predicate on a :class:`Site` (named so tables and errors read well)."""

    name: str
    test: Callable[[Site], bool]

    def __call__(self, site: Site) -> bool:
        return self.test(site)

    def __and__(self, other: Condition) -> Condition:
        return Condition(f"{self.name} & {other.name}", lambda s: self(s) and other(s))


ALWAYS = Condition("always", lambda s: True)
HUB = Condition("hub layout", lambda s: s.layout == "hub")
FUSED = Condition("fused layout", lambda s: s.layout == "fused")
UNTIED = Condition("untied embeddings", lambda s: not s.cfg.tie_word_embeddings)
V_PROJ = Condition("v_proj (not k_eq_v)", lambda s: not s.attn.k_eq_v)
QK_NORM = Condition("qk_norm", lambda s: s.attn.qk_norm)
ATTN_BIAS = Condition("attention bias", lambda s: s.attn.bias)
SINKS = Condition("attention sinks", lambda s: s.attn.sinks)
DENSE_MLP = Condition("dense mlp", lambda s: s.cfg.moe is None or s.cfg.dense_mlp_with_moe)
MLP_BIAS = DENSE_MLP & Condition("mlp bias", lambda s: s.cfg.mlp_bias)
MOE = Condition("moe", lambda s: s.cfg.moe is not None)
DENSE_AND_MOE = Condition("dense mlp beside moe", lambda s: s.cfg.dense_mlp_with_moe)
SANDWICH = Condition("sandwich norms", lambda s: s.cfg.sandwich_norm)
LAYER_SCALAR = Condition("layer scalar", lambda s: s.cfg.layer_scalar)
VISION = Condition("vision tower", lambda s: s.cfg.vision is not None)
STANDARDIZE = VISION & Condition("standardised vision", lambda s: s.cfg.vision.standardize)
CLIPPED = VISION & Condition("clipped vision linears", lambda s: s.cfg.vision.clipped_linears)


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of a family's conversion table.

    Attributes:
      native: native path template(s), one per native tensor of the transform.
      hf: HF key template (without the checkpoint's prefix).
      transform: from :data:`posttrain.hf_schema.transforms.REGISTRY`.
      when: the row applies only where this holds.
    """

    native: str | tuple[str, ...]
    hf: str
    transform: Transform
    when: Condition = ALWAYS

    @property
    def native_templates(self) -> tuple[str, ...]:
        return (self.native,) if isinstance(self.native, str) else tuple(self.native)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


@dataclasses.dataclass(frozen=True)
class Entry:
    """A row expanded at one layer (or once, for global rows): concrete keys."""

    row: Row
    layer: int | None
    hf_keys: tuple[str, ...]
    native_keys: tuple[str, ...]

    @property
    def transform(self) -> Transform:
        return self.row.transform


def _hf_keys(row: Row, i: int | None, num_experts: int) -> tuple[str, ...]:
    if row.transform.per_expert:
        if "{j}" not in row.hf:
            raise ConversionError(f"row {row.hf}: per-expert transform needs {{j}} in the key")
        return tuple(row.hf.format(i=i, j=j) for j in range(num_experts))
    if "{j}" in row.hf:
        raise ConversionError(
            f"row {row.hf}: {{j}} needs a per-expert transform, got {row.transform.name}"
        )
    return (row.hf.format(i=i),)


def expand(rows: Sequence[Row], cfg: ModelConfig, layout: str) -> list[Entry]:
    """Entries of ``rows`` for ``cfg`` in ``layout``, with unscanned native names.

    Raises:
      ConversionError: two entries produce the same HF key or native path.
    """
    num_experts = cfg.moe.num_experts if cfg.moe is not None else 0
    entries: list[Entry] = []
    for row in rows:
        if "{v}" in row.hf:
            if row.when(Site(cfg, layout)):
                entries.extend(
                    Entry(
                        row,
                        None,
                        (row.hf.format(v=v),),
                        tuple(t.format(v=v) for t in row.native_templates),
                    )
                    for v in range(cfg.vision.num_layers)
                )
        elif row.per_layer:
            for i, layer_type in enumerate(cfg.layer_types):
                if row.when(Site(cfg, layout, layer_type)):
                    entries.append(
                        Entry(
                            row,
                            i,
                            _hf_keys(row, i, num_experts),
                            tuple(t.format(i=i) for t in row.native_templates),
                        )
                    )
        elif row.when(Site(cfg, layout)):
            entries.append(Entry(row, None, _hf_keys(row, None, num_experts), row.native_templates))
    for side in ("hf_keys", "native_keys"):
        seen: dict[str, Entry] = {}
        for entry in entries:
            for key in getattr(entry, side):
                if key in seen:
                    raise ConversionError(
                        f"{key} is produced by two rows ({seen[key].row.hf} and {entry.row.hf})"
                    )
                seen[key] = entry
    return entries
