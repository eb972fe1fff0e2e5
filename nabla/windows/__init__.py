"""Sliding-window ops on vectorised blocks (ONNX layout ``N, C, *spatial``): ``halos`` plans the rows each
ceil-rule shard needs from its neighbours and extends blocks to their input windows; ``kernels`` runs conv, max
pool and average pool on those windows for all devices at once (3x3 convs with many channels by ``winograd``,
with the helpers of ``arrays``)."""

from __future__ import annotations

from .halos import Halo, Piece, copy_plan, extend, extend_many, fill_value, halo, halo_bytes, out_size
from .kernels import avg_divisor, avg_divisor_blocks, avg_pool, conv, epilogue, max_pool, tap_counts


__all__ = ["Halo", "Piece", "avg_divisor", "avg_divisor_blocks", "avg_pool", "conv", "copy_plan", "epilogue",
           "extend", "extend_many", "fill_value", "halo", "halo_bytes", "max_pool", "out_size", "tap_counts"]
