"""GPU types for the analytic layout model (``partition.gpu``): memory, peak, links,
and the sustained matrix rate by GEMM size.

A rate depends on the shape of the matrix products, not only on the GPU: a layer
split eight ways by tensor parallelism multiplies by ``h/8``-wide weight shards,
which run further below peak than a whole layer's. The sustained rate of a GEMM
whose narrow weight dimension is ``d`` (``h/t`` for a layer's projections, ``h``
for the vocabulary-parallel head) is modelled as

    rate(d) = rate_max * d / (d + d_half)

``rate_max`` per GPU family and the shared ``d_half`` are fitted to the calibration
half of the published runs in ``partition/references.toml`` (``partition.gpu_refs``;
the held-out half is never used for them): ``GpuType.rate_table()`` prints the
result. The hardware figures below are the vendors' data sheets (bf16 dense peak,
HBM and NVLink bandwidth); the per-GPU network is the clusters' of the published
runs (8 x 200 Gbit/s HDR per DGX A100 node, 400 Gbit/s per H100 in torchtitan's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GiB = 2**30

D_HALF = 0.0
"""GEMM width at which the sustained rate is half of ``rate_max`` (fitted on the
calibration half, shared by all GPU families; see ``partition.gpu_refs``)."""

RATE_MAX = {"a100": 180e12, "h100": 375e12}
"""Sustained bf16 FLOP/s of very wide GEMMs inside training steps, per family
(fitted on the calibration half; see ``partition.gpu_refs``)."""

MEMORY_PASSES = 7.0
"""HBM passes of memory-bound work (norms, activation functions, residuals,
unfused softmax) over the bytes a layer keeps per token (fitted on the
calibration half, shared by all GPU families)."""


@dataclass(frozen=True)
class GpuType:
    """One GPU part: what the layout model needs to know of it."""

    name: str
    family: str  # the rate curve it uses: a100 | h100
    memory_bytes: int  # HBM capacity
    peak_flops_per_s: float  # bf16 dense, for MFU
    hbm_bytes_per_s: float  # for the optimizer step
    nvlink_bytes_per_s: float  # per direction, within a host
    network_bytes_per_s: float  # per GPU, across hosts
    gpus_per_host: int = 8
    rate_max: float | None = None  # None: the family's fitted ``RATE_MAX``
    d_half: float | None = None  # None: the fitted ``D_HALF``

    def rate(self, d: float) -> float:
        """Sustained FLOP/s of a GEMM whose narrow weight dimension is ``d``."""
        top = RATE_MAX[self.family] if self.rate_max is None else self.rate_max
        half = D_HALF if self.d_half is None else self.d_half
        return top * d / (d + half)

    def rate_table(
        self, widths: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)
    ) -> str:
        """Achieved TFLOP/s by GEMM width, as a one-line table."""
        cells = ", ".join(f"{d}: {self.rate(d) / 1e12:.0f}" for d in widths)
        return f"{self.name} sustained TFLOP/s by GEMM width d ({cells})"


_A100_NET = 25e9  # 8 x 200 Gbit/s HDR InfiniBand per 8-GPU node
_H100_NET = 50e9  # 400 Gbit/s per GPU

GPUS: dict[str, GpuType] = {
    "a100-40": GpuType("a100-40", "a100", 40 * GiB, 312e12, 1.555e12, 300e9, _A100_NET),
    "a100-80": GpuType("a100-80", "a100", 80 * GiB, 312e12, 2.039e12, 300e9, _A100_NET),
    "h100-80": GpuType("h100-80", "h100", 80 * GiB, 989e12, 3.35e12, 450e9, _H100_NET),
    # H100 NVL: PCIe card, NVLink bridges between pairs only (600 GB/s both ways)
    "h100-94": GpuType("h100-94", "h100", 94 * GiB, 835e12, 3.9e12, 300e9, _H100_NET),
    # the 96 GB HBM2e SXM H100 of torchtitan's runs (2.4 TB/s, 500 W; its peak lies
    # between SXM and NVL, torchtitan divides by the SXM figure, as we do)
    "h100-96": GpuType("h100-96", "h100", 96 * GiB, 989e12, 2.4e12, 450e9, _H100_NET),
}
ALIASES = {
    "h100-nvl": "h100-94",
    "gh200": "h100-96",
    "a100": "a100-80",
    "h100": "h100-80",
}


def gpu_type(name: str) -> GpuType:
    """The GPU part named ``name`` (case-insensitive; aliases included).

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    key = ALIASES.get(name.lower(), name.lower())
    if key not in GPUS:
        known = ", ".join([*GPUS, *ALIASES])
        raise ValueError(f"unknown GPU type {name!r}; give one of {known}")
    gpu = GPUS[key]
    return gpu if key == name.lower() else replace(gpu, name=name.lower())
