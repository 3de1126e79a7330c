"""Shared test setup.

The device source is set by the harness pytest plugin (``--devices``, default
``$POSTTRAIN_DEVICES`` or 8) before this file is imported; nothing here may
import jax at module level or change the device source.
"""

pytest_plugins = ["pytester"]  # harness tests run the plugin in inner pytest sessions
