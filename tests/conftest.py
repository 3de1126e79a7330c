"""Shared test setup.

The device source is set by the harness pytest plugin (``--devices``, default
``$POSTTRAIN_DEVICES`` or 8) before this file is imported; nothing here may
import jax at module level or change the device source.
"""

import pytest

pytest_plugins = ["pytester"]  # harness tests run the plugin in inner pytest sessions


@pytest.fixture(scope="module")
def hf_tiny():
    """:mod:`tests.hf_tiny` (imports torch and transformers: ``reference`` tests only)."""
    import torch

    from tests import hf_tiny

    torch.set_num_threads(1)  # steady timings on a shared CPU
    return hf_tiny
