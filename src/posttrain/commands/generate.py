"""``posttrain generate``: prompts (text, chat messages or a JSONL file) through a model
and its KV cache; one prompt streams, several write JSONL."""

from __future__ import annotations

import json
import os
import pathlib
import re

from posttrain import atomic, chat, distributed
from posttrain.commands.generate_image import check_image_model, image_prompt
from posttrain.commands.generate_inputs import read_prompts
from posttrain.training.data import chat_prompt


def newest_export(run_dir: str = "runs/sft") -> str | None:
    """The ``model-step<N>`` directory with the largest N under ``run_dir`` (``None``: none)."""
    steps = [
        (int(m.group(1)), p)
        for p in pathlib.Path(run_dir).glob("model-step*")
        if (m := re.fullmatch(r"model-step(\d+)", p.name)) and p.is_dir()
    ]
    return str(max(steps)[1]) if steps else None


def _generation_tokenizer(args, model_spec: str):
    """``--tokenizer``; else the HF directory's ``tokenizer.json``; else the tokenizer the
    ``posttrain sft`` run that exported ``model_spec`` recorded; else the embedded one."""
    from posttrain.loading import recorded_tokenizer
    from posttrain.tokenizer import load_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    if os.path.isfile(os.path.join(model_spec, "tokenizer.json")):
        return load_tokenizer(model_spec)
    return load_tokenizer(recorded_tokenizer(model_spec))


def _prompts(args) -> list[dict]:
    """``[{"prompt": text} | {"messages": [...]}]`` from ``--prompt`` and ``--prompts``
    (:func:`posttrain.commands.generate_inputs.read_prompts`)."""
    return read_prompts(args.prompt, args.prompts)


def generate(args) -> int:
    """``posttrain generate``: one prompt streams its text to stdout; several write JSONL
    (``--output`` or stdout), one record per prompt."""
    from posttrain import flags, limits, sharding
    from posttrain import generate as gen

    spec = args.model or newest_export()
    if spec is None:
        raise ValueError(
            "no --model given and runs/sft holds no model-step<N> export; "
            "run `posttrain sft` first, or pass --model PRESET|DIR"
        )
    prompts = _prompts(args)
    if args.image:  # a model without a tower is refused before it is read
        check_image_model(args.image, spec)
    mesh = sharding.make_mesh(
        None
        if args.mesh is None
        else flags.parse_flag("--mesh", args.mesh, sharding.parse_mesh_spec)
    )
    with sharding.use_mesh(mesh):
        model, tok = _model_and_tokenizer(args, spec, mesh)
        # the checkpoint's own template and stop ids (its generation_config.json, then
        # config.json, then its tokenizer's eos_token; token names only when none says)
        formats = chat.checkpoint_formats(
            spec, tok, tokenizer_path=args.tokenizer, chat_template=args.chat_template
        )
        images = None
        if args.image:  # one prompt about one image (generate_image)
            prompt, images = image_prompt(args.image, prompts, model, tok, formats.template, spec)
            ids = [prompt]
        else:
            ids = [_prompt_ids(p, tok, args.chat, formats.template) for p in prompts]
        # before the cache is allocated: the positions and the memory it needs
        limits.check_generation(
            spec,
            model.config,
            rows=len(ids),
            prompt=max(len(i) for i in ids),
            new_tokens=args.max_new_tokens,
            cache_size=args.cache_size,
        )
        sampling = _sampling(args, formats)
        stream = None
        # One process streams; across processes the text is printed once, at the end.
        if len(ids) == 1 and not args.output and distributed.process_count() == 1:
            stream = _streamer(tok, sampling.eos_ids)
        out = gen.generate(
            model, ids, sampling, cache_size=args.cache_size, on_token=stream, images=images
        )
    if stream is not None:
        print(flush=True)
    elif distributed.is_writer():  # every process generated; one writes
        _print_or_write(args, prompts, out, tok)
    return 0


def _model_and_tokenizer(args, spec: str, mesh):
    """The model ``spec`` (with ``--adapter``) and its tokenizer.

    Raises:
      ValueError: the tokenizer has more ids than the model's vocabulary.
    """
    from posttrain.loading import load_model

    model, _ = load_model(spec, mesh, seed=args.seed, scratch=args.output or "generate")
    if args.adapter:
        model = _with_adapter(model, mesh, args.adapter)
    tok = _generation_tokenizer(args, spec)
    if tok.get_vocab_size() > model.config.vocab_size:
        raise ValueError(
            f"tokenizer has {tok.get_vocab_size()} ids but the model's vocab_size is "
            f"{model.config.vocab_size}; pass a matching --tokenizer"
        )
    return model, tok


def _prompt_ids(prompt: dict, tok, chat: bool, template=None) -> list[int]:
    """A prompt's token ids: messages (or ``--chat`` text) through the chat template
    (``template``: the checkpoint's; default ChatML), else the text's own tokens."""
    if "messages" in prompt or chat:
        messages = prompt.get("messages") or [{"role": "user", "content": prompt["prompt"]}]
        return chat_prompt(messages, tok, template)
    return tok.encode(prompt["prompt"], add_special_tokens=False).ids


def _sampling(args, formats: chat.CheckpointFormats):
    """The sampling options: each of ``--temperature``, ``--top-k``, ``--top-p`` given,
    else the checkpoint's ``generation_config.json``, else greedy; stopping at the
    checkpoint's stop ids and padding with its pad id (0 when nothing names one), from
    ``formats`` (:func:`posttrain.chat.checkpoint_formats`)."""
    from posttrain import generate as gen

    values = formats.sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    return gen.SamplingConfig(
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        eos_ids=formats.eos_ids,
        pad_id=formats.pad_id if formats.pad_id is not None else 0,
        **values,
    )


def _streamer(tok, eos: tuple[int, ...]):
    """An ``on_token`` callback printing row 0's text as it grows (a partial UTF-8
    character waits for the rest)."""
    shown: list[int] = []
    printed = [""]

    def stream(tokens, stopped) -> None:
        if stopped[0] or int(tokens[0]) in eos:
            return
        shown.append(int(tokens[0]))
        text = tok.decode(shown, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            print(text[len(printed[0]) :], end="", flush=True)
            printed[0] = text

    return stream


def _print_or_write(args, prompts: list[dict], out, tok) -> None:
    """One prompt without ``--output``: its text on stdout; else one JSONL record per
    prompt (text, tokens, logprobs, stop reason) to ``--output`` or stdout."""

    def text_of(i: int) -> str:
        row = out.row(i)
        ids = row[:-1] if out.stop_reasons[i] == "eos" else row
        return tok.decode(ids, skip_special_tokens=True)

    if len(prompts) == 1 and not args.output:
        print(text_of(0))
        return
    records = [
        {
            **p,
            "text": text_of(i),
            "tokens": out.row(i),
            "logprobs": [round(float(x), 6) for x in out.logprobs[i, : len(out.row(i))]],
            "stop_reason": out.stop_reasons[i],
        }
        for i, p in enumerate(prompts)
    ]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if args.output:
        atomic.write_text(args.output, text)
    else:
        print(text, end="")


def _with_adapter(model, mesh, directory: str):
    """``model`` with the LoRA adapter saved in ``directory`` applied and loaded.

    Raises:
      ValueError: no adapter there, or one that does not fit the model (named).
    """
    from posttrain.lora import apply_lora
    from posttrain.lora.adapters import load_adapter, read_adapter_config, saved_lora_config

    saved = read_adapter_config(directory)  # a JSON object of posttrain-lora's format
    if (
        saved.get("family") != model.config.family
        or saved.get("num_layers") != model.config.num_layers
    ):
        raise ValueError(
            f"--adapter {directory}: made for {saved.get('family')} with "
            f"{saved.get('num_layers')} layers, the model is {model.config.family} with "
            f"{model.config.num_layers}"
        )
    lora = saved_lora_config(saved, directory)
    return load_adapter(apply_lora(model, mesh, lora), directory)
