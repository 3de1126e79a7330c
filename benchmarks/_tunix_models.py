"""Tunix's own models in our presets' shapes, the baselines of the step benchmarks (run as
``python benchmarks/X.py``, so this folder is on ``sys.path``)."""

from __future__ import annotations


def tunix_qwen3_config(cfg):
    """``tunix.models.qwen3.model.ModelConfig`` with ``cfg``'s shape (a full-attention
    :class:`~posttrain.config.ModelConfig`, e.g. qwen3-tiny's: dense or routed, tied or
    not; a routed one's experts as ``num_experts`` / ``num_experts_per_tok``), in ``cfg``'s
    activation and parameter dtypes (Tunix's default is float32 for both)."""
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as tunix_qwen3

    attn = cfg.attention["full"]
    moe = cfg.moe
    routed = (
        {} if moe is None else {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k}
    )
    return tunix_qwen3.ModelConfig(
        num_layers=cfg.num_layers,
        vocab_size=cfg.vocab_size,
        embed_dim=cfg.d_model,
        hidden_dim=cfg.d_ff,
        num_heads=attn.num_heads,
        head_dim=attn.head_dim,
        num_kv_heads=attn.num_kv_heads,
        rope_theta=int(attn.rope.theta),
        norm_eps=cfg.norm_eps,
        use_tied_embedding=cfg.tie_word_embeddings,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.param_dtype),
        **routed,
    )


def tunix_qwen3(cfg, **overrides):
    """``(Tunix's own Qwen3 in cfg's shape, its mesh)``: built by Tunix (seed 0), each
    parameter placed by Tunix's own sharding annotations on an ``(fsdp, tp)`` mesh of every
    device (``fsdp`` all of them). ``overrides``: more ``ModelConfig`` fields (e.g.
    ``remat_config``, ``use_flash_attention``)."""
    import dataclasses

    import jax
    import numpy as np
    from flax import nnx
    from tunix.models.qwen3 import model as tunix_qwen3_model

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1, 1), ("fsdp", "tp"))
    config = dataclasses.replace(tunix_qwen3_config(cfg), **overrides)
    model = tunix_qwen3_model.Qwen3(config, rngs=nnx.Rngs(0))
    place_by_annotations(model, mesh)
    return model, mesh


def place_by_annotations(model, mesh) -> None:
    """Places each of ``model``'s variables on ``mesh`` as its own sharding annotations say
    (``nnx.get_partition_spec``: Tunix's axis names, Qwix's adapters' too), in place."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding

    state = nnx.state(model)
    place = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    nnx.update(model, jax.tree.map(place, state, nnx.get_partition_spec(state)))
