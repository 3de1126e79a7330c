"""What each ``posttrain`` subcommand does, given its checked options (:mod:`posttrain.cli`
parses them from the flags, sets the devices and turns errors into one line and an exit
status).

Each returns the exit status. JAX and the stack are imported inside the functions: the
CLI sets the devices first.
"""

from __future__ import annotations

from posttrain.commands.checkpoints import check_logits, convert, forward
from posttrain.commands.generate import generate, newest_export
from posttrain.commands.training import distill, dpo, grpo, sft
from posttrain.plan.cli import run as plan

__all__ = [
    "check_logits",
    "convert",
    "distill",
    "dpo",
    "forward",
    "generate",
    "grpo",
    "newest_export",
    "plan",
    "sft",
]
