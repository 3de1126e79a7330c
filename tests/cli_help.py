"""The ``--help`` of a module's ``main(argv)``: argparse's exit and the text it printed."""

from __future__ import annotations

import pytest


def help_text(main, capsys) -> str:
    """``main(["--help"])``'s standard output, after checking it exits 0 (argparse's
    ``SystemExit``); ``capsys`` is the calling test's fixture."""
    capsys.readouterr()  # what the test printed before
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out
