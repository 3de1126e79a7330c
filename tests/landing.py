"""What a run builds before its first step, for :mod:`tests.test_options_land`: each
workflow is started through its real run function (``run_sft``, ``run_dpo``,
``run_grpo``, ``run_distill``, ``posttrain generate``'s command) and stopped where it
hands its objects over (the trainer's or learner's ``train``, our ``generate``), and the
objects are kept for the landing checks: Tunix's configs, the optax transformation, the
model, the first batch, the run record.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import numpy as np


class Stop(Exception):
    """Raised where the run hands its objects over, once they are kept."""


@dataclasses.dataclass
class Seen:
    """What one run built.

    Attributes:
      cfg: the run's options (as checked; the value each landing check expects).
      error: the run's one-line refusal, or None.
      trainer: the SFT / DPO / distillation trainer (None for GRPO).
      learner, policies: GRPO's Tunix learner and ``(actor, reference)``.
      batch: the first micro-batch the trainer receives.
      record: ``run.json`` as written before the first step.
      calls: our ``posttrain.generate.generate`` calls: ``(model, prompts, sampling,
        kwargs)`` each.
      model: the trained model (the policy's model for DPO and GRPO).
    """

    cfg: Any
    error: str | None = None
    trainer: Any = None
    learner: Any = None
    policies: tuple = ()
    batch: Any = None
    record: dict = dataclasses.field(default_factory=dict)
    calls: list = dataclasses.field(default_factory=list)

    @property
    def model(self):
        from posttrain.training.policy import TunixPolicy

        model = self.policies[0] if self.learner is not None else self.trainer.model
        return model.model if isinstance(model, TunixPolicy) else model


def _record(cfg) -> dict:
    from posttrain.training import record

    return record.read(cfg.output) or {}


def _stopped(start, seen: Seen) -> Seen:
    try:
        start()
    except Stop:
        return seen
    except ValueError as error:
        seen.error = str(error).splitlines()[0]
        return seen
    raise AssertionError("the run trained instead of stopping at train()")


def _stop_trainer(seen: Seen):
    """An ``on_built`` that keeps the trainer and its first batch, then stops."""

    def on_built(trainer):
        def train(batches, *args, **kwargs):
            seen.trainer, seen.batch, seen.record = trainer, next(iter(batches)), _record(seen.cfg)
            trainer.abandon()
            raise Stop

        trainer.train = train

    return on_built


def capture(workflow: str, cfg, monkeypatch) -> Seen:
    """Starts ``cfg`` through ``workflow``'s run function and returns what it built up to
    its first step (or its one-line refusal). Our own ``generate`` is wrapped to keep its
    calls (GRPO's evaluation, ``posttrain generate``); it stops the run there unless the
    workflow is ``generate`` with ``--output`` (which writes what was generated)."""
    from posttrain import generate as gen

    seen = Seen(cfg)
    real = gen.generate

    def generate(model, prompts, sampling, **kwargs):
        seen.calls.append((model, prompts, sampling, kwargs))
        if workflow == "generate" and cfg.output:
            return real(model, prompts, sampling, **kwargs)
        raise Stop

    monkeypatch.setattr(gen, "generate", generate)
    if workflow == "sft":  # posttrain sft picks the vision run by --vision
        from posttrain.sft.run import run_sft
        from posttrain.vision.run import run_vision

        run = run_vision if cfg.vision else run_sft
        return _stopped(lambda: run(cfg, on_built=_stop_trainer(seen)), seen)
    if workflow in ("dpo", "orpo"):
        from posttrain.preference.run import run_dpo

        return _stopped(lambda: run_dpo(cfg, on_built=_stop_trainer(seen)), seen)
    if workflow == "distill":
        from posttrain.distill import trainer as distill_trainer
        from posttrain.distill.run import run_distill

        # the held-out KL before training is a measurement, not a landing: 0 here
        monkeypatch.setattr(distill_trainer, "held_out_kl", lambda *a, **k: 0.0)
        return _stopped(lambda: run_distill(cfg, on_built=_stop_trainer(seen)), seen)
    if workflow == "grpo":
        from posttrain.rl.run import run_grpo

        def on_built(learner, policies):
            def train(data, *args, **kwargs):
                seen.learner, seen.policies, seen.batch = learner, policies, next(iter(data))
                raise Stop

            learner.train = train

        return _stopped(lambda: run_grpo(cfg, on_built=on_built), seen)
    if workflow == "generate":
        from posttrain.commands.generate import generate as command

        def start():
            cfg.check()
            command(cfg)
            if cfg.output:
                raise Stop

        return _stopped(start, seen)
    raise AssertionError(f"unknown workflow {workflow!r}")


def rates(tx, steps: int, micro: int = 1) -> list[float]:
    """The learning rate the optax transformation ``tx`` applies at each optimizer step
    ``0..steps`` (each ``micro`` updates, the last of which applies the step): its
    update of a one-element parameter under a constant unit gradient (Adam's normalised
    step is then the rate itself, whatever norm the gradient is clipped to).

    Evaluated on the host's CPU backend: the rows check which rate lands, and on a TPU
    v5e optax's own float32 arithmetic (Adam's bias correction ``1 - b1**t``) is off by
    ~1e-5 relative, more than the 1e-6 these rows hold the rate to."""
    import jax
    import jax.numpy as jnp

    with jax.default_device(jax.devices("cpu")[0]):
        params = {"w": jnp.ones((1,))}
        grads = {"w": jnp.ones((1,))}
        state = tx.init(params)
        out = []
        for _ in range(steps + 1):
            for _ in range(micro):
                update, state = tx.update(grads, state, params)
            out.append(-float(update["w"][0]))
    return out


#: the global norms of :func:`check_clipping`'s gradients, in units of the clipping norm:
#: on both sides of it, so that clipping at any other norm (or none) changes their ratios
CLIP_NORMS = (0.1, 10.0, 0.5, 4.0, 0.2)


def check_clipping(tx, max_grad_norm: float, micro: int = 1) -> None:
    """Asserts that the optax transformation ``tx`` clips each step's gradient to the
    global norm ``max_grad_norm`` (``0``: not at all) before its scale-free update (Adam's:
    one scale of every gradient leaves its updates).

    The gradients (a two-element parameter, one direction, the norms
    :data:`CLIP_NORMS` x ``max_grad_norm``; each fed ``micro`` times per step) must give
    the updates of the same gradients clipped here by hand and then shrunk under any
    norm ``tx`` might clip at: a clip at another norm, or none, changes the ratios of the
    steps' gradients, and so Adam's updates."""
    import jax.numpy as jnp

    unit = max_grad_norm or 1.0
    direction = jnp.asarray([0.6, -0.8])  # norm 1
    norms = [n * unit for n in CLIP_NORMS]
    by_hand = [min(n, max_grad_norm) if max_grad_norm else n for n in norms]
    shrink = 1e-2 * unit / max(by_hand)  # every norm under 1% of the clipping one

    def updates(step_norms):
        params = {"w": jnp.zeros((2,))}
        state, out = tx.init(params), []
        for n in step_norms:
            for _ in range(micro):
                update, state = tx.update({"w": n * direction}, state, params)
            out.append(np.asarray(update["w"], np.float64))
        return np.stack(out)

    got, want = updates(norms), updates([n * shrink for n in by_hand])
    scale = float(np.abs(want).max())
    assert scale > 0, "no update at any step"
    worst = float(np.abs(got - want).max())
    assert np.allclose(got, want, rtol=1e-3, atol=1e-3 * scale), (
        f"the updates are not those of a clip at {max_grad_norm} (off by {worst:.3g} of "
        f"at most {scale:.3g})"
    )


def shifted_byte_tokenizer(path: pathlib.Path) -> str:
    """The embedded byte tokenizer with its special tokens first (ids 0-7) and the bytes
    after them (8-263): the same text, other ids. Returns the saved file's path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from posttrain.tokenizer import SPECIAL_TOKENS, byte_tokenizer

    byte_ids = byte_tokenizer().get_vocab(with_added_tokens=False)
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({symbol: len(SPECIAL_TOKENS) + i for symbol, i in byte_ids.items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(path))
    return str(path)


#: a word only the written data holds (the landing of ``--data``)
MARKER = "zanzibar"


def files(tmp: pathlib.Path) -> dict[str, str]:
    """Inputs an option names: chat and preference JSONL files holding :data:`MARKER`
    (``long`` has one conversation over 64 tokens), a tokenizer with other ids, a chat
    template of another layout (``user: ...``), a prompts file."""
    tmp.mkdir(parents=True, exist_ok=True)
    turn = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": MARKER}]
    long = [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "y"}]
    chat, longer = tmp / "chat.jsonl", tmp / "long.jsonl"
    chat.write_text("".join(json.dumps({"messages": turn}) + "\n" for _ in range(32)))
    longer.write_text(json.dumps({"messages": long}) + "\n" + chat.read_text())
    pair = {"prompt": "2+2?", "chosen": MARKER, "rejected": "5"}
    pairs, held = tmp / "pairs.jsonl", tmp / "held.jsonl"
    pairs.write_text("".join(json.dumps(pair) + "\n" for _ in range(32)))
    held.write_text("".join(json.dumps(pair) + "\n" for _ in range(24)))
    template = tmp / "chat_template.jinja"
    template.write_text(
        "{% for m in messages %}{{ m.role + ': ' }}{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}"
        "{% else %}{{ m.content + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    vision, images = _vision_files(tmp)
    prompts = tmp / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": MARKER}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    return {
        "chat": str(chat),
        "long": str(longer),
        "pairs": str(pairs),
        "held": str(held),
        "tokenizer": shifted_byte_tokenizer(tmp / "tokenizer.json"),
        "template": str(template),
        "prompts": str(prompts),
        "out": str(tmp / "generated.jsonl"),
        "vision": vision,
        "images": images,
        "adapter": _adapter(tmp / "adapter"),
        "picture": str(pathlib.Path(images) / "pictures" / "a.png"),
    }


def _adapter(where: pathlib.Path) -> str:
    """A rank-2 LoRA adapter directory of ``llama3-tiny`` (``posttrain generate
    --adapter``)."""
    from posttrain.lora import LoraConfig, apply_lora
    from posttrain.lora.adapters import save_adapter
    from posttrain.models import build_model, get_config
    from posttrain.sharding import make_mesh

    if not where.exists():
        mesh = make_mesh(None)
        model = apply_lora(
            build_model(get_config("llama3-tiny"), mesh), mesh, LoraConfig(rank=2, alpha=4.0)
        )
        save_adapter(model, where)
    return str(where)


def _vision_files(tmp: pathlib.Path) -> tuple[str, str]:
    """``(a vision chat JSONL in TRL's format, the directory holding it and its images)``:
    16 conversations about two 16 x 16 images that lie beside the data's directory, not
    in it (read only under ``--image-root``)."""
    from PIL import Image

    root = tmp / "vision"
    (root / "data").mkdir(parents=True, exist_ok=True)
    (root / "pictures").mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png"):
        pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / "pictures" / name)
    user = [{"type": "image"}, {"type": "text", "text": "what?"}]
    records = [
        {
            "messages": [
                {"role": "user", "content": user},
                {"role": "assistant", "content": [{"type": "text", "text": MARKER}]},
            ],
            "images": [f"../pictures/{'ab'[i % 2]}.png"],
        }
        for i in range(16)
    ]
    data = root / "data" / "vision.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(data), str(root)


def resolve(overrides: dict, where: dict[str, str], output: pathlib.Path) -> dict:
    """``overrides`` with each ``"{name}"`` replaced by ``where[name]`` and ``"{run}"``
    by ``output``."""

    def one(value):
        if isinstance(value, str) and value.startswith("{") and value.endswith("}"):
            name = value[1:-1]
            return str(output) if name == "run" else where[name]
        return value

    return {k: one(v) for k, v in overrides.items()}


def decoded(tok, rows) -> str:
    """The text of token rows (special tokens kept)."""
    return "\n".join(tok.decode([int(t) for t in row], skip_special_tokens=False) for row in rows)


def leaf_sharding_mesh(model) -> dict[str, int]:
    """The mesh axis sizes the model's first parameter is placed on."""
    import jax
    from flax import nnx

    leaf = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
    return dict(leaf.sharding.mesh.shape)


def host(value) -> np.ndarray:
    return np.asarray(value)


def _equations(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs its equations hold (scan, remat,
    custom_vjp bodies)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _equations(inner)


def forward_primitives(model, seq: int = 128) -> set[str]:
    """The primitives of ``model``'s forward over one row of ``seq`` tokens (traced, not
    run): ``pallas_call`` where its attention dispatches to splash."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    tokens = jnp.zeros((1, seq), jnp.int32)
    positions = jnp.arange(seq)[None]
    # the model rebuilt inside the trace: a distill student's taps sow into their modules,
    # which NNX refuses from a trace other than the module's own
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t, positions))(state, tokens)
    return {str(e.primitive) for e in _equations(jaxpr.jaxpr)}
