"""``posttrain-harness launch`` and :mod:`posttrain.distributed`: real local processes.

One test runs JAX across two processes (2 x 4 fake CPU devices, gloo) and compares it
with one process of 8; the others drive the launcher with small Python programs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from harness.cli import main as harness_main
from harness.devices import launch
from tests.processes import alive, gone_within

pytestmark = pytest.mark.host

ROOT = Path(__file__).resolve().parent.parent

RANK = "import os, signal, sys, time\nr = int(os.environ['POSTTRAIN_PROCESS_ID'])\n"
"""The start of a rank's program: ``r`` is its process id."""


def _python(code: str) -> list[str]:
    return ["python", "-c", code]


CROSS_PROCESS = """
import sys
import numpy as np
from posttrain import distributed
distributed.initialize()
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tensor"))
full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
x = jax.make_array_from_callback(full.shape, NamedSharding(mesh, PartitionSpec("fsdp", "tensor")),
                                 lambda index: full[index])
assert not x.is_fully_addressable
total = jax.jit(lambda a: (a * 2).sum())(x)  # a reduction across the process boundary
np.testing.assert_array_equal(distributed.host_array(x), full)  # gathered from both
distributed.barrier("done")
try:  # a block failing in rank 1 only: rank 0 learns it instead of waiting
    with distributed.together("fail in rank 1"):
        if distributed.process_index() == 1:
            raise ValueError("rank 1's shard is bad")
    caught = "none"
except (RuntimeError, ValueError) as error:
    caught = type(error).__name__
line = f"rank {distributed.process_index()} writer {distributed.is_writer()} sum {float(total)}"
line += f" caught {caught} " + str(distributed.sum_by_key({distributed.process_index(): 5}, 2))
sys.stdout.write(line + chr(10))  # one write: gloo's own messages share this stream
"""


def test_two_processes_form_one_runtime_and_gather_across_it():
    """The gate's multi-process run (about 2 s; the SFT, DPO, GRPO and generate runs on 2
    processes are in the slow tier, for the gate's budget). 2 launched processes x 4
    devices join through ``posttrain.distributed.initialize`` (gloo) into one 8-device
    runtime; a jitted reduction over an array sharded across both, ``host_array``'s
    gather and the barrier work, and only rank 0 is the writer; a block failing in rank
    1 only makes rank 0 raise too (``together``), and ``sum_by_key`` sums both ranks'
    keys."""
    out = io.StringIO()
    assert launch.launch(2, ["python", "-c", CROSS_PROCESS], out=out) == 0, out.getvalue()
    want = float(np.arange(48).sum() * 2)
    # gloo prints its connection messages on stdout in pieces, from its own threads: a
    # piece may land on the same line as ours, so each report is found by its pattern.
    found = sorted(
        re.findall(r"rank (\d) writer (\w+) sum ([\d.]+) caught (\w+) (\d+)", out.getvalue())
    )
    assert found == [
        ("0", "True", str(want), "OtherProcessFailed", "10"),
        ("1", "False", str(want), "ValueError", "10"),
    ], out.getvalue()


def test_each_rank_gets_its_variables_and_its_lines_are_prefixed():
    out = io.StringIO()
    code = (
        "import os; e = os.environ; print(e['POSTTRAIN_PROCESS_ID'], e['POSTTRAIN_NUM_PROCESSES'],"
        " e['POSTTRAIN_COORDINATOR'].startswith('127.0.0.1:'),"
        " e['XLA_FLAGS'].split()[-1])"
    )
    assert launch.launch(3, _python(code), devices_per_process=2, out=out) == 0
    lines = sorted(out.getvalue().splitlines())
    assert lines == [
        f"[rank {r}] {r} 3 True --xla_force_host_platform_device_count=2" for r in range(3)
    ]


def test_a_failing_rank_stops_the_others_and_is_named(capsys):
    """Rank 1 exits 3 at once; rank 0 would sleep a minute: the launcher stops it within
    the grace period and exits 3, naming rank 1."""
    code = RANK + "sys.exit(3) if r else time.sleep(60)"
    started = time.monotonic()
    assert launch.launch(2, _python(code), grace=2.0, out=io.StringIO()) == 3
    assert time.monotonic() - started < 20
    err = capsys.readouterr().err
    assert "rank 1 exited with status 3; stopping rank(s) 0" in err


def test_a_killed_rank_is_named_with_its_signal(capsys):
    code = RANK + "os.kill(os.getpid(), signal.SIGKILL) if r else time.sleep(60)"
    assert launch.launch(2, _python(code), grace=2.0, out=io.StringIO()) == 128 + 9
    assert "rank 1 was killed by SIGKILL" in capsys.readouterr().err


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(capsys):
    code = (
        RANK + "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nsys.exit(5) if r else time.sleep(60)"
    )
    started = time.monotonic()
    assert launch.launch(2, _python(code), grace=1.0, out=io.StringIO()) == 5
    assert time.monotonic() - started < 15


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["-n", "3", "--", "posttrain", "forward", "--mesh", "fsdp=4,tensor=2"],
            "--mesh fsdp=4,tensor=2 has 8 devices, but -n 3 x --devices-per-process 4 gives 12",
        ),
        (["-n", "2", "--", "posttrain", "forward", "--mesh=fsdp=3"], "has 3 devices"),
        (["-n", "0", "--", "python", "-c", "pass"], "-n 0: expected at least 1 process"),
        (["-n", "2", "--devices-per-process", "0", "--", "python"], "expected at least 1"),
        (["-n", "2"], "no command after --"),
        (["-n", "2", "--", "no-such-program-here"], "not found on PATH"),
        (["-n", "2", "--grace", "-1", "--", "python"], "--grace -1.0: expected a finite number"),
        (["-n", "2", "--grace", "nan", "--", "python"], "--grace nan: expected a finite number"),
        (["-n", "2", "--grace", "inf", "--", "python"], "--grace inf: expected a finite number"),
        # #56: bounded before any process starts (-n 100000 started processes for minutes)
        (["-n", "100000", "--", "python"], "-n 100000: expected at most 64 processes"),
        (
            ["-n", "2", "--devices-per-process", "100000000", "--", "python"],
            "--devices-per-process 100000000: expected at most 512",
        ),
        (["-n", "2", "--", "/etc/passwd"], "command '/etc/passwd' is not an executable file"),
        (["-n", "2", "--", "/tmp"], "command '/tmp' is not an executable file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_process_starts(argv, words, capsys):
    assert harness_main(["launch", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_a_command_that_does_not_run_across_processes_refuses_to_start():
    """Only the commands listed in ``posttrain.cli.MULTI_PROCESS`` run under the launcher;
    the others exit 2 with one line in every rank."""
    out = io.StringIO()
    command = ["posttrain", "check-logits", "a", "b"]
    assert launch.launch(2, command, out=out) == 2
    lines = out.getvalue().splitlines()
    assert any("posttrain check-logits does not run across processes yet" in x for x in lines)


def _logits_line(lines) -> str:
    pattern = r"logits \[[^\]]*\] float32: mean \S+, std [\d.]+, finite \w+; moe_aux_loss [\d.]+"
    found = [m.group(0) for x in lines if (m := re.search(pattern, x))]
    assert found, lines
    return found[0] if len(set(found)) == 1 else f"ranks differ: {found}"


@pytest.mark.slow  # the gate's multi-process test is the SFT run below
def test_a_forward_on_two_processes_equals_one_process_of_eight_devices():
    """``posttrain forward`` on fsdp=4 x tensor=2 spanning 2 processes x 4 devices (gloo
    collectives across the boundary) prints the logits' mean and std of the same
    forward in one process of 8 devices."""
    argv = ["forward", "--model", "qwen3-tiny", "--mesh", "fsdp=4,tensor=2", "--seq", "32"]
    argv += ["--repeats", "1"]
    out = io.StringIO()
    assert launch.launch(2, ["posttrain", *argv], devices_per_process=4, out=out) == 0
    lines = out.getvalue().splitlines()
    assert {x.split("]")[0] for x in lines if re.search("float32: mean", x)} >= {"[rank 0"}
    single = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", *argv, "--devices", "8"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert _logits_line(lines) == _logits_line(single.stdout.splitlines())


SFT = ["sft", "--lora-rank", "4", "--grad-accum", "2", "--steps", "2"]
SFT += ["--max-target-length", "64"]


def _exports(run) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    arrays = {}
    for directory in ("model-step2", "adapter-step2"):
        for path in sorted((run / directory).glob("*.safetensors")):
            arrays.update({f"{directory}/{k}": v for k, v in load_file(path).items()})
    return arrays


@pytest.mark.slow  # 35-40 s of the gate's test time; the runtime test above stays there
def test_sft_on_two_processes_equals_one_process_of_eight_devices(tmp_path):
    """``posttrain sft`` (LoRA, gradient accumulation 2)
    on 2 processes x 4 devices, each tokenising only its half of the data (2 data
    shards): the same per-step losses and grad norms (fp32, 1e-6) and the same exported
    weights as 1 process x 8 devices reading the same 2 shards; one process logs and
    writes metrics, run.json and the exports; the checkpoint holds the adapters only."""
    two, one = tmp_path / "two", tmp_path / "one"
    out = io.StringIO()
    status = launch.launch(2, ["posttrain", *SFT, "--output", str(two)], out=out)
    assert status == 0, out.getvalue()[-3000:]
    printed = out.getvalue().splitlines()
    assert [x for x in printed if x.startswith("[rank 0] steps 1-2: loss")]
    # Rank 0 logs and prints the closing lines (gloo's own lines come in pieces).
    ours = r"\[rank 1\].*(step \d|steps \d|checkpoint|wrote|model qwen3)"
    assert not [x for x in printed if re.match(ours, x)], printed
    (shards,) = [
        re.search(r"([\d,]+) rows of 64 in 2 data shard\(s\), ([\d,]+) read here", x)
        for x in printed
        if "read here" in x
    ]
    total, here = (int(g.replace(",", "")) for g in shards.groups())
    assert 0.4 * total < here < 0.6 * total  # rank 0 tokenised its shard only
    # The reference in this process (8 devices): what `posttrain sft` runs for SFT's options.
    from posttrain import cli
    from posttrain.sft.run import run_sft

    assert jax.device_count() == 8
    argv = [*SFT, "--data-shards", "2", "--output", str(one)]
    run_sft(cli.parse_options(argv))
    records = [
        [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for run in (two, one)
    ]
    assert [r["step"] for r in records[0]] == [1, 2]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in records[0]], [r[key] for r in records[1]], rtol=1e-6, err_msg=key
        )
    got, want = _exports(two), _exports(one)
    assert got.keys() == want.keys() and len(got) > 20
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6, rtol=0, err_msg=k)
    facts = json.loads((two / "run.json").read_text())
    assert facts["global_batch"] == 8 and facts["data_shards"] == 2
    assert len(list((two / "tensorboard").rglob("events.out.tfevents.*"))) == 1  # rank 0's
    assert facts["rows"] == json.loads((one / "run.json").read_text())["rows"]
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["2"]  # the last only
    meta = json.loads((two / "checkpoints" / "2" / "model_params" / "_METADATA").read_text())
    keys = list(meta["tree_metadata"])
    assert keys and all("_lora_a" in k or "_lora_b" in k for k in keys), keys[:4]


def _two_then_one(argv, tmp_path, launches=([],), one=()) -> tuple[list[dict], list[dict]]:
    """``posttrain ARGV`` launched on 2 processes x 4 devices into ``tmp_path/two`` (once
    per entry of ``launches``, its extra options appended: a stop, then a resume), then
    in 1 process x 8 into ``tmp_path/one`` (``one`` appended); the ``metrics.jsonl``
    records of each. The launches' output is in ``tmp_path/launched.txt``, the single
    process's in ``tmp_path/alone.txt``."""
    two, single = tmp_path / "two", tmp_path / "one"
    printed = []
    for extra in launches:
        out = io.StringIO()
        status = launch.launch(2, ["posttrain", *argv, *extra, "--output", str(two)], out=out)
        assert status == 0, out.getvalue()[-3000:]
        printed.append(out.getvalue())
    (tmp_path / "launched.txt").write_text("".join(printed))
    alone = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", *argv, *one, "--output", str(single)]
        + ["--devices", "8"],
        capture_output=True,
        check=True,
        text=True,
    )
    (tmp_path / "alone.txt").write_text(alone.stdout)
    got, want = (
        [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for run in (two, single)
    )
    return got, want


@pytest.mark.slow
def test_full_fine_tuning_stopped_and_resumed_across_processes_equals_one_run(tmp_path):
    """Full fine-tuning (every weight sharded over both processes), stopped after step 1
    and resumed to step 3 on 2 processes: the per-step losses of one uninterrupted run
    of 1 process x 8 devices, and metrics.jsonl holds each step once."""
    argv = ["sft", "--grad-accum", "2", "--steps", "3", "--max-target-length", "64"]
    argv += ["--save-every", "1", "--data-shards", "2"]  # each process reads one shard
    two = tmp_path / "two"
    got, want = _two_then_one(argv, tmp_path, launches=(["--stop-after", "1"], []))
    assert [r["step"] for r in got] == [1, 2, 3]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in want], rtol=1e-6)
    segments = json.loads((two / "run.json").read_text())["segments"]
    assert [s["resumed_from_step"] for s in segments] == [0, 1]


@pytest.mark.slow
def test_dpo_on_two_processes_equals_one_process_of_eight_devices(tmp_path):
    """``posttrain dpo`` (LoRA, gradient accumulation 2, the held-out evaluation) on 2
    processes x 4 devices, each tokenising only its half of the pairs (2 data shards,
    the default there): the per-step losses and margins and the held-out figures of 1
    process x 8 devices reading the same 2 shards."""
    argv = ["dpo", "--lora-rank", "4", "--grad-accum", "2", "--steps", "2"]
    argv += ["--max-prompt-length", "48", "--max-response-length", "48"]
    two, one = tmp_path / "two", tmp_path / "one"
    got, want = _two_then_one(argv, tmp_path, one=["--data-shards", "2"])
    (shards,) = re.findall(
        r"\[rank 0\].* on ([\d,]+) pairs in 2 data shard\(s\), ([\d,]+) read here",
        (tmp_path / "launched.txt").read_text(),
    )
    total, here = (int(x.replace(",", "")) for x in shards)
    assert 0.4 * total < here < 0.6 * total  # rank 0 tokenised its shard only
    assert [r["step"] for r in got] == [1, 2]
    for key in ("loss", "reward_margin", "grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in got], [r[key] for r in want], rtol=1e-5, atol=1e-7, err_msg=key
        )
    evaluations = [json.loads((run / "run.json").read_text())["evaluation"] for run in (two, one)]
    for when in ("before", "after"):
        for key, value in evaluations[1][when].items():
            np.testing.assert_allclose(evaluations[0][when][key], value, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_generate_on_two_processes_equals_one_process_of_eight_devices(tmp_path):
    """``posttrain generate`` (greedy and seeded sampling, 3 prompts: the batch filled up
    to the data-parallel size) on fsdp=4 x tensor=2 across 2 processes x 4 devices: the
    same tokens, log-probabilities and stop reasons as 1 process x 8 devices, written
    once (rank 0); one prompt prints its text once."""
    argv = ["generate", "--model", "qwen3-tiny", "--mesh", "fsdp=4,tensor=2"]
    argv += ["--max-new-tokens", "6", "--prompt", "def f(", "--prompt", "Hello"]
    argv += ["--prompt", "a longer prompt than the others"]
    for options in (["--temperature", "0"], ["--temperature", "0.8", "--top-k", "5"]):
        two, one = tmp_path / "two.jsonl", tmp_path / "one.jsonl"
        out = io.StringIO()
        command = ["posttrain", *argv, *options, "--output", str(two)]
        assert launch.launch(2, command, out=out) == 0, out.getvalue()[-3000:]
        subprocess.run(
            [sys.executable, "-m", "posttrain.cli", *argv, *options, "--output", str(one)]
            + ["--devices", "8"],
            capture_output=True,
            check=True,
        )
        got, want = ([json.loads(x) for x in p.read_text().splitlines()] for p in (two, one))
        assert [r["tokens"] for r in got] == [r["tokens"] for r in want] and len(got) == 3
        assert [r["stop_reason"] for r in got] == [r["stop_reason"] for r in want]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5)
    out = io.StringIO()
    single = ["posttrain", *argv[:7], "--prompt", "Hello"]
    assert launch.launch(2, single, out=out) == 0, out.getvalue()[-3000:]
    printed = {"[rank 0]": [], "[rank 1]": []}
    for line in out.getvalue().splitlines():
        rank, _, text = line.partition("] ")
        if rank + "]" in printed and text.strip() and "Gloo" not in text:
            printed[rank + "]"].append(text)
    assert printed["[rank 0]"] and not printed["[rank 1]"], printed


ROUND_TRIP = """
import sys
from pathlib import Path
from posttrain import distributed
distributed.initialize()
import jax
from posttrain import sharding
from posttrain.loading import load_model
from posttrain.training.export import export_final
hf, out = Path(sys.argv[1]), Path(sys.argv[2])
mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
model, _ = load_model(str(hf), mesh, scratch=out / "scratch")
leaves = jax.tree.leaves(model)
assert jax.process_count() == 2 and any(not x.is_fully_addressable for x in leaves)
export_final(model, out, 0)
sys.stdout.write(f"rank {distributed.process_index()} exported" + chr(10))
"""


@pytest.mark.slow
@pytest.mark.reference
def test_a_checkpoint_through_a_two_process_mesh_and_back_is_bit_identical(tmp_path):
    """An HF checkpoint loaded onto fsdp=4 x tensor=2 spanning 2 processes (every weight
    sharded across the boundary), exported (gathered, rank 0 writes), then converted back
    with ``posttrain convert`` launched on 2 processes (rank 0 converts, the other waits):
    every tensor equals the original bit for bit; a failing conversion fails both ranks."""
    from safetensors.numpy import load_file

    from tests import hf_tiny

    hf = hf_tiny.save(hf_tiny.build("qwen3"), tmp_path / "hf")
    out = io.StringIO()
    status = launch.launch(2, ["python", "-c", ROUND_TRIP, str(hf), str(tmp_path)], out=out)
    assert status == 0, out.getvalue()[-3000:]
    back = tmp_path / "back"
    argv = ["posttrain", "convert", "--from", "native", "--to", "hf"]
    out = io.StringIO()
    status = launch.launch(2, [*argv, str(tmp_path / "model-step0"), str(back)], out=out)
    assert status == 0, out.getvalue()[-3000:]
    assert "[rank 1] rank 1: rank 0 wrote" in out.getvalue()

    def tensors(directory):
        found = {}
        for path in sorted(directory.glob("*.safetensors")):
            found.update(load_file(path))
        return found

    want, got = tensors(hf), tensors(back)
    assert got.keys() == want.keys() and len(want) > 10
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    out = io.StringIO()  # the destination exists now: rank 0 refuses, so do both ranks
    status = launch.launch(2, [*argv, str(tmp_path / "model-step0"), str(back)], out=out)
    assert status != 0
    printed = out.getvalue()
    assert "[rank 0] posttrain: error:" in printed, printed  # rank 0's own one line
    # rank 1 learns it (OtherProcessFailed) unless the launcher stopped it first
    assert "[rank 1] rank 0 wrote" not in printed


@pytest.mark.slow
def test_grpo_on_two_processes_equals_one_process_of_eight_devices(tmp_path):
    """``posttrain grpo`` (LoRA, Tunix's learner, rollouts on the shared mesh, the held-out
    evaluation before and after, a 2-step warm-up SFT whose processes each read one data
    shard) on 2 processes x 4 devices: the per-step rewards, loss and KL and the
    evaluations of 1 process x 8 devices with ``--warmup-data-shards 2``; one process
    writes."""
    argv = ["grpo", "--lora-rank", "4", "--steps", "2", "--warmup-steps", "2"]
    argv += ["--max-new-tokens", "4", "--eval-samples", "1"]
    got, want = _two_then_one(argv, tmp_path, one=["--warmup-data-shards", "2"])
    assert "in 2 data shard(s)" in (tmp_path / "launched.txt").read_text()
    warmups = [
        [json.loads(x) for x in (tmp_path / run / "warmup/metrics.jsonl").read_text().splitlines()]
        for run in ("two", "one")
    ]
    for key in ("loss", "grad_norm"):  # the same warm-up data order
        np.testing.assert_allclose(*([r[key] for r in w] for w in warmups), rtol=1e-6)
    assert [r["step"] for r in got] == [1, 2]
    for key in ("reward/total/mean", "loss", "kl"):
        np.testing.assert_allclose(
            [r[key] for r in got], [r[key] for r in want], rtol=1e-5, atol=1e-6, err_msg=key
        )
    evaluations = [
        json.loads((run / "run.json").read_text())["evaluation"]
        for run in (tmp_path / "two", tmp_path / "one")
    ]
    for when in ("before", "after"):
        np.testing.assert_allclose(evaluations[0][when], evaluations[1][when], atol=1e-9)


@pytest.mark.slow
def test_moe_sft_with_experts_split_across_processes_equals_one_process(tmp_path):
    """An MoE model (mixtral-tiny, 8 experts) trained with expert parallelism over all 8
    devices (expert=8: 4 experts per process, the dispatch crossing the process boundary)
    and its load-balancing term: the per-step losses, grad norms and moe_aux_loss of 1
    process x 8 devices."""
    argv = ["sft", "--model", "mixtral-tiny", "--mesh", "expert=8", "--lora-rank", "4"]
    argv += ["--steps", "2", "--max-target-length", "64", "--data-shards", "2"]
    got, want = _two_then_one(argv, tmp_path)
    assert [r["step"] for r in got] == [1, 2]
    for key in ("loss", "grad_norm", "moe_aux_loss"):
        np.testing.assert_allclose(
            [r[key] for r in got], [r[key] for r in want], rtol=1e-5, err_msg=key
        )
    assert all(r["moe_aux_loss"] > 0 for r in got)


@pytest.mark.slow
def test_distill_on_two_processes_equals_one_process_of_eight_devices(tmp_path):
    """``posttrain distill`` (a bf16 preset teacher, a LoRA student one layer deep,
    gradient accumulation 2) on 2 processes x 4 devices, each tokenising half of the
    training split: the per-step losses, KL and grad norms, the held-out KL before and
    after, and the exported adapters of 1 process x 8 devices reading the same 2 shards;
    process 0 alone writes the data split, the student's start and the exports."""
    argv = ["distill", "--teacher", "llama3-tiny", "--teacher-dtype", "bfloat16"]
    argv += ["--lora-rank", "4", "--grad-accum", "2", "--steps", "2"]
    argv += ["--max-target-length", "64", "--save-every", "2"]
    got, want = _two_then_one(argv, tmp_path, one=["--data-shards", "2"])
    assert [r["step"] for r in got] == [1, 2]
    for key in ("loss", "kl", "task_loss", "grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in got], [r[key] for r in want], rtol=1e-6, err_msg=key
        )
    launched = (tmp_path / "launched.txt").read_text()
    (kl,) = re.findall(r"\[rank 0\].*held-out KL to the teacher (\S+) -> (\S+)", launched)
    assert not re.search(r"\[rank 1\].*held-out KL", launched)  # printed once
    single = json.loads((tmp_path / "one" / "run.json").read_text())
    assert single["rows"] == json.loads((tmp_path / "two" / "run.json").read_text())["rows"]
    got_export, want_export = (_exports(tmp_path / run) for run in ("two", "one"))
    assert got_export.keys() == want_export.keys() and got_export
    for k in want_export:
        np.testing.assert_allclose(got_export[k], want_export[k], atol=1e-6, rtol=0, err_msg=k)
    alone = (tmp_path / "alone.txt").read_text()
    (kl_alone,) = re.findall(r"held-out KL to the teacher (\S+) -> (\S+)", alone)
    np.testing.assert_allclose(
        [float(x) for x in kl], [float(x) for x in kl_alone], atol=2e-4, rtol=0
    )  # printed to 4 decimals
    assert float(kl[1]) < float(kl[0])
    assert sorted(p.name for p in (tmp_path / "two" / "data").iterdir()) == [
        "held_out.jsonl",
        "train.jsonl",
    ]  # no temporary left by a second writer


RANK_WAITS = (
    "import os, time\n"
    "from posttrain import distributed\n"
    "distributed.initialize()\n"
    "print('pid', os.getpid(), flush=True)\n"
    "time.sleep(120)\n"
)
"""A rank that joins the runtime (JAX's preemption notifier then holds SIGTERM) and waits."""


def _launched_ranks(n: int) -> tuple[subprocess.Popen, list[int]]:
    """A launcher process of ``n`` waiting ranks, and their pids once each is ready."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "launch",
            "-n",
            str(n),
            "--grace",
            "30",
            "--",
            "python",
            "-c",
            RANK_WAITS,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids = []
    while len(pids) < n:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        if found := re.search(r"\] pid (\d+)", line):
            pids.append(int(found.group(1)))
    return proc, pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_ranks_die_with_their_launcher_promptly(sig):
    """A stopped launcher leaves no rank behind: on SIGTERM it stops them and exits 143
    within seconds (not its 30 s grace: a launched rank ends on SIGTERM, which JAX's
    preemption notifier would hold); a SIGKILL of the launcher reaches them through the
    parent-death signal."""
    proc, pids = _launched_ranks(2)
    try:
        started = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=20) == (143 if sig == signal.SIGTERM else -9)
        if sig == signal.SIGTERM:
            assert time.monotonic() - started < 5
            assert "stopped by SIGTERM; ranks stopped" in proc.stderr.read()
        assert gone_within(pids, 5), [p for p in pids if alive(p)]
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()  # closes its pipes


def test_a_module_planted_in_the_working_directory_is_never_imported(tmp_path):
    """Ranks of `posttrain` run with `python -P`: an `argparse.py` in the working
    directory (which `python -m` would import first) is not run."""
    marker = tmp_path / "planted-ran"
    (tmp_path / "argparse.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise SystemExit(7)\n"
    )
    launcher = Path(sys.executable).parent / "posttrain-harness"  # the installed command
    done = subprocess.run(
        [str(launcher), "launch", "-n", "1", "--", "posttrain", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists()
