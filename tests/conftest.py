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


@pytest.fixture(scope="module")
def jax_started():
    """JAX imported and its backend started before any (function-scoped) pytester fixture.

    pytester drops the modules an in-process run imported; jax first imported
    inside one would be imported a second time afterwards, which aborts.
    """
    import jax

    jax.devices()
    from harness.gate import pytest_plugin

    pytest_plugin.environment_facts()
    return jax
