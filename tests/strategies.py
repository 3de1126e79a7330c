"""Hypothesis strategies shared by the tests. Each docstring states what it guarantees."""

from __future__ import annotations

import dataclasses
import itertools
import math

from hypothesis import settings
from hypothesis import strategies as st

from posttrain import families, sharding
from posttrain.config import ModelConfig, MoEConfig


def scaled(ci_examples: int) -> int:
    """``max_examples`` for a test that runs ``ci_examples`` under the ``ci`` profile (the
    gate's): scaled with the loaded profile, so ``thorough`` runs 10x more and ``dev`` half.
    Read when the test module is imported, after the harness plugin loaded the profile."""
    from harness.gate.pytest_plugin import PROFILE_EXAMPLES

    return max(1, round(ci_examples * settings().max_examples / PROFILE_EXAMPLES["ci"]))


def factorisations(devices: int, axes: tuple[str, ...]) -> list[dict[str, int]]:
    """Every assignment of sizes to ``axes`` whose product is ``devices`` (sizes >= 1)."""
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    out = []
    for sizes in itertools.product(divisors, repeat=len(axes)):
        if math.prod(sizes) == devices:
            out.append({a: s for a, s in zip(axes, sizes, strict=True) if s > 1})
    return out


def usable(cfg: ModelConfig, mesh_shape: dict[str, int]) -> bool:
    """Whether ``cfg.check_mesh`` accepts ``mesh_shape``."""
    try:
        cfg.check_mesh(mesh_shape)
    except ValueError:
        return False
    return True


def meshes(
    cfg: ModelConfig,
    devices: int = 8,
    axes: tuple[str, ...] = ("data", "fsdp", "expert", "tensor"),
) -> st.SearchStrategy[dict[str, int]]:
    """Mesh shapes over exactly ``devices`` devices on ``axes`` that ``cfg`` can use.

    Drawn from the full list of factorisations, so shrinking goes towards the
    first (fewest sharded axes, data-heavy) mesh.
    """
    shapes = [m for m in factorisations(devices, axes) if usable(cfg, m)]
    shapes.sort(key=lambda m: (len(m), sorted(m.items())))
    return st.sampled_from(shapes)


def mesh_id(mesh_shape: dict[str, int]) -> str:
    """Readable id: ``fsdp4-tensor2`` (``single`` when every axis is 1)."""
    return "-".join(f"{a}{s}" for a, s in mesh_shape.items() if s > 1) or "single"


ALL_AXES = sharding.MESH_AXES


CONVERSION_FAMILIES: tuple[str, ...] = families.NAMES


@st.composite
def tiny_model_configs(draw, family: str) -> ModelConfig:
    """Tiny ``ModelConfig``s of ``family`` that its HF config can express.

    Guarantees: 1-4 layers (GPT-OSS alternating sliding/full from layer 0, Gemma 4
    any sliding/full pattern ending in full, as HF forces); num_heads divisible by
    num_kv_heads; even head_dim; 2-6 experts with 1 <= top_k <= experts (MoE
    families); ``scan_layers`` only when the layer-type period divides the layers;
    tied or untied embeddings; float32 or bfloat16 parameters; d_model equal to
    num_heads * head_dim in about a quarter of the draws. Dimensions are small
    (d_model <= 60), so a conversion example runs in well under a second.
    """
    from posttrain.models import get_config  # here: importing models imports jax

    fam = families.get(family)
    cfg = get_config(fam.tiny)
    layers = draw(st.integers(1, 4))
    pattern = fam.oracle.layer_pattern
    if pattern == "alternating":
        types = tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))
    elif pattern == "ends_full":
        types = (
            *draw(
                st.lists(
                    st.sampled_from(("sliding", "full")), min_size=layers - 1, max_size=layers - 1
                )
            ),
            "full",
        )
    else:
        types = ("full",) * layers
    heads = draw(st.sampled_from((2, 4, 6)))
    kv = draw(st.sampled_from([k for k in (1, 2, 3, 6) if heads % k == 0]))
    head_dim = draw(st.sampled_from((4, 6, 10)))
    attention = {}
    for t in sorted(set(types)):
        base = cfg.attention.get(t, next(iter(cfg.attention.values())))
        if base.k_eq_v:  # full layers with their own head_dim and kv heads, k as v
            k_eq_v = draw(st.booleans())
            attention[t] = dataclasses.replace(
                base,
                num_heads=heads,
                head_dim=draw(st.sampled_from((4, 8, 12))),
                num_kv_heads=draw(st.sampled_from([k for k in (1, 2) if heads % k == 0]))
                if k_eq_v
                else kv,
                k_eq_v=k_eq_v,
            )
        else:
            attention[t] = dataclasses.replace(
                base, num_heads=heads, num_kv_heads=kv, head_dim=head_dim
            )
    changes = dict(
        num_layers=layers,
        layer_types=types,
        attention=attention,
        # square attention (num_heads * head_dim == d_model: a transposed q/o kernel is
        # no shape error there) as one of four choices, distinct dimensions otherwise
        d_model=draw(st.sampled_from((24, 40, 56, heads * head_dim)), label="d_model"),
        vocab_size=draw(st.sampled_from((40, 66))),
        tie_word_embeddings=draw(st.booleans()),
        param_dtype=draw(st.sampled_from(("float32", "bfloat16"))),
    )
    changes["dtype"] = changes["param_dtype"]
    if cfg.d_ff:
        changes["d_ff"] = draw(st.sampled_from((20, 36)))
    if cfg.moe is not None:
        experts = draw(st.integers(2, 6))
        changes["moe"] = dataclasses.replace(
            cfg.moe,
            num_experts=experts,
            top_k=draw(st.integers(1, experts)),
            moe_d_ff=draw(st.sampled_from((12, 28))),
        )
    cfg = cfg.replace(**changes)
    scan = draw(st.booleans()) and layers % cfg.layer_period == 0
    return cfg.replace(scan_layers=scan)


@st.composite
def presets_and_meshes(draw, devices: int = 8, axes: tuple[str, ...] = ALL_AXES):
    """``(preset, scan, mesh_shape)``: any ``<family>-tiny`` preset, scanned or not, and a mesh
    over exactly ``devices`` devices on ``axes`` (default: all seven) that the preset's config
    accepts (see :func:`meshes`; shrinks towards the first preset, unscanned, fewest axes)."""
    from posttrain.models import get_config
    from posttrain.models.presets import TINY_PRESETS

    preset = draw(st.sampled_from(TINY_PRESETS), label="preset")
    scan = draw(st.booleans(), label="scan")
    mesh_shape = draw(meshes(get_config(preset), devices, axes), label="mesh")
    return preset, scan, mesh_shape


def json_values(max_leaves: int = 8) -> st.SearchStrategy:
    """Any JSON value: null, booleans, integers (huge and negative included), finite
    floats, strings (any code point a JSON string may hold), lists and objects of them,
    nested a few levels. What a hand-edited ``config.json`` or JSONL line can contain."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=12),
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
        ),
        max_leaves=max_leaves,
    )


@st.composite
def moe_cases(draw, d_model: int, d_ff: int, shared_d_ff: int, activations: tuple[str, ...]):
    """A tiny MoE config, an activation, an input shape ``[B, T, d_model]`` and a seed.

    Guarantees: 1 <= top_k <= min(num_experts, 4), num_experts <= 6, at most 10
    tokens; every routing and expert option; block sizes that split one expert
    over several blocks.
    """
    num_experts = draw(st.integers(1, 6))
    scale = draw(st.booleans())
    cfg = MoEConfig(
        num_experts=num_experts,
        top_k=draw(st.integers(1, min(num_experts, 4))),
        moe_d_ff=d_ff,
        scoring=draw(st.sampled_from(["softmax", "sigmoid"])),
        score_order=draw(st.sampled_from(["score_then_topk", "topk_then_score"])),
        renormalize=draw(st.booleans()),
        router_bias=draw(st.booleans()),
        router_input_norm=draw(st.booleans()),
        per_expert_scale=scale,
        fuse_expert_scales=scale and draw(st.booleans()),
        expert_bias=draw(st.booleans()),
        capacity_factor=draw(st.none() | st.sampled_from([0.3, 0.75, 1.25])),
        shared_expert_d_ff=draw(st.none() | st.just(shared_d_ff)),
        block_size=draw(st.none() | st.sampled_from([1, 2, 3])),
    )
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 5)), d_model)
    return cfg, draw(st.sampled_from(activations)), shape, draw(st.integers(0, 2**16))


CHECKED_AXES = ("vocab", "embed", "heads", "kv_heads", "mlp", "exp")  # what check_mesh reads


@st.composite
def custom_rules(draw) -> sharding.Rules:
    """The default rules with each name ``check_mesh`` reads sent to 0-2 drawn mesh axes."""
    axes = ("data", "fsdp", "fsdp_transpose", "expert", "tensor")
    custom = {
        name: tuple(draw(st.lists(st.sampled_from(axes), max_size=2, unique=True)))
        for name in CHECKED_AXES
    }
    return tuple((n, custom.get(n, a)) for n, a in sharding.DEFAULT_RULES)


def chat_messages() -> st.SearchStrategy[list[dict[str, str]]]:
    """One conversation: 1-4 messages of any role, contents that include the ChatML
    markers themselves (``<|im_end|>``, ``<|im_start|>``), empty and arbitrary text."""
    from posttrain.training import data

    content = st.sampled_from(["", "<|im_end|>", "a<|im_start|>b"]) | st.text(max_size=12)
    message = st.fixed_dictionaries({"role": st.sampled_from(data.ROLES), "content": content})
    return st.lists(message, min_size=1, max_size=4)
