"""Building blocks of the decoder: norms, embeddings, RoPE, attention, MLP, MoE.

Layers import only ``posttrain.config``, ``posttrain.sharding`` and each other.
"""
