"""posttrain: a JAX/Flax NNX post-training stack.

Importing the package changes no global state (no JAX flags, no device setup).
"""

__version__ = "0.1.0"
