"""Accelerator slices a plan can target: chip counts, libtpu topology names, peak figures.

A TPU slice's devices come from libtpu without the chips (``jax.experimental.topologies``,
deviceless AOT): :func:`devices` returns the slice's devices on any machine where the
``tpu`` extra (``jax[tpu]``, libtpu) is installed, while JAX's default backend stays
the CPU. Names follow Cloud TPU's accelerator types: ``v5p-N`` and ``v4-N`` count
TensorCores (two per chip, one megacore device per chip), ``v5e-N`` and ``v6e-N``
count chips (one TensorCore each).

Figures are per chip, from the Cloud TPU system-architecture pages (cited on each
row); HBM is the page's figure read as GiB (the pages write "GB"; the compiler's
own rejection of a program that does not fit is the authority at the boundary).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os

GIB = 1 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """One accelerator chip's figures.

    Attributes:
      name: Cloud's name (``v5p``, ``h200`` ...).
      hbm_bytes: high-bandwidth memory per chip, bytes.
      peak_flops: peak dense bf16 FLOP/s per chip.
      hbm_bandwidth: HBM bandwidth per chip, bytes/s.
      source: the page the figures are from.
      flop_efficiency: the fraction of ``peak_flops`` a step's model FLOPs (``6 N`` per
        token and attention's own, :func:`posttrain.plan.report.judge`) run at on this
        chip, measured; 1.0 where no chip was measured.
      hbm_share: HBM bytes moved per byte ``cost_analysis()`` counts as accessed (it
        counts operands a fusion keeps on the chip), measured; 1.0 where none was.
      calibration_source: the measurement behind both ("" when uncalibrated).
    """

    name: str
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float
    source: str
    flop_efficiency: float = 1.0
    hbm_share: float = 1.0
    calibration_source: str = ""

    def __post_init__(self) -> None:
        for field in ("hbm_bytes", "peak_flops", "hbm_bandwidth", "hbm_share"):
            if getattr(self, field) <= 0:
                raise ValueError(f"chip {self.name}: {field}={getattr(self, field)} must be > 0")
        if not 0 < self.flop_efficiency <= 1:
            raise ValueError(
                f"chip {self.name}: flop_efficiency={self.flop_efficiency} must be in (0, 1]"
            )


CHIPS: dict[str, Chip] = {
    # "Peak compute per chip (bf16) 275 TFLOPs; HBM2 capacity and bandwidth 32 GiB, 1200 GBps"
    "v4": Chip(
        name="v4",
        hbm_bytes=32 * GIB,
        peak_flops=275e12,
        hbm_bandwidth=1200e9,
        source="https://cloud.google.com/tpu/docs/v4",
    ),
    # "Peak compute per chip (bf16) 197 TFLOPs; HBM2 capacity and bandwidth 16 GB, 819 GBps".
    # HBM: what the runtime gives a program, Device.memory_stats()["bytes_limit"] on a lent
    # v5e (2026-12-05), not the page's 16: the compiler refuses beyond it ("exceeds
    # available HBM (15.75G)").
    "v5e": Chip(
        name="v5e",
        hbm_bytes=16_909_336_064,
        peak_flops=197e12,
        hbm_bandwidth=819e9,
        source="https://cloud.google.com/tpu/docs/v5e",
        # Fitted (the largest error least) to the thirteen SFT steps a lent v5e ran
        # (tests/plan_chip_v5e*.json, docs/scale.md): each MFU within 14.8%; each left out
        # of a fit to the other twelve, within 19.3%.
        flop_efficiency=0.395,
        hbm_share=0.64,
        calibration_source=(
            "13 qwen3-0.6b SFT steps on a v5e (docs/scale.md): model and attention FLOPs at "
            "0.395 of peak, 0.64 of cost_analysis' bytes at HBM bandwidth; MFU within 15% of each"
        ),
    ),
    # "Peak compute per chip (bf16) 459 TFLOPs; HBM2e capacity and bandwidth 95GB, 2765 GBps"
    "v5p": Chip(
        name="v5p",
        hbm_bytes=95 * GIB,
        peak_flops=459e12,
        hbm_bandwidth=2765e9,
        source="https://cloud.google.com/tpu/docs/v5p",
    ),
    # "Peak compute per chip (bf16) 918 TFLOPs; HBM capacity per chip 32 GB;
    #  HBM bandwidth per chip 1638 GBps"
    "v6e": Chip(
        name="v6e",
        hbm_bytes=32 * GIB,
        peak_flops=918e12,
        hbm_bandwidth=1638e9,
        source="https://cloud.google.com/tpu/docs/v6e",
    ),
    # "GPU memory 141GB; GPU memory bandwidth 4.8TB/s; BF16 Tensor Core 1,979 TFLOPS"
    # (the page's figure is with sparsity; dense is half of it)
    "h200": Chip(
        name="h200",
        hbm_bytes=141 * 10**9,
        peak_flops=1979e12 / 2,
        hbm_bandwidth=4.8e12,
        source="https://www.nvidia.com/en-us/data-center/h200/",
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Topology:
    """One slice.

    Attributes:
      name: the accelerator type (``v5p-32``).
      chip: its :class:`Chip`.
      chips: chips in the slice (= JAX devices: megacore on v4 / v5p).
      libtpu_name: ``get_topology_desc``'s ``topology_name`` (``v5p:2x2x4``); ``None``
        for a GPU, which libtpu cannot compile for.
    """

    name: str
    chip: Chip
    chips: int
    libtpu_name: str | None

    def __post_init__(self) -> None:
        if self.chips < 1:
            raise ValueError(f"topology {self.name}: chips={self.chips} must be >= 1")
        if self.libtpu_name is not None:
            dims = [int(d) for d in self.libtpu_name.split(":")[1].split("x")]
            product = 1
            for d in dims:
                product *= d
            if product != self.chips:
                raise ValueError(
                    f"topology {self.name}: {self.libtpu_name} holds {product} chips, "
                    f"not {self.chips}"
                )

    @property
    def hbm_bytes(self) -> int:
        """HBM of one device (one chip)."""
        return self.chip.hbm_bytes


def _tpu(name: str, shape: str) -> Topology:
    generation = name.split("-")[0]
    dims = [int(d) for d in shape.split("x")]
    chips = 1
    for d in dims:
        chips *= d
    return Topology(
        name=name, chip=CHIPS[generation], chips=chips, libtpu_name=f"{generation}:{shape}"
    )


# Slice shapes: the "Configurations" tables of the same pages (v5p-N / v4-N: N TensorCores,
# N / 2 chips; v5e-N / v6e-N: N chips).
TOPOLOGIES: dict[str, Topology] = {
    t.name: t
    for t in (
        _tpu("v4-8", "2x2x1"),
        _tpu("v4-16", "2x2x2"),
        _tpu("v4-32", "2x2x4"),
        _tpu("v5e-1", "1x1"),
        _tpu("v5e-4", "2x2"),
        _tpu("v5e-8", "2x4"),
        _tpu("v5e-16", "4x4"),
        _tpu("v5e-64", "8x8"),
        _tpu("v5e-256", "16x16"),
        _tpu("v5p-8", "2x2x1"),
        _tpu("v5p-16", "2x2x2"),
        _tpu("v5p-32", "2x2x4"),
        _tpu("v5p-64", "2x4x4"),
        _tpu("v5p-128", "4x4x4"),
        _tpu("v5p-256", "4x4x8"),
        _tpu("v6e-1", "1x1"),
        _tpu("v6e-4", "2x2"),
        _tpu("v6e-8", "2x4"),
        _tpu("v6e-16", "4x4"),
        _tpu("v6e-64", "8x8"),
        _tpu("v6e-256", "16x16"),
        Topology(name="h200", chip=CHIPS["h200"], chips=1, libtpu_name=None),
        Topology(name="h200-8", chip=CHIPS["h200"], chips=8, libtpu_name=None),
    )
}


def get(name: str) -> Topology:
    """The topology ``name``.

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}; expected one of {', '.join(TOPOLOGIES)}")
    return TOPOLOGIES[name]


# libtpu reads these when it first loads; without them it asks the GCE metadata server
# (absent here) and prints warnings ("could not determine TPU accelerator type") and an
# INVALID_ARGUMENT line, and a second process loading it (another plan, an xdist worker)
# fails on /tmp/libtpu_lockfile ("Internal error when accessing libtpu multi-process
# lockfile"): compiling never claims a chip. Defaults only: a TPU VM's own values win.
_LIBTPU_ENV = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": "v5p-8",
    "TPU_WORKER_HOSTNAMES": "localhost",
}


def devices(topology: Topology) -> list:
    """The slice's devices, from libtpu, without the chips; in device-id order.

    Raises:
      NotImplementedError: a GPU topology (libtpu compiles for TPUs only).
      ModuleNotFoundError: libtpu is not installed (the ``tpu`` extra).
    """
    if topology.libtpu_name is None:
        raise NotImplementedError(
            f"topology {topology.name}: compiling for a GPU without one is not supported "
            "(libtpu compiles for TPUs only); run the workflow on the GPU itself"
        )
    if importlib.util.find_spec("libtpu") is None:
        raise ModuleNotFoundError(
            "libtpu is not installed: install the tpu extra "
            "(uv sync --extra tpu, or pip install 'posttrain-harness[tpu]')"
        )
    for key, value in _LIBTPU_ENV.items():
        os.environ.setdefault(key, value)
    from jax.experimental import topologies

    options = {}
    if topology.chip.name == "v4":  # one megacore device per chip, as v5p by default
        options["chip_config_name"] = "megacore"
    if topology.chips == 1:  # libtpu's default host is 2x2x1 chips, which 1x1 does not fill
        options["chips_per_host_bounds"] = [1, 1, 1]
    desc = topologies.get_topology_desc(
        platform="tpu", topology_name=topology.libtpu_name, **options
    )
    found = sorted(desc.devices, key=lambda d: d.id)
    if len(found) != topology.chips:
        raise RuntimeError(
            f"libtpu gave {len(found)} devices for {topology.libtpu_name}, "
            f"expected {topology.chips}"
        )
    return found
