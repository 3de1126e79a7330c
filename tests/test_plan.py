"""``posttrain plan``: the topology table, the roofline and verdict logic, the options, and
one real deviceless compile of the trainer's step for a TPU slice (libtpu, the tpu extra).

The full-size seed configurations are in ``tests/test_plan_seeds.py`` (slow tier).
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from posttrain.plan import report, topology
from posttrain.plan.options import PlanOptions

pytestmark = pytest.mark.host  # host code only: left out of the TPU/GPU tier

# Compiled argument bytes against the analytic bytes of the arguments' shardings: XLA adds
# no padding to these (bf16 / f32 / int32 arrays whose shards divide evenly), so 1% is room
# for nothing but a wrong count.
ARGUMENT_BYTES_RTOL = 0.01


def _figures(**changes) -> report.Figures:
    base = dict(
        arguments=10 * topology.GIB,
        outputs=3 * topology.GIB,
        aliased=2 * topology.GIB,
        temporaries=5 * topology.GIB,
        code=1 << 20,
        kinds={"parameters": 8 * topology.GIB},
        flops=4.59e12,
        bytes_accessed=2765e9 / 100,
        model_flops=4.59e12 * 4,
        compile_seconds=1.0,
    )
    return report.Figures(**{**base, **changes})


# --- the table ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n, t in topology.TOPOLOGIES.items() if t.libtpu_name])
def test_tpu_names_count_their_chips(name):
    """v5p-N and v4-N name TensorCores (two per chip), v5e-N and v6e-N chips; each libtpu
    shape holds the row's chips."""
    topo = topology.TOPOLOGIES[name]
    generation, count = name.split("-")
    per_chip = 2 if generation in ("v4", "v5p") else 1
    assert topo.chips * per_chip == int(count)
    assert math.prod(int(d) for d in topo.libtpu_name.split(":")[1].split("x")) == topo.chips
    assert topo.libtpu_name.startswith(generation + ":")
    assert topo.chip.name == generation and generation in topo.chip.source


def test_a_topology_whose_shape_disagrees_with_its_chips_is_refused():
    with pytest.raises(ValueError, match="holds 8 chips, not 4"):
        topology.Topology(name="x", chip=topology.CHIPS["v5p"], chips=4, libtpu_name="v5p:2x2x2")


def test_unknown_topology_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown topology 'v5p-7'.*v5p-8"):
        topology.get("v5p-7")


def test_a_gpu_topology_is_refused_for_deviceless_compiles():
    with pytest.raises(NotImplementedError, match="h200.*TPUs only"):
        topology.devices(topology.get("h200"))


@pytest.mark.aot
@pytest.mark.parametrize("name", ["v5p-32", "v5e-1", "v4-8", "v6e-16"])
def test_libtpu_gives_each_slice_its_chips_with_jax_on_cpu(name):
    """The devices come from libtpu while JAX's own backend stays the CPU."""
    import jax

    found = topology.devices(topology.get(name))
    assert len(found) == topology.get(name).chips
    assert {d.platform for d in found} == {"tpu"}
    assert jax.default_backend() == "cpu"


# --- roofline and verdict --------------------------------------------------------------------


def test_roofline_floor_is_the_slower_of_compute_and_memory():
    v5p = topology.get("v5p-8")
    assert report.roofline(459e12, 2765e9 / 2, v5p) == pytest.approx((1.0, "compute"))
    assert report.roofline(459e12 / 4, 2765e9, v5p) == pytest.approx((1.0, "memory"))
    assert report.roofline(0.0, 0.0, v5p) == (0.0, "compute")  # nothing to do is allowed
    for flops, moved in ((-1.0, 0.0), (0.0, -1.0)):
        with pytest.raises(ValueError, match="must be >= 0"):
            report.roofline(flops, moved, v5p)


def test_a_program_exactly_the_size_of_hbm_fits_and_an_empty_one_has_no_mfu():
    v5p = topology.get("v5p-8")
    exact = report.judge(_figures(temporaries=84 * topology.GIB), v5p)  # 10 + 3 - 2 + 84
    assert exact.fits and exact.headroom == 0
    empty = report.judge(_figures(flops=0.0, bytes_accessed=0.0, model_flops=0.0), v5p)
    assert empty.mfu == 0.0
    # nothing computed, but the state is still read and written once: 10 + 3 GiB; no
    # estimate is under the floor
    assert empty.floor_seconds == pytest.approx(13 * topology.GIB / 2765e9)
    assert empty.estimate_seconds == empty.floor_seconds


@pytest.mark.parametrize("live", [1, 7 * topology.GIB], ids=["one-byte", "7GiB"])
def test_the_peak_is_the_live_peak_plus_what_is_held_outside_else_the_sum(live):
    """With a live peak (XLA's ``peak_memory_in_bytes``, any positive size) the peak is it
    plus ``resident``, whatever the temporaries; without one (0, a record from before it
    was kept), arguments + outputs - aliased + temporaries + resident."""
    held = 3 * topology.GIB
    assert _figures(live_peak=live, resident=held).peak == live + held
    assert _figures(live_peak=live, temporaries=50 * topology.GIB).peak == live
    assert _figures(resident=held).peak == (16 + 3) * topology.GIB  # 10 + 3 - 2 + 5 + 3


def test_verdict_headroom_and_mfu():
    v5p = topology.get("v5p-8")  # 4 chips, 95 GiB each
    figures = _figures()
    verdict = report.judge(figures, v5p)
    assert figures.peak == 16 * topology.GIB  # 10 + 3 - 2 + 5
    assert verdict.fits and verdict.headroom == (95 - 16) * topology.GIB
    assert verdict.bound == "compute" and verdict.floor_seconds == pytest.approx(0.01)
    # v5p is uncalibrated (flop_efficiency and hbm_share 1): the compiled costs' roofline
    assert verdict.estimate_seconds == pytest.approx(0.01)
    # model FLOPs / (estimate x peak x chips) = 4 x 4.59e12 / (0.01 x 459e12 x 4)
    assert verdict.mfu == pytest.approx(1.0)
    over = report.judge(_figures(temporaries=85 * topology.GIB), v5p)
    assert not over.fits and over.headroom == -topology.GIB


def test_a_calibrated_chip_runs_model_flops_at_its_efficiency_and_bytes_at_its_share():
    """v5e (measured: the model's FLOPs, attention's included, at 0.395 of 197e12; 0.64 of
    the accessed bytes at 819e9 B/s): the estimate is the larger term, named by ``bound``,
    and never under the floor, which keeps every compiled FLOP at peak; the MFU is model
    FLOPs over the estimate at peak. The compiled FLOPs (a remat's recomputed forward
    among them) set only the floor."""
    v5e = topology.get("v5e-1")
    second = 197e12 * 0.395  # model FLOPs the v5e runs in a second
    compute = report.judge(_figures(flops=1e12, bytes_accessed=819e9, model_flops=second), v5e)
    assert compute.bound == "compute" and compute.estimate_seconds == pytest.approx(1.0)
    assert compute.floor_seconds == pytest.approx(13 * topology.GIB / 819e9)  # the state
    assert compute.mfu == pytest.approx(0.395)
    halves = _figures(
        flops=1e12, bytes_accessed=819e9, model_flops=second / 2, attention_flops=second / 2
    )
    split = report.judge(halves, v5e)  # attention's FLOPs take their time, not the MFU's
    assert split.estimate_seconds == pytest.approx(1.0) and split.mfu == pytest.approx(0.1975)
    recomputed = report.judge(
        _figures(flops=197e12 * 0.9, bytes_accessed=819e9, model_flops=second), v5e
    )
    assert recomputed.estimate_seconds == pytest.approx(1.0)  # 0.9 s of FLOPs at peak
    floored = report.judge(
        _figures(flops=197e12 * 2, bytes_accessed=819e9, model_flops=second), v5e
    )
    assert floored.estimate_seconds == pytest.approx(2.0) == floored.floor_seconds
    memory = report.judge(_figures(flops=1e12, bytes_accessed=819e9 * 2, model_flops=1e12), v5e)
    assert memory.bound == "memory" and memory.estimate_seconds == pytest.approx(1.28)
    assert report.judge(_figures(flops=0, bytes_accessed=0, model_flops=0), v5e).mfu == 0.0
    # at any scale: 0.3 FLOPs and no bytes (an estimate far under a second's FLOPs)
    stateless = dict(arguments=0, outputs=0, bytes_accessed=0)
    tiny = report.judge(_figures(flops=0.3, model_flops=0.3, **stateless), v5e)
    assert tiny.mfu == pytest.approx(0.395) and tiny.bound == "compute"
    nothing = report.judge(_figures(flops=0, model_flops=0, **stateless), v5e)
    assert nothing.estimate_seconds == 0.0 and nothing.mfu == 0.0  # no division by zero
    with pytest.raises(ValueError, match="must be >= 0"):  # the roofline's own refusal
        report.judge(_figures(flops=-1.0), v5e)
    assert "model FLOPs at 0.395 of peak, measured on a v5e" in report.calibration(v5e)
    assert (
        report.calibration(topology.get("v5p-8")) == "uncalibrated: no chip of this kind measured"
    )


def test_attention_flops_count_each_layers_keys_forward_and_backward():
    """PaLM's ``12 L H Q T`` a token for a train step (``4`` forward), ``T`` the keys a
    query attends: all of a full layer's, at most the window of a sliding one."""
    from posttrain.models.presets import get_config
    from posttrain.plan.abstract import attention_flops

    qwen = get_config("qwen3-0.6b")  # 28 full layers, 16 heads of 128
    assert attention_flops(qwen, 8, 1024, backward=True) == 12 * 28 * 16 * 128 * 1024 * 8 * 1024
    assert attention_flops(qwen, 2, 512, backward=False) == 4 * 28 * 16 * 128 * 512 * 2 * 512
    gpt = get_config("gpt_oss-tiny")  # a sliding layer (window 8) and a full one
    sliding, full = (gpt.attention[t] for t in ("sliding", "full"))
    assert sliding.sliding_window == 8
    per_key = 4 * sliding.num_heads * sliding.head_dim  # both types have the same heads here
    assert per_key == 4 * full.num_heads * full.head_dim
    assert attention_flops(gpt, 3, 32, backward=False) == per_key * (8 + 32) * 3 * 32
    assert attention_flops(gpt, 3, 5, backward=False) == per_key * (5 + 5) * 3 * 5
    assert attention_flops(qwen, 1, 1, backward=False) == 4 * 28 * 16 * 128  # the edge: one token
    with pytest.raises(ValueError, match="rows=0 and seq=16 must be >= 1"):
        attention_flops(qwen, 0, 16, backward=True)
    with pytest.raises(ValueError, match="rows=1 and seq=0 must be >= 1"):
        attention_flops(qwen, 1, 0, backward=True)


@pytest.mark.parametrize("efficiency", [0.0, -0.1, 1.01])
def test_a_chip_refuses_an_efficiency_outside_0_to_1(efficiency):
    with pytest.raises(ValueError, match=rf"v5e: flop_efficiency={efficiency} must be in \(0, 1\]"):
        dataclasses.replace(topology.CHIPS["v5e"], flop_efficiency=efficiency)
    for field in ("hbm_bytes", "peak_flops", "hbm_bandwidth", "hbm_share"):
        with pytest.raises(ValueError, match=f"v5e: {field}=0 must be > 0"):
            dataclasses.replace(topology.CHIPS["v5e"], **{field: 0})


def test_overflow_line_names_the_overflow_and_the_knobs():
    line = report.overflow_line(96 * topology.GIB, topology.get("v5p-8"), "llama sft")
    assert line.startswith("llama sft does not fit v5p-8: 96.00 GiB per device, 1.00 GiB over ")
    assert "the chip's 95.00 GiB HBM" in line
    assert "--remat full" in line and "fsdp" in line and "--per-device-batch-size" in line
    assert "\n" not in line


def test_json_record_round_trips(tmp_path):
    v5p = topology.get("v5p-8")
    figures = _figures()
    path = tmp_path / "plan.json"
    report.write_json(path, [report.record("x", v5p, figures, report.judge(figures, v5p))])
    (rec,) = json.loads(path.read_text())
    assert rec["peak_bytes"] == figures.peak and rec["hbm_bytes"] == 95 * topology.GIB
    assert rec["fits"] is True and rec["kinds"] == {"parameters": 8 * topology.GIB}


# --- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"workflow": "ppo"}, "workflow='ppo' must be one of sft, dpo, grpo, generate"),
        ({"remat": "some"}, "remat='some' must be one of none, full, save_dots"),
        (
            {"attention_kernel": "splash_interpret"},
            "attention_kernel='splash_interpret' must be one of xla, splash",
        ),
        ({"seq": 0}, "seq=0 must be >= 1"),
        ({"qlora": "int8"}, "qlora='int8' needs lora_rank >= 1"),
        ({"qlora": "int3", "lora_rank": 4}, "qlora='int3' must be one of"),
        ({"lora_rank": -1}, "lora_rank=-1 must be >= 0"),
        ({"workflow": "generate", "lora_rank": 4}, "generate plans the base model"),
    ],
    ids=[
        "workflow",
        "remat",
        "kernel",
        "seq",
        "qlora-no-rank",
        "qlora-type",
        "rank",
        "generate-lora",
    ],
)
def test_bad_options_are_refused_naming_the_value(changes, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        PlanOptions(model="qwen3-0.6b", topology="v5p-8", **changes).check()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"workflow": "dpo", "extrapolate": True}, "workflow='dpo' plans one micro-step"),
        ({"workflow": "grpo", "grad_accum": 2}, "workflow='grpo' plans one micro-step"),
        ({"rollout_mesh": {"fsdp": 4}}, "rollout_mesh is GRPO's; workflow='sft'"),
        ({"workflow": "dpo", "num_iterations": 2}, "num_iterations is GRPO's; workflow='dpo'"),
        ({"workflow": "grpo", "num_iterations": 0}, "num_iterations=0 must be >= 1"),
    ],
    ids=[
        "dpo-extrapolate",
        "grpo-grad-accum",
        "sft-rollout-mesh",
        "dpo-iterations",
        "grpo-no-iterations",
    ],
)
def test_workflow_options_are_refused_naming_the_value(changes, message):
    with pytest.raises(ValueError, match=message):
        PlanOptions(model="qwen3-0.6b", topology="v5p-8", **changes).check()


@pytest.fixture
def no_compile(monkeypatch):
    """``posttrain plan`` with its programs never built: a refusal must come before."""
    from posttrain.plan import compile as plan_compile

    def build_programs(*args, **kwargs):
        raise AssertionError("the programs were built: the refusal came too late")

    monkeypatch.setattr(plan_compile, "build_programs", build_programs)


def _plan_cli(capsys, *flags: str, model: str = "qwen3-0.6b", topo: str = "v5p-8"):
    """``posttrain plan`` with ``flags``: ``(exit status, stderr lines)``."""
    from posttrain import cli

    status = cli.main(["plan", "--model", model, "--topology", topo, *flags])
    return status, capsys.readouterr().err.strip().splitlines()


INT32 = 2**31 - 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--workflow", "dpo", "--extrapolate"], "workflow='dpo' plans one micro-step"),
        (["--mesh", "fsdp=four"], "fsdp=four"),
        (["--json", "/nonexistent/plan.json"], "--json '/nonexistent/plan.json': directory"),
        (["--mesh", ""], "--mesh '': names no axis; expected axis=INT entries"),
        (["--rollout-mesh", "", "--workflow", "grpo"], "--rollout-mesh '': names no axis"),
        (["--json", ""], "--json '': expected a file path"),
        (["--mesh", "fsdp=2,fsdp=2"], "mesh axis 'fsdp' is given twice (fsdp=2, fsdp=2)"),
        (["--mesh", "fsdp=-4"], "mesh axis fsdp=-4: expected a size >= 1"),
        (["--mesh", "fsdp=0,tensor=4"], "mesh axis fsdp=0: expected a size >= 1"),
        (["--seq", "1000000000000"], f"seq=1000000000000 (--seq): expected at most {INT32}"),
        (["--batch", str(2**40)], f"batch=1099511627776 (--batch): expected at most {INT32}"),
        (
            ["--workflow", "generate", "--seq", str(INT32 - 10), "--new-tokens", "100"],
            f"tokens per row: seq={INT32 - 10} + new_tokens=100 = 2147483737; expected at most",
        ),
        (["--seq", "2000000000"], "seq=2000000000 (--seq): the attention scores"),
        (["--batch", "2000000000", "--seq", "2000000"], "the logits [batch=2000000000, "),
        (
            ["--profile", "prof"],
            "profile_dir='prof' traces the steps after the first: it needs run_steps >= 2, got 0",
        ),
        (["--profile", "prof", "--run-steps", "1"], "needs run_steps >= 2, got 1"),
        (
            ["--probe-headroom"],
            "probe_headroom runs the step beside ballast: it needs run_steps >= 1, got 0",
        ),
    ],
    ids=[
        "dpo-extrapolate",
        "mesh",
        "json-directory",
        "mesh-empty",
        "rollout-mesh-empty",
        "json-empty",
        "mesh-twice",
        "mesh-negative",
        "mesh-zero",
        "seq-int32",
        "batch-int32",
        "tokens-per-row",
        "scores-bytes",
        "logits-bytes",
        "profile-no-run",
        "profile-one-step",
        "probe-no-run",
    ],
)
def test_cli_refuses_bad_input_with_one_line_before_compiling(flags, message, capsys, no_compile):
    """``posttrain plan`` is a COMMANDS row: its options' errors are one line, exit 2,
    before any program is built (#56 7-9: sizes past what int32 indices and XLA's int64
    byte counts hold; an empty, repeated or negative mesh; an empty --json)."""
    status, err = _plan_cli(capsys, *flags)
    assert status == 2 and len(err) == 1 and err[0].startswith("posttrain: error: "), err
    assert message in err[0], err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda text: text[: len(text) // 2], "config.json: not valid JSON"),
        (
            lambda text: text.replace('"vocab_size": 151936', '"vocab_size": 1000000000000'),
            f"vocab_size=1000000000000: expected at most {INT32}",
        ),
        (
            lambda text: text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": NaN'),
            "norm_eps=nan: expected a finite number > 0",
        ),
        (
            lambda text: text.replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 0'),
            "norm_eps=0: expected a finite number > 0",
        ),
    ],
    ids=["truncated", "vocab-1e12", "eps-nan", "eps-zero"],
)
def test_cli_refuses_a_bad_config_json_naming_it(tmp_path, capsys, no_compile, change, message):
    """A truncated ``config.json`` is named; a vocabulary past int32 token ids and a NaN
    or zero ``rms_norm_eps`` are refused with their value (#56 7-9)."""
    from posttrain.conversion import to_hf_config
    from posttrain.models import get_config

    text = json.dumps(to_hf_config(get_config("qwen3-0.6b")))
    (tmp_path / "config.json").write_text(change(text))
    status, err = _plan_cli(capsys, model=str(tmp_path))
    assert status == 2 and len(err) == 1 and err[0].startswith("posttrain: error: "), err
    assert message in err[0], err
    if "JSON" in message:
        assert str(tmp_path / "config.json") in err[0], err


@pytest.mark.parametrize("where", ["directory", "kernel-fs", "under-a-file"])
def test_cli_refuses_a_json_path_it_cannot_write_before_compiling(
    tmp_path, capsys, no_compile, where
):
    """``--json`` is checked as a file it can write before the compile (it failed after
    80 s, naming a temporary file; #56 10). (An unwritable directory is the same check,
    ``os.access``, which root passes.)"""
    (tmp_path / "file").write_text("")
    path = {
        "directory": tmp_path,
        "kernel-fs": "/proc/plan.json",
        "under-a-file": tmp_path / "file" / "plan.json",
    }[where]
    status, err = _plan_cli(capsys, "--json", str(path))
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"posttrain: error: --json '{path}"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_workflow_fits_only_when_each_program_does():
    """DPO / GRPO run several programs per step: the tightest one sets the headroom and
    the verdict, the floors add up, and so do the model FLOPs."""
    v5p = topology.get("v5p-8")  # 4 chips, 95 GiB each
    train = _figures()  # peak 16 GiB, floor 10 ms, compute-bound
    # peak 96 GiB, floor 30 ms reading 3% of a second's HBM bandwidth, memory-bound
    rollout = _figures(temporaries=85 * topology.GIB, model_flops=0.0, bytes_accessed=2765e9 * 0.03)
    verdict = report.judge_stages({"rollout": rollout, "train step": train}, v5p)
    assert not verdict.fits and verdict.stage == "rollout"
    assert verdict.headroom == -topology.GIB
    assert verdict.estimate_seconds == pytest.approx(0.04) and verdict.bound == "memory"
    assert verdict.mfu == pytest.approx(0.25)  # the train step's FLOPs over both estimates
    # floors: each 10 ms of FLOPs at peak (more than its 13 GiB of state at 2765 GB/s)
    assert verdict.floor_seconds == pytest.approx(0.02)
    swapped = report.judge_stages({"rollout": train, "train step": rollout}, v5p)
    assert swapped.stage == "train step"  # the tightest, whatever the names' order
    idle = _figures(flops=0.0, bytes_accessed=0.0, model_flops=0.0)
    nothing = report.judge_stages({"a": idle, "b": idle}, v5p)
    assert nothing.mfu == 0.0 and nothing.fits
    assert nothing.estimate_seconds == pytest.approx(2 * 13 * topology.GIB / 2765e9)  # floors
    alone = report.judge_stages({"train step": train}, v5p)
    assert alone == report.judge(train, v5p)  # one program: the single-program verdict
    held = _figures(resident=80 * topology.GIB)  # another model held beside it
    assert held.peak == 96 * topology.GIB and not report.judge(held, v5p).fits
    with pytest.raises(ValueError, match="at least one program"):
        report.judge_stages({}, v5p)


# --- one real compile --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_plan():
    """qwen3-0.6b LoRA SFT, one layer, on a v5p-8, compiled through libtpu. 64-token rows:
    libtpu's compile is not cached and took 17 s of CPU at 256 (11 s at 64); the figures
    checked hold at any length (the vocabulary's embedding is most of the bytes)."""
    from posttrain.plan import plan

    return plan(
        PlanOptions(
            model="qwen3-0.6b", topology="v5p-8", lora_rank=8, num_layers=1, seq=64, batch=4
        )
    )


@pytest.mark.aot
def test_small_lora_sft_step_compiles_for_a_v5p_8_and_fits(small_plan):
    """The trainer's own step compiles for 4 v5p chips; the compiled argument bytes are
    the parameters, optimizer state and batch the shardings say (within 1%), and the
    peak is the compiler's arguments + outputs - aliased + temporaries."""
    figures, verdict = small_plan.figures, small_plan.verdict
    kinds = figures.kinds
    analytic = kinds["parameters"] + kinds["optimizer state"] + kinds["inputs"]
    assert figures.arguments == pytest.approx(analytic, rel=ARGUMENT_BYTES_RTOL)
    # LoRA: the adapters are what is trained, a small fraction of the parameters
    assert 0 < kinds["gradients"] < kinds["parameters"] / 20
    assert verdict.fits and verdict.headroom == topology.get("v5p-8").hbm_bytes - figures.peak
    assert figures.flops > 0 and figures.bytes_accessed > 0 and 0 < verdict.mfu <= 1
    assert "mesh fsdp=4" in small_plan.what and "lora r8" in small_plan.what


@pytest.mark.aot
def test_the_record_carries_the_options_and_the_figures(small_plan):
    rec = small_plan.record()
    assert rec["options"] == dataclasses.asdict(small_plan.options)
    assert rec["arguments"] == small_plan.figures.arguments and rec["chips"] == 4
    # attention's FLOPs reach the record: 1 layer, 16 heads of 128, 4 rows x 64 tokens,
    # 64 keys each, 4 FLOPs a (key, head dim) pair forward and 8 backward
    assert rec["attention_flops"] == 12 * 16 * 128 * 64 * (4 * 64)
    assert "peak per device" in small_plan.table()


@pytest.mark.slow  # 7 s; tests/test_plan_seeds.py orders the three policies on qwen3-0.6b
@pytest.mark.aot
def test_remat_full_compiles_fewer_temporaries_than_none():
    """The decoder's remat policy reaches the compiled step: full keeps only each layer's
    input for the backward pass, none every activation (qwen3-tiny, two scanned layers,
    8 x 128 tokens: 7.9 MiB against 16.6 MiB; save_dots between, 8.6 MiB, is the slow
    tier's qwen3-0.6b ordering). Two layers, not one: a scan of one iteration is
    simplified away and the policies compile alike (7.8 / 7.6 / 7.5 MiB)."""
    from posttrain.plan.compile import compile_stages

    options = PlanOptions(model="qwen3-tiny", topology="v5p-8", num_layers=2, batch=8, seq=128)
    temps = {
        remat: compile_stages(dataclasses.replace(options, remat=remat))[1][
            "train step"
        ].temporaries
        for remat in ("full", "none")
    }
    assert temps["full"] < temps["none"] / 1.5, temps


@pytest.mark.slow  # 18 s on a loaded 2-core host; the gate keeps one real compile
@pytest.mark.aot
def test_a_splash_plan_compiles_the_mosaic_kernel_for_a_v5e_deviceless():
    """``posttrain plan --attention-kernel splash``: the abstract model is built for the
    slice's TPUs (this process's backend is the CPU, which :func:`posttrain.layers.splash.
    check_backend` would refuse), the train step lowers to Mosaic's ``tpu_custom_call``
    (the Pallas kernel, 512-blocks at 2048 tokens) and libtpu compiles it for a v5e."""
    from posttrain import sharding
    from posttrain.plan import plan
    from posttrain.plan.compile import build_programs

    options = PlanOptions(
        model="qwen3-tiny",
        topology="v5e-1",
        attention_kernel="splash",
        num_layers=2,  # scanned: the costs come from unscanned 1 and 2 layers (depth.py)
        batch=1,
        seq=2048,
    )
    _, programs, mesh = build_programs(options, topology.get("v5e-1"))
    step = programs["train step"]
    with sharding.use_mesh(mesh, jax_context=False):
        text = step.jitted.lower(*step.args, **step.kwargs).as_text()
    assert "tpu_custom_call" in text  # forward, dq, dkv (under remat, the forward again)
    result = plan(options)
    assert "remat full, splash attention" in result.what, result.what
    assert result.verdict.fits and result.figures.flops > step.uncounted[0] > 0
    assert result.figures.cost_source == (
        "unscanned 1 and 2 layers, extrapolated to 2, the loss's chunks after the first "
        "analytic, splash's kernels analytic"
    )
    assert result.record()["options"]["attention_kernel"] == "splash"


# --- DPO and GRPO: the programs of one step ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dpo():
    """qwen3-tiny LoRA DPO, one layer, 4 pairs of 32 + 16 tokens, on a v5p-8."""
    from posttrain.plan import plan

    return plan(
        PlanOptions(
            model="qwen3-tiny",
            topology="v5p-8",
            workflow="dpo",
            lora_rank=4,
            num_layers=1,
            batch=4,
            seq=32,
            new_tokens=16,
        )
    )


@pytest.mark.slow  # 6 s; the gate compiles SFT's and GRPO's programs
@pytest.mark.aot
def test_dpo_compiles_the_reference_forward_and_the_step_on_chosen_and_rejected(tiny_dpo):
    """Tunix's DPO step sees the chosen and rejected rows stacked: 2 x 4 rows of 32 + 16
    tokens, their [rows, T, T] mask and the reference's log-probabilities; the reference
    forward runs on the same rows. The reference (LoRA: its zeroed lora_b) stays on the
    device while the policy trains, and the policy's optimizer state while the reference
    runs."""
    step, forward = tiny_dpo.stages["train step"], tiny_dpo.stages["reference forward"]
    rows, t, dp = 8, 48, 4
    int32, f32, mask = 4, 4, 1
    # tokens and positions, the causal x real mask, the completion mask, the two ref logps
    batch = 2 * rows * t * int32 + rows * t * t * mask + rows * 16 * int32 + 2 * 4 * f32
    assert step.kinds["inputs"] == batch // dp
    assert step.arguments >= step.kinds["parameters"] + step.kinds["optimizer state"]
    assert 0 < step.resident < step.kinds["parameters"] / 4  # the zeroed lora_b only
    held = step.kinds["parameters"] + step.kinds["optimizer state"] + step.resident
    assert forward.resident == held - forward.kinds["parameters"]
    assert forward.model_flops == pytest.approx(step.model_flops / 2)  # 2 N vs 4 N (LoRA)
    verdict = tiny_dpo.verdict
    assert verdict.fits and verdict.stage == "train step" and step.peak > forward.peak
    assert tiny_dpo.figures is step and "8 pairs" not in tiny_dpo.what
    assert "4 pairs x 32 prompt + 16 response" in tiny_dpo.what


@pytest.mark.aot
@pytest.mark.slow  # the gate keeps one real compile (the small LoRA SFT step); tox -e aot runs it
def test_grpo_plan_from_the_cli_compiles_rollout_reference_old_policy_and_step(tmp_path, capsys):
    """``posttrain plan --workflow grpo --num-iterations 2``: the rollout (prefill +
    decode with the KV cache), the reference forward, the old-policy forward Tunix runs
    when num_iterations > 1 and the actor's train step, one column each, and a JSON record
    holding every program's figures."""
    from posttrain import cli

    path = tmp_path / "grpo.json"
    argv = ["plan", "--model", "qwen3-tiny", "--topology", "v5p-8", "--workflow", "grpo"]
    argv += ["--lora-rank", "4", "--num-layers", "1", "--batch", "8", "--seq", "32"]
    argv += ["--new-tokens", "16", "--num-iterations", "2", "--json", str(path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "rollout | reference forward | old-policy forward | train step" in out
    assert "fits" in out and "2 iterations" in out
    (rec,) = json.loads(path.read_text())
    stages = rec["stages"]
    assert set(stages) == {"rollout", "reference forward", "old-policy forward", "train step"}
    rollout, step, old = stages["rollout"], stages["train step"], stages["old-policy forward"]
    assert rollout["kinds"]["KV cache"] > 0 and "decode" in rollout["cost_source"]
    # the rollout shares the actor's model: the optimizer state is held beside it
    assert rollout["resident"] >= step["kinds"]["optimizer state"]
    # the old-policy forward runs on the rollout's model, the actor's own here
    assert old["kinds"]["parameters"] == step["kinds"]["parameters"]
    assert old["resident"] == rollout["resident"] and old["temporaries"] > 0
    # the reference forward's program on the same rows: log-probabilities out, no logits
    assert old["outputs"] == stages["reference forward"]["outputs"]
    # prompt and completion ids, their masks, the advantages, the reference's and the
    # old policy's logps
    batch = 8 * 32 * (4 + 1) + 8 * 16 * (4 + 1) + 8 * 4 + 2 * 8 * 16 * 4
    assert step["kinds"]["inputs"] == batch // 4
    assert rec["peak_bytes"] == step["peak_bytes"] and rec["stage"] in stages


@pytest.mark.aot
def test_grpo_runs_the_old_policy_forward_only_above_one_iteration():
    """Tunix's GRPO learner runs ``get_old_per_token_logps`` only when num_iterations > 1
    (google-tunix 0.1.7); the plan's default is the one ``posttrain grpo`` runs (Tunix's
    default, which it keeps). Built, not compiled."""
    from posttrain.plan import compile as plan_compile
    from posttrain.rl import tunix_rl

    default = PlanOptions.__dataclass_fields__["num_iterations"].default
    assert tunix_rl.algo_config("grpo", num_generations=2).num_iterations == default == 1
    options = PlanOptions(
        model="qwen3-tiny",
        topology="v5p-8",
        workflow="grpo",
        lora_rank=4,
        num_layers=1,
        batch=8,
        seq=32,
        new_tokens=16,
    )
    topo = topology.get("v5p-8")
    _, one, _ = plan_compile.build_programs(options, topo)
    _, two, _ = plan_compile.build_programs(dataclasses.replace(options, num_iterations=2), topo)
    assert list(one) == ["rollout", "reference forward", "train step"]
    assert list(two) == ["rollout", "reference forward", "old-policy forward", "train step"]
    assert one["train step"].args[2].old_per_token_logps is None
    logps = 8 * 16 * 4 // 4  # [rows, completion] float32 over fsdp=4
    assert two["train step"].kinds["inputs"] == one["train step"].kinds["inputs"] + logps
    old, ref = two["old-policy forward"], two["reference forward"]
    assert old.model_flops == ref.model_flops and old.kinds["inputs"] == ref.kinds["inputs"]
    assert old.attention_flops == ref.attention_flops > 0


@pytest.mark.slow
@pytest.mark.aot
def test_a_rollout_on_its_own_mesh_holds_a_copy_of_the_policy():
    """``--rollout-mesh``: the rollout samples from its own copy of the policy, placed on
    that mesh, which every program then holds beside its own arguments."""
    from posttrain.plan import plan

    options = PlanOptions(
        model="qwen3_moe-tiny",
        topology="v5p-8",
        workflow="grpo",
        lora_rank=4,
        num_layers=1,
        batch=8,
        seq=32,
        new_tokens=16,
        mesh={"tensor": 2, "expert": 2},
    )
    shared = plan(options).stages
    apart = plan(dataclasses.replace(options, rollout_mesh={"fsdp": 4})).stages
    copy = apart["rollout"].kinds["parameters"]
    assert copy > 0
    for name in ("train step", "reference forward"):
        assert apart[name].resident == shared[name].resident + copy
    optimizer = shared["train step"].kinds["optimizer state"]
    own = shared["train step"].resident
    assert shared["rollout"].resident == optimizer + own
    assert apart["rollout"].resident == (shared["train step"].kinds["parameters"] + optimizer + own)


@pytest.mark.devices(8)
@pytest.mark.parametrize("rank", [0, 4], ids=["full", "lora"])
def test_the_reference_holds_a_copy_or_only_its_zeroed_lora_b(rank):
    """Without LoRA the reference is a frozen copy (all of the parameters again); with
    LoRA it shares the base weights and holds only its zeroed lora_b."""
    from flax import nnx

    from posttrain import sharding
    from posttrain.lora import LoraConfig
    from posttrain.lora.abstract import abstract_lora
    from posttrain.models import get_config
    from posttrain.plan import abstract, workflows
    from posttrain.training.policy import TunixPolicy

    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    model = abstract.abstract_model(get_config("qwen3-tiny", scan_layers=True))
    if rank:
        model = abstract_lora(model, mesh, LoraConfig(rank=rank, alpha=rank))
    policy = TunixPolicy(model)
    abstract.place(policy, mesh)
    _, own = workflows._reference(policy)
    whole = abstract.device_bytes(nnx.state(policy))
    if not rank:
        assert own == whole
    else:
        lora = abstract.device_bytes(nnx.state(policy, nnx.LoRAParam))
        assert 0 < own < lora  # lora_b, not lora_a
        assert own == lora - sum(
            abstract.device_bytes([v.get_value()])
            for path, v in nnx.to_flat_state(nnx.state(policy, nnx.LoRAParam))
            if str(path[-1]).endswith("lora_a")
        )


# --- the abstract model ------------------------------------------------------------------------


@pytest.mark.devices(8)
@pytest.mark.parametrize("qtype", [None, "int8"], ids=["lora", "qlora-int8"])
def test_abstract_lora_matches_apply_lora(qtype):
    """Qwix on the abstract model adds the variables apply_lora adds to a real one, with the
    same shapes, dtypes and logical axes (so the plan shards them the same way)."""
    from flax import nnx

    from posttrain import sharding
    from posttrain.lora import LoraConfig, apply_lora
    from posttrain.lora.abstract import abstract_lora
    from posttrain.models import build_model, get_config
    from posttrain.plan import abstract

    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    cfg = get_config("qwen3-tiny", scan_layers=True)
    lora = LoraConfig(rank=4, alpha=4, weight_qtype=qtype)

    def layout(model):
        return {
            path: (v.get_value().shape, v.get_value().dtype, sharding.variable_logical_axes(v))
            for path, v in nnx.to_flat_state(nnx.state(model))
        }

    real = layout(apply_lora(build_model(cfg, mesh), mesh, lora))
    planned = layout(abstract_lora(abstract.abstract_model(cfg), mesh, lora))
    assert planned == real
    assert any("lora_a" in str(path[-1]) for path in planned)


@pytest.mark.parametrize(
    ("period", "layers", "shallow", "expected"),
    [
        (
            1,
            28,
            "compiled, splash's kernels analytic",
            "unscanned 1 and 2 layers, extrapolated to 28, splash's kernels analytic",
        ),
        (6, 48, "compiled", "unscanned 6 and 12 layers, extrapolated to 48"),
        (
            2,
            30,
            "compiled prefill + first decode step, later steps analytic",
            "unscanned 2 and 4 layers, extrapolated to 30, later steps analytic",
        ),
    ],
)
def test_extrapolated_costs_keep_what_the_shallow_source_adds(period, layers, shallow, expected):
    """The splash kernels' FLOPs are in the shallow compiles' figures, so the label of the
    line through them still names them (it did not: a v5e record said only ``unscanned 1
    and 2 layers``, and tests/test_plan_chip counted the kernels a second time)."""
    from posttrain.plan.depth import extrapolated_source

    assert extrapolated_source(period, layers, shallow) == expected


def test_depth_line_through_two_depths():
    from posttrain.plan.depth import linear

    assert linear((1, 10.0), (2, 13.0), 48) == 10.0 + 47 * 3.0
    assert linear((2, 10.0), (4, 16.0), 12) == 10.0 + 10 * 3.0  # 3 per layer after depth 2
    with pytest.raises(ValueError, match="depths 4 and 2 must satisfy 1 <= n1 < n2"):
        linear((4, 16.0), (2, 10.0), 12)
    with pytest.raises(ValueError, match="depths 0 and 2"):
        linear((0, 1.0), (2, 2.0), 12)


@pytest.mark.aot
@pytest.mark.parametrize("rank", [0, 4], ids=["full", "lora"])
def test_workflow_steps_count_the_trained_parameters_their_moments_and_gradients(rank):
    """DPO's and GRPO's train steps: gradients are the trained parameters (all of them
    without LoRA, the adapters with it) and AdamW's optimizer state their two moments.
    Built, not compiled."""
    from posttrain.plan import compile as plan_compile

    topo = topology.get("v5p-8")
    for workflow in ("dpo", "grpo"):
        options = PlanOptions(
            model="qwen3-tiny",
            topology="v5p-8",
            workflow=workflow,
            lora_rank=rank,
            num_layers=1,
            batch=8,
            seq=32,
            new_tokens=16,
        )
        _, programs, _ = plan_compile.build_programs(options, topo)
        kinds = programs["train step"].kinds
        if rank:
            assert 0 < kinds["gradients"] < kinds["parameters"] / 4
        else:
            assert kinds["gradients"] == kinds["parameters"]
        # mu and nu of each trained parameter, and AdamW's step counts (a few bytes)
        moments = kinds["optimizer state"] - 2 * kinds["gradients"]
        assert 0 <= moments < 64, (workflow, kinds)
        # model FLOPs on the same tokens: 6 N (4 N with LoRA) against the forward's 2 N
        forward = programs["reference forward"].model_flops
        assert programs["train step"].model_flops == (2 if rank else 3) * forward > 0
        # attention's own: forward and backward (3x) with LoRA too (its activations'
        # gradients go through every attention matmul)
        attention = programs["reference forward"].attention_flops
        assert programs["train step"].attention_flops == 3 * attention > 0
    with pytest.raises(ValueError, match="batch=6 rows must divide by the data-parallel size 4"):
        plan_compile.build_programs(dataclasses.replace(options, batch=6), topo)


def test_the_plan_package_imports_none_of_the_train_extras_packages():
    """`posttrain plan` plans generate (and its modules import) with the tpu extra alone:
    importing every module of posttrain.plan loads no package that only the train extra
    installs (Tunix, Qwix, Orbax, safetensors, tokenizers, jinja2, Pillow); the DPO and
    GRPO programs import theirs inside their functions."""
    import pkgutil
    import subprocess
    import sys

    import posttrain.plan

    names = [f"posttrain.plan.{m.name}" for m in pkgutil.iter_modules(posttrain.plan.__path__)]
    train_only = ["tunix", "qwix", "orbax", "safetensors", "tokenizers", "jinja2", "PIL"]
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        f"print(sorted(m for m in {train_only!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert len(names) >= 12 and out.stdout.strip() == "[]", (names, out.stdout, out.stderr[-500:])
