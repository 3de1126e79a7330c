"""Tunix's ``tunix.generate.sampler.Sampler`` driving a :class:`~posttrain.models.CausalLM`:
the one place its drift is absorbed, by feature, never by version.

What the sampler needs from the model (``shared/research/tunix-rl.md`` 3.2-3.5) and how
it is met:

- ``model.init_cache(batch, cache_size, dtype)``: :meth:`CausalLM.init_cache` (a fixed-
  shape pytree; the sampler threads it through its ``while_loop``).
- Prefill ``model(tokens, positions, cache, mask [B, L, cache_size])``, positional on every
  release; decode positional up to google-tunix 0.1.5 and with keywords ``positions=``,
  ``cache=``, ``attention_mask=`` from 0.1.6: ``CausalLM.__call__`` has exactly those
  parameter names in that order, so both calls bind the same way. Tunix's write index is
  ``end_index[0] % cache_size`` with left-padded prompts, as ours.
- ``get_attention_mask`` (0.1.6+, optional): absent, so the sampler builds its own
  causal x non-pad masks.
- ``decode_only_last_token`` (0.1.7+, probed by that literal parameter name in
  ``__call__``'s signature): present, so a prefill without ``echo`` projects only the
  last position onto the vocabulary (``[B, 1, V]`` logits), as our ``generate`` does;
  older releases never pass it.
- ``model.config.dtype`` (0.1.7+ passes it to ``init_cache``): ``ModelConfig.dtype``, a
  string ``init_cache`` accepts.
- ``CacheConfig(cache_size, num_layers, num_kv_heads, head_dim)``: every release reads the
  three shape fields (only its deprecated fallback cache uses them); :func:`cache_config`
  gives the model's, from its first layer type (Gemma 4's full layers differ, which the
  fallback cannot express; our ``init_cache`` is always used).
- The tokenizer: :class:`TunixTokenizer`, the duck-typed protocol every release's
  ``TokenizerAdapter`` accepts (``encode`` -> ids, ``decode``, ``bos_id``, ``eos_id``,
  ``pad_id``). Its ``bos_id`` is ``None`` for tokenizers without one (the byte tokenizer),
  so no release prepends a BOS, and up to 0.1.5 (which prepends ``bos_id()`` to
  ``encode``'s ids without deduplicating) a BOS is never doubled: ``encode`` never adds
  one.

Found by the contract (google-tunix 0.1.7): the sampler's decode mask is ``slot <= step``
and ``token_buffer != pad``, so a *generated* token equal to the pad id is hidden from
every later step (ours keeps it visible); :class:`TunixTokenizer` therefore pads with a
special token, never a byte id.
"""

from __future__ import annotations

import inspect


class TunixTokenizer:
    """A ``tokenizers.Tokenizer`` in the shape Tunix's ``TokenizerAdapter`` accepts.

    Args:
      tokenizer: the ``tokenizers.Tokenizer`` (e.g. :func:`posttrain.tokenizer.byte_tokenizer`).
      eos: the end-of-sequence token's name (default ``<|im_end|>``, ChatML's), used
        when ``eos_ids`` is not given.
      eos_ids: the checkpoint's stop ids (:func:`posttrain.chat.stop_ids`), one or more:
        ``eos_id()`` is the first, :attr:`stop_ids` all of them (a sampler's
        ``eos_tokens``).
      pad: the token prompts are padded with (default ``<|pad|>``; id 0 when the
        vocabulary has no such token). Tunix's decode masks hide every slot whose token
        is the pad id, generated ones included, so it must be one the model does not
        generate: a byte such as id 0 can be.
      bos: the beginning-of-sequence token to prepend (default none).

    Raises:
      ValueError: ``eos`` (without ``eos_ids``) or ``bos`` is not in the vocabulary, or
        ``eos_ids`` is empty.
    """

    def __init__(
        self,
        tokenizer,
        *,
        eos: str = "<|im_end|>",
        pad: str = "<|pad|>",
        bos=None,
        eos_ids=None,
    ):
        self.tokenizer = tokenizer
        if eos_ids is not None:
            self.stop_ids = tuple(int(i) for i in eos_ids)
            if not self.stop_ids:
                raise ValueError("eos_ids=(): expected at least one stop id")
        else:
            eos_id = tokenizer.token_to_id(eos)
            if eos_id is None:
                raise ValueError(f"eos token {eos!r} is not in the tokenizer's vocabulary")
            self.stop_ids = (eos_id,)
        self._eos = self.stop_ids[0]
        pad_id = tokenizer.token_to_id(pad)
        self._bos = None if bos is None else tokenizer.token_to_id(bos)
        if bos is not None and self._bos is None:
            raise ValueError(f"bos token {bos!r} is not in the tokenizer's vocabulary")
        self._pad = 0 if pad_id is None else pad_id

    def encode(self, text: str, **kwargs) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids, **kwargs) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def bos_id(self):
        return self._bos

    def eos_id(self) -> int:
        return self._eos

    def pad_id(self) -> int:
        return self._pad


def cache_config(model, cache_size: int):
    """Tunix's ``CacheConfig`` for ``model`` (its fields read by feature: the names of
    ``CacheConfig``'s parameters)."""
    from tunix.generate import sampler

    cfg = model.config
    first = cfg.attention[cfg.layer_types[0]]
    values = {
        "cache_size": cache_size,
        "num_layers": cfg.num_layers,
        "num_kv_heads": first.num_kv_heads,
        "head_dim": first.head_dim,
    }
    wanted = inspect.signature(sampler.CacheConfig).parameters
    return sampler.CacheConfig(**{k: v for k, v in values.items() if k in wanted})


def make_sampler(model, tokenizer, cache_size: int):
    """The installed Tunix's ``Sampler`` over ``model`` with ``tokenizer`` (a
    ``tokenizers.Tokenizer``, wrapped in :class:`TunixTokenizer`, or already a Tunix
    tokenizer) and a cache of ``cache_size`` slots."""
    from tunix.generate import sampler

    if not isinstance(tokenizer, TunixTokenizer) and hasattr(tokenizer, "token_to_id"):
        tokenizer = TunixTokenizer(tokenizer)
    return sampler.Sampler(
        transformer=model, tokenizer=tokenizer, cache_config=cache_config(model, cache_size)
    )


def run(sampler, prompts, **options):
    """Calls ``sampler(prompts, **options)`` with the options its release takes (e.g.
    ``eos_tokens`` arrived after google-tunix 0.0.2, whose sampler stops at the
    tokenizer's ``eos_id()`` only). Returns its ``SamplerOutput``."""
    accepted = inspect.signature(type(sampler).__call__).parameters
    return sampler(prompts, **{k: v for k, v in options.items() if k in accepted})


def decode_calls(max_generation_steps: int) -> int:
    """Model calls the installed ``Sampler``'s decode loop makes after the prefill when no
    row stops early: ``max_generation_steps`` on google-tunix 0.0.2-0.1.7, whose
    ``while_loop`` runs while ``decoding_step < total_sampling_steps`` (one call whose
    token is never used); one fewer on main from f8a25bef (2026-06-28), whose condition is
    ``< total_sampling_steps - 1`` (``shared/research/tunix-rl.md`` 7, bug class 1).
    Read from the source of ``Sampler._decode_fn``, feature by feature."""
    from tunix.generate import sampler as sampler_lib

    source = inspect.getsource(sampler_lib.Sampler._decode_fn)
    fixed = "total_sampling_steps - 1" in " ".join(source.split())
    return max_generation_steps - 1 if fixed else max_generation_steps
