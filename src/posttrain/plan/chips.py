"""The chips a plan runs on with ``--run-steps``: this process's TPU devices, checked
against the planned topology (:mod:`posttrain.plan.compile` picks them,
:mod:`posttrain.plan.measure` runs on them)."""

from __future__ import annotations

import jax

from posttrain.plan.topology import CHIPS

#: ``Device.device_kind`` of each chip generation, as the TPU runtime names it
DEVICE_KINDS: dict[str, tuple[str, ...]] = {
    "v4": ("TPU v4",),
    "v5e": ("TPU v5 lite", "TPU v5e"),
    "v5p": ("TPU v5", "TPU v5p"),
    "v6e": ("TPU v6 lite", "TPU v6e"),
}


def chip_devices(topology) -> list:
    """This process's devices, when they are ``topology``'s chips; in device-id order.

    Raises:
      ValueError: the backend is not a TPU, the device count differs from the slice's
        chips, or the chips are of another generation (one line naming both).
    """
    backend = jax.default_backend()
    if backend != "tpu":
        raise ValueError(
            f"--run-steps runs the plan on its chips: JAX's backend here is {backend!r}, "
            f"not a TPU {topology.name}"
        )
    devices = sorted(jax.devices(), key=lambda d: d.id)
    if len(devices) != topology.chips:
        raise ValueError(
            f"--run-steps: topology {topology.name} has {topology.chips} chips, this "
            f"process sees {len(devices)} TPU devices"
        )
    kind = devices[0].device_kind
    expected = DEVICE_KINDS.get(topology.chip.name, ())
    if not any(kind.lower() == e.lower() for e in expected):
        raise ValueError(
            f"--run-steps: the devices here are {kind!r}, not {topology.chip.name} "
            f"({' or '.join(map(repr, expected)) or 'unknown kind'})"
        )
    return devices


def peak_flops(device) -> float:
    """Peak dense bf16 FLOP/s of ``device``'s chip (``device_kind``, :data:`DEVICE_KINDS`,
    the figures of :data:`posttrain.plan.topology.CHIPS`): the denominator of an MFU
    measured on it; 0.0 for a device of no kind the table knows (a CPU, a GPU)."""
    kind = getattr(device, "device_kind", "").lower()
    for name, kinds in DEVICE_KINDS.items():
        if any(kind == k.lower() for k in kinds):
            return CHIPS[name].peak_flops
    return 0.0
