"""The Qwen-style sliding-window fields (``use_sliding_window``, ``sliding_window``,
``max_window_layers``), read and written once for every family that has them
(:func:`posttrain.hf_schema.hf_fields.max_window_layers` / ``max_window_fields``).

transformers 5 writes ``layer_types`` into every config, so the parity tests never reach
the rule for a config without it (an older checkpoint's): these cases do, against the
rule of HF ``Qwen3Config`` (layers from ``max_window_layers`` on slide)."""

from __future__ import annotations

import pytest

from posttrain.conversion import from_hf_config, to_hf_config
from posttrain.hf_schema import hf_fields
from posttrain.models import get_config

pytestmark = pytest.mark.host

FULL, SLIDING = "full", "sliding"


def _config(**fields):
    return {"num_hidden_layers": 4, **fields}


@pytest.mark.parametrize(
    ("fields", "types", "window"),
    [
        # layers 0 and 1 full, 2 and 3 slide: the boundary layer itself slides
        (
            dict(use_sliding_window=True, sliding_window=6, max_window_layers=2),
            (FULL, FULL, SLIDING, SLIDING),
            6,
        ),
        (dict(use_sliding_window=True, sliding_window=6, max_window_layers=0), (SLIDING,) * 4, 6),
        # the start past the last layer: nothing slides, so no window either
        (dict(use_sliding_window=True, sliding_window=6, max_window_layers=4), (FULL,) * 4, None),
        # a window given but switched off
        (dict(use_sliding_window=False, sliding_window=6, max_window_layers=0), (FULL,) * 4, None),
        # no max_window_layers: the config class's default start (here 3)
        (dict(use_sliding_window=True, sliding_window=5), (FULL, FULL, FULL, SLIDING), 5),
        # no use_sliding_window: off, as HF's default (a window alone does not slide)
        (dict(sliding_window=6, max_window_layers=0), (FULL,) * 4, None),
    ],
    ids=["from-2", "from-0", "past-the-end", "switched-off", "default-start", "switch-absent"],
)
def test_the_window_starts_at_max_window_layers_without_layer_types(fields, types, window):
    got_types, got_window = hf_fields.max_window_layers(_config(**fields), 3)
    assert (got_types, got_window) == (types, window)


def test_layer_types_when_given_decide_which_layers_slide():
    config = _config(
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=0,
        layer_types=["full_attention", "sliding_attention", "full_attention", "full_attention"],
    )
    assert hf_fields.max_window_layers(config, 3) == ((FULL, SLIDING, FULL, FULL), 6)


def test_the_fields_written_read_back_to_the_same_layers():
    """``max_window_fields`` writes start 0 and leaves the layers to ``layer_types``."""
    cfg = get_config("qwen3-tiny")
    written = hf_fields.max_window_fields(cfg)
    assert written == {"use_sliding_window": False, "max_window_layers": 0, "sliding_window": None}
    config = _config(**written)
    assert hf_fields.max_window_layers(config, 3) == ((FULL,) * 4, None)


def test_a_sliding_model_writes_its_window_and_reads_back_the_same():
    """qwen3-tiny with its second layer sliding (read from the fields alone, no
    ``layer_types``): written, the window is on; read again, the same layers slide."""
    fields = to_hf_config(get_config("qwen3-tiny"))
    del fields["layer_types"]
    fields.update(use_sliding_window=True, sliding_window=6, max_window_layers=1)
    cfg = from_hf_config(fields)
    assert cfg.layer_types == (FULL, SLIDING)
    written = hf_fields.max_window_fields(cfg)
    assert written == {"use_sliding_window": True, "max_window_layers": 0, "sliding_window": 6}
    again = from_hf_config(to_hf_config(cfg))
    assert again.layer_types == (FULL, SLIDING)
    assert hf_fields.sliding_window(again) == 6
