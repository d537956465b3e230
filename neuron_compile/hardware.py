"""Hardware targets: per-target constants (trn1, trn2, trn3), shared by the compiler and the simulator.

Every limit the tiling pass plans under, every limit the simulator enforces and every number the cost model uses
comes from here, so that a target is one table. Sources: shared NKI reference (nki-spec.md §1.6 and §2), which cites the Neuron SDK architecture
guides for trn1/trn2/trn3 and NKIPy's HardwareConstants.h for the usable SBUF bytes per partition.

The target is chosen by ``NEURON_PLATFORM_TARGET_OVERRIDE`` (``trn1|inf2|gen2``, ``trn2|gen3``,
``trn3|gen4``), default trn2, as the real ``nki`` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    nc_version: str  # gen2 / gen3 / gen4, as nisa.nc_version names them
    # --- on-chip memory ---
    partitions: int  # SBUF and PSUM partitions (tile_size.pmax)
    sbuf_bytes_per_partition: int  # usable bytes per partition, after the compiler's reserve
    psum_bytes_per_partition: int  # 16 KiB
    psum_banks: int  # 8 banks of psum_bank_bytes each
    psum_bank_bytes: int  # 2 KiB per partition per bank = 512 fp32
    # --- engine tile limits ---
    gemm_stationary_fmax: int  # matmul stationary free size (becomes the dst partition count)
    gemm_moving_fmax: int  # matmul moving free size (one PSUM bank of fp32 on gen2/gen3)
    bn_stats_fmax: int
    sbuf_fmax: int  # Vector/Scalar/GpSimd free elements per partition on SBUF operands
    psum_fmax: int  # ... on PSUM operands
    vector_transpose_max: int  # VectorE nc_transpose limit (32x32)
    dma_transpose: bool  # the DMA engines transpose 2- and 4-byte elements on the way (nisa.dma_transpose, trn2+)
    # --- clocks and throughput (cost model) ---
    tensor_ghz: float
    vector_ghz: float
    scalar_ghz: float
    gpsimd_ghz: float
    tensor_bf16_tflops: float  # per NeuronCore, dense
    tensor_fp32_tflops: float
    hbm_bytes_per_s: float  # per chip
    dma_bytes_per_s: float  # sustained per NeuronCore (16 engines)
    dma_engines: int
    dma_fixed_overhead_ns: float  # per transfer
    vector_elems_per_cycle_bf16: int
    vector_elems_per_cycle_other: int


TRN1 = Target(
    name="trn1", nc_version="gen2", partitions=128,
    sbuf_bytes_per_partition=180224, psum_bytes_per_partition=16384, psum_banks=8, psum_bank_bytes=2048,
    gemm_stationary_fmax=128, gemm_moving_fmax=512, bn_stats_fmax=512, sbuf_fmax=65536, psum_fmax=4096,
    vector_transpose_max=32, dma_transpose=False,
    tensor_ghz=2.8, vector_ghz=1.12, scalar_ghz=1.4, gpsimd_ghz=1.4,
    tensor_bf16_tflops=92.0, tensor_fp32_tflops=23.0,
    hbm_bytes_per_s=820e9, dma_bytes_per_s=272e9, dma_engines=16, dma_fixed_overhead_ns=1300.0,
    vector_elems_per_cycle_bf16=128, vector_elems_per_cycle_other=128,
)

TRN2 = Target(
    name="trn2", nc_version="gen3", partitions=128,
    sbuf_bytes_per_partition=212984, psum_bytes_per_partition=16384, psum_banks=8, psum_bank_bytes=2048,
    gemm_stationary_fmax=128, gemm_moving_fmax=512, bn_stats_fmax=512, sbuf_fmax=65536, psum_fmax=4096,
    vector_transpose_max=32, dma_transpose=True,
    tensor_ghz=2.4, vector_ghz=0.96, scalar_ghz=1.2, gpsimd_ghz=1.2,
    tensor_bf16_tflops=79.0, tensor_fp32_tflops=20.0,
    hbm_bytes_per_s=2.9e12, dma_bytes_per_s=368e9, dma_engines=16, dma_fixed_overhead_ns=1300.0,
    vector_elems_per_cycle_bf16=512, vector_elems_per_cycle_other=256,
)

TRN3 = Target(
    name="trn3", nc_version="gen4", partitions=128,
    sbuf_bytes_per_partition=245752, psum_bytes_per_partition=16384, psum_banks=8, psum_bank_bytes=2048,
    gemm_stationary_fmax=128, gemm_moving_fmax=512, bn_stats_fmax=512, sbuf_fmax=65536, psum_fmax=4096,
    vector_transpose_max=32, dma_transpose=True,
    tensor_ghz=2.4, vector_ghz=0.96, scalar_ghz=1.2, gpsimd_ghz=1.2,
    tensor_bf16_tflops=79.0, tensor_fp32_tflops=20.0,
    hbm_bytes_per_s=4.7e12, dma_bytes_per_s=528e9, dma_engines=16, dma_fixed_overhead_ns=1300.0,
    vector_elems_per_cycle_bf16=512, vector_elems_per_cycle_other=256,
)

TARGETS = {"trn1": TRN1, "trn2": TRN2, "trn3": TRN3}
_ALIASES = {"trn1": "trn1", "inf2": "trn1", "gen2": "trn1", "trn2": "trn2", "gen3": "trn2", "trn3": "trn3",
            "gen4": "trn3"}


def get_target(name: str | None = None) -> Target:
    """The target named, else the one in NEURON_PLATFORM_TARGET_OVERRIDE, else trn2."""
    name = name or os.environ.get("NEURON_PLATFORM_TARGET_OVERRIDE") or "trn2"
    key = _ALIASES.get(name.strip().lower())
    if key is None:
        raise ValueError(
            f"unknown Neuron target {name!r}: expected one of {sorted(_ALIASES)} "
            "(NEURON_PLATFORM_TARGET_OVERRIDE or target=)"
        )
    return TARGETS[key]



def configured_target(config) -> Target:
    """The hardware target a Config names (None: the default target)."""
    return get_target(getattr(config, "target", None) if config is not None else None)
