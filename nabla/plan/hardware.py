"""Hardware: one accelerator and its links as numbers (peaks, capacities, latencies, achievable fractions),
every one sourced; presets for A100 and H100 SXM nodes. Pricing lives in compute.py and comm.py."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from ..errors import ShardingError

#: Link tiers a collective can run on (cluster.py decides which).
TIERS = ("nvlink", "network")


@dataclass(frozen=True)
class Hardware:
    """One accelerator of a cluster node, its memory and its links; frozen and hashable.

    Every field is overridable: ``hw.replace(hbm_bytes=40 * 2**30)``. Units are SI: FLOP/s, bytes, bytes/s,
    seconds. Link bandwidths are per GPU and per direction (what one device sends while it also receives),
    so a ring collective that sends ``bytes`` per device takes ``bytes / (bandwidth * efficiency)``.

    - ``peak_flops``: dense (no sparsity) tensor-core FLOP/s per dtype name (``"bfloat16"``, ``"float16"``,
      ``"float32"``, ``"tf32"``, ``"float64"``, ``"float8"``); a float8 dtype (``float8_e4m3fn``, ...) uses
      ``"float8"``. ``float32`` matmuls use ``"tf32"`` when ``allow_tf32`` is set.
    - ``vector_flops``: non-tensor FP32 FLOP/s, the compute roof of every op that is not a matmul.
    - ``matmul_efficiency``: rows ``(min_flops, fraction)``, sorted by ``min_flops``: a matmul-class kernel of
      at least ``min_flops`` FLOPs per device reaches ``fraction`` of ``peak_flops`` (the last row that
      applies wins). Presets have one row, the best measured large-GEMM fraction; add rows below it to
      make small matmuls slower. ``matmul_efficiency_by_dtype`` maps a ``peak_flops`` key to its own rows (or
      one fraction) where a dtype's GEMMs reach a different fraction (H100's float8: 70.9%, bfloat16 80.1%).
    - ``attention_efficiency``: ``(forward, backward)`` fractions of the peak that a fused attention kernel
      (``nb.dot_product_attention``: FlashAttention, cuDNN) reaches on its counted FLOPs; ``None`` prices it
      as a matmul.
    - ``sms``: streaming multiprocessors (0: not given). A collective that runs beside compute occupies some of
      them (``schedule.py`` states how many), slowing the compute by that fraction while it runs.
    - ``hbm_efficiency``, ``nvlink_efficiency``, ``network_efficiency``: achievable fractions of the
      nominal bandwidths.
    - ``nvlink_latency``, ``network_latency``: seconds per ring step on that tier.
    - ``tree_latency``, ``tree_efficiency``: an all_reduce across nodes may run as NCCL's double binary tree
      instead of a ring, whichever NCCL's own model finds faster: ``2 log2(nodes)`` hops of ``tree_latency``
      each, at ``tree_efficiency`` of the ring's bandwidth. Defaults from NCCL's tuning model
      (NVIDIA/nccl src/graph/tuning.cc: hwLat NET Tree/Simple 50 us; tree bus bandwidth ``busBw * .9``).
      At 2,048 nodes a ring pays 4,094 latencies, the tree 22.
    """

    name: str
    peak_flops: Any  # Mapping[str, float]; stored as sorted (name, FLOP/s) pairs
    vector_flops: float
    hbm_bytes: int
    hbm_bandwidth: float
    nvlink_bandwidth: float
    network_bandwidth: float
    nvlink_latency: float
    network_latency: float
    matmul_efficiency: Any = ((0, 1.0),)  # Sequence[tuple[int, float]]
    hbm_efficiency: float = 1.0
    nvlink_efficiency: float = 1.0
    network_efficiency: float = 1.0
    allow_tf32: bool = False
    tree_latency: float = 50e-6
    tree_efficiency: float = 0.9
    matmul_efficiency_by_dtype: Any = ()  # Mapping[str, rows | float]; stored as sorted (key, rows) pairs
    attention_efficiency: Any = None  # (forward, backward) fractions, or None: as a matmul
    sms: int = 0

    def __post_init__(self) -> None:
        who = f"Hardware {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ShardingError(f"Hardware: name must be a non-empty str, got {self.name!r}")
        peaks = self.peak_flops.items() if isinstance(self.peak_flops, Mapping) else self.peak_flops
        try:
            peaks = tuple(sorted((str(k), _positive(v, f"{who}: peak_flops[{k!r}]")) for k, v in peaks))
        except (TypeError, ValueError):
            raise ShardingError(f"{who}: peak_flops must map dtype names to FLOP/s, got {self.peak_flops!r}") from None
        if not peaks:
            raise ShardingError(f"{who}: peak_flops is empty; give at least one dtype's FLOP/s")
        object.__setattr__(self, "peak_flops", peaks)
        for f in ("vector_flops", "hbm_bandwidth", "nvlink_bandwidth", "network_bandwidth"):
            object.__setattr__(self, f, _positive(getattr(self, f), f"{who}: {f}"))
        if isinstance(self.hbm_bytes, bool) or not isinstance(self.hbm_bytes, (int, np.integer)) or self.hbm_bytes <= 0:
            raise ShardingError(f"{who}: hbm_bytes must be a positive int, got {self.hbm_bytes!r}")
        object.__setattr__(self, "hbm_bytes", int(self.hbm_bytes))
        for f in ("nvlink_latency", "network_latency", "tree_latency"):
            object.__setattr__(self, f, _positive(getattr(self, f), f"{who}: {f}", zero_ok=True))
        for f in ("hbm_efficiency", "nvlink_efficiency", "network_efficiency", "tree_efficiency"):
            object.__setattr__(self, f, _fraction(getattr(self, f), f"{who}: {f}"))
        try:
            rows = tuple(sorted((int(m), _fraction(e, f"{who}: matmul_efficiency")) for m, e in self.matmul_efficiency))
        except (TypeError, ValueError):
            raise ShardingError(f"{who}: matmul_efficiency must be rows (min_flops, fraction), got "
                                f"{self.matmul_efficiency!r}") from None
        if not rows or rows[0][0] > 0:
            raise ShardingError(f"{who}: matmul_efficiency needs a row for min_flops 0, got {rows!r}")
        object.__setattr__(self, "matmul_efficiency", rows)
        by = self.matmul_efficiency_by_dtype
        by = by.items() if isinstance(by, Mapping) else by
        try:
            by = tuple(sorted((dtype_key(k), _rows(v, f"{who}: matmul_efficiency_by_dtype[{k!r}]")) for k, v in by))
        except (TypeError, ValueError):
            raise ShardingError(f"{who}: matmul_efficiency_by_dtype must map dtype names to rows (min_flops, "
                                f"fraction) or a fraction, got {self.matmul_efficiency_by_dtype!r}") from None
        object.__setattr__(self, "matmul_efficiency_by_dtype", by)
        if self.attention_efficiency is not None:
            try:
                fwd, bwd = self.attention_efficiency
            except (TypeError, ValueError):
                raise ShardingError(f"{who}: attention_efficiency must be (forward, backward) fractions or None, got "
                                    f"{self.attention_efficiency!r}") from None
            object.__setattr__(self, "attention_efficiency", (_fraction(fwd, f"{who}: attention_efficiency"),
                                                              _fraction(bwd, f"{who}: attention_efficiency")))
        if isinstance(self.sms, bool) or not isinstance(self.sms, (int, np.integer)) or self.sms < 0:
            raise ShardingError(f"{who}: sms must be an int >= 0 (streaming multiprocessors; 0: not given), got "
                                f"{self.sms!r}")
        object.__setattr__(self, "sms", int(self.sms))
        if not isinstance(self.allow_tf32, bool):
            raise ShardingError(f"{who}: allow_tf32 must be a bool, got {self.allow_tf32!r}")

    @classmethod
    def preset(cls, name: str) -> "Hardware":
        """``"a100-sxm-80gb"`` or ``"h100-sxm-80gb"``: the numbers and their sources are in ``PRESETS``' docs."""
        try:
            return PRESETS[name]
        except (KeyError, TypeError):
            raise ShardingError(f"Hardware.preset: unknown preset {name!r}; known: {sorted(PRESETS)}") from None

    def replace(self, **fields: Any) -> "Hardware":
        """A copy with ``fields`` changed (validated like a new one)."""
        known = {f.name for f in dataclasses.fields(self)}
        bad = sorted(set(fields) - known)
        if bad:
            raise ShardingError(f"Hardware.replace: unknown field(s) {bad}; fields are {sorted(known)}")
        return dataclasses.replace(self, **fields)

    def peak(self, dtype: Any) -> float:
        """Dense tensor-core FLOP/s for a matmul computing in ``dtype``."""
        key = dtype_key(dtype)
        if key == "float32" and self.allow_tf32:
            key = "tf32"
        table = dict(self.peak_flops)
        if key not in table:
            raise ShardingError(f"Hardware {self.name!r}: no peak FLOP/s for dtype {key!r} "
                                f"(peak_flops has {sorted(table)}); add it with hw.replace(peak_flops=...)")
        return table[key]

    def matmul_fraction(self, flops: float, dtype: Any = None) -> float:
        """The achievable fraction of peak for a matmul-class kernel of ``flops`` FLOPs per device computing in
        ``dtype`` (its own rows in ``matmul_efficiency_by_dtype`` when it has some)."""
        rows = self.matmul_efficiency
        if dtype is not None and self.matmul_efficiency_by_dtype:
            key = dtype_key(dtype)
            if key == "float32" and self.allow_tf32:
                key = "tf32"
            rows = dict(self.matmul_efficiency_by_dtype).get(key, rows)
        frac = rows[0][1]
        for min_flops, f in rows:
            if flops >= min_flops:
                frac = f
        return frac

    def link(self, tier: str) -> tuple[float, float]:
        """(seconds per ring step, achievable bytes/s per device per direction) of a link tier."""
        if tier == "nvlink":
            return self.nvlink_latency, self.nvlink_bandwidth * self.nvlink_efficiency
        if tier == "network":
            return self.network_latency, self.network_bandwidth * self.network_efficiency
        raise ShardingError(f"Hardware {self.name!r}: unknown link tier {tier!r}; tiers are {list(TIERS)}")


def dtype_key(dtype: Any) -> str:
    """The ``peak_flops`` key of a dtype: its numpy name, with every float8 variant as ``"float8"``."""
    try:
        return _dtype_key(dtype)  # (remembered: pricing a large step asks tens of thousands of times, of a few)
    except TypeError:  # an unhashable dtype-like
        return _dtype_key.__wrapped__(dtype)


@lru_cache(maxsize=256)
def _dtype_key(dtype: Any) -> str:
    if isinstance(dtype, str) and dtype in ("tf32", "float8"):
        return dtype
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = str(dtype)
    return "float8" if name.startswith("float8") else name


def _positive(v: Any, what: str, zero_ok: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v) \
            or v < 0 or (v == 0 and not zero_ok):
        raise ShardingError(f"{what} must be a finite number {'>= 0' if zero_ok else '> 0'}, got {v!r}")
    return float(v)


def _rows(v: Any, what: str) -> tuple[tuple[int, float], ...]:
    """Efficiency rows ``(min_flops, fraction)`` sorted, from rows or one fraction (a row at 0)."""
    if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
        return ((0, _fraction(v, what)),)
    rows = tuple(sorted((int(m), _fraction(e, what)) for m, e in v))
    if not rows or rows[0][0] > 0:
        raise ShardingError(f"{what}: needs a row for min_flops 0, got {rows!r}")
    return rows


def _fraction(v: Any, what: str) -> float:
    v = _positive(v, what)
    if v > 1:
        raise ShardingError(f"{what} is a fraction of peak and must be in (0, 1], got {v!r}")
    return v


GB = 10**9
MiB = 2**20

A100_SXM_80GB = Hardware(
    name="a100-sxm-80gb",
    # NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), dense Tensor Core figures:
    # BF16/FP16 312 TFLOP/s, TF32 156, FP64 Tensor Core 19.5; FP32 (CUDA cores) 19.5. Also tabulated at
    # glennklockwood.com/garden/processors/A100. Megatron-LM (Narayanan et al. SC'21) computes its
    # percentages against the same 312 TFLOP/s.
    peak_flops={"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12, "float64": 19.5e12},
    vector_flops=19.5e12,
    # nvidia-smi reports 81920 MiB for "NVIDIA A100-SXM4-80GB".
    hbm_bytes=81920 * MiB,
    # Datasheet: 2,039 GB/s HBM2e for the 80GB SXM part.
    hbm_bandwidth=2039 * GB,
    # Datasheet: NVLink 600 GB/s (bidirectional: 300 GB/s each way per GPU, 12 links of 25 GB/s).
    nvlink_bandwidth=300 * GB,
    # DGX A100 / Selene: eight 200 Gb/s HDR InfiniBand HCAs per node, one per GPU (Narayanan et al. 2021,
    # sec. 5): 200 Gb/s = 25 GB/s per GPU per direction.
    network_bandwidth=25 * GB,
    # NCCL's own tuning model (NVIDIA/nccl src/graph/tuning.cc, hwLat, Ring/Simple): 3.4 us per NVLink
    # step, 9.6 us per network step.
    nvlink_latency=3.4e-6,
    network_latency=9.6e-6,
    # Maximum achievable matmul FLOPS, BF16, A100 SXM: 267.9 of 312 TFLOP/s = 85.9%
    # (stas00/ml-engineering, compute/accelerator/README.md, "MAMF comparison table", CUDA 12.1).
    # One row: the one published table by size found, Calculon's (Isaev et al., SC'23; calculon-ai/calculon
    # systems/a100_80g.json at 71f6435: ops of >= 128 GFLOP 0.95, >= 16 0.9, >= 1 0.6, smaller 0.1), is not a
    # measurement: its history sets it in the commit adding Calculon's validation tool (3a082fe) and lowers the
    # top row in "Tuning systems for validation" (cfce06b), against Korthikanti et al.'s Table 5, which
    # benchmarks/time_published.py checks; its 0.95 is above the 85.9% measured (docs/planning.md, "Checking
    # against published runs", has what it would do).
    matmul_efficiency=((0, 0.859),),
    # A read kernel reaches 1.80 of 2.04 TB/s (88%) on A100 80GB SXM, confirmed by Nsight Compute; the best
    # kernels in NVIDIA's GTC material reach about 90% (forums.developer.nvidia.com, "Trouble to reach
    # peak bandwidth of A100", 2025).
    hbm_efficiency=0.88,
    # nccl-tests all_reduce_perf on one 8x A100 node: busbw 232.54 GB/s (NVIDIA/nccl issue 1048) of 300;
    # NCCL's model caps sm80 bus bandwidth at 235 GB/s (tuning.cc). 232.5 / 300 = 0.775.
    nvlink_efficiency=0.775,
    # nccl-tests between two HGX A100 nodes with four 200 Gb/s HDR HCAs: busbw 91 GB/s of 100
    # (NVIDIA/nccl-tests issue 100); one HCA alone reached 24 of 25 GB/s (NVIDIA/nccl issue 1048).
    network_efficiency=0.91,
    # FlashAttention-2 (Dao 2023, arXiv:2307.08691, abstract): "reaching 50-73% of the theoretical maximum
    # FLOPs/s on A100"; its forward pass is the fast end, its backward pass the slow one (its Fig. 5 and 6).
    attention_efficiency=(0.73, 0.50),
    # A100 datasheet / whitepaper: 108 SMs.
    sms=108,
)

H100_SXM_80GB = Hardware(
    name="h100-sxm-80gb",
    # NVIDIA H100 SXM datasheet, dense figures (the datasheet lists them with sparsity: halve them):
    # BF16/FP16 989 TFLOP/s, FP8 1,979, TF32 494.5, FP64 Tensor Core 67; FP32 (CUDA cores) 67.
    # Also glennklockwood.com/garden/processors/h100 (989.4 / 1978.9 / 494.7 / 66.9).
    peak_flops={"bfloat16": 989e12, "float16": 989e12, "float8": 1979e12, "tf32": 494.5e12,
                "float32": 67e12, "float64": 67e12},
    vector_flops=67e12,
    # nvidia-smi reports 81559 MiB for "NVIDIA H100 80GB HBM3".
    hbm_bytes=81559 * MiB,
    # Datasheet: 3.35 TB/s HBM3.
    hbm_bandwidth=3350 * GB,
    # Datasheet: NVLink 900 GB/s (bidirectional: 450 GB/s each way per GPU, 18 links).
    nvlink_bandwidth=450 * GB,
    # DGX H100: eight ConnectX-7 400 Gb/s NDR InfiniBand ports, one per GPU: 50 GB/s per direction.
    network_bandwidth=50 * GB,
    nvlink_latency=3.4e-6,  # NCCL tuning.cc, as for A100
    network_latency=9.6e-6,
    # Maximum achievable matmul FLOPS, BF16, H100 SXM: 792.1 of 989 TFLOP/s = 80.1% (stas00/ml-engineering).
    # Calculon's H100 file (systems/h100_80g_nvl8.json) repeats its A100 fractions by size for float16 and float8:
    # not taken, as for the A100.
    matmul_efficiency=((0, 0.801),),
    # No vendor-neutral STREAM figure for H100 SXM was found; the ~90% ceiling of the A100 source above,
    # less its 2 points of margin, is carried over.
    hbm_efficiency=0.88,
    # ASTRA-sim's validation on HGX-H100 (NCCL ring all-reduce, 8 GPUs): "the maximum achieved BW is
    # 741.34 GB/s (bidirectional)" of 900 (astra-sim.github.io/astra-sim-docs/validation/hardware/
    # gpu-validation-hgx-h100.html): 0.824.
    nvlink_efficiency=0.824,
    # NVIDIA's NCCL maintainers: "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (NVIDIA/nccl-tests
    # issue 290): 47 / 50 = 0.94.
    network_efficiency=0.94,
    # Maximum achievable matmul FLOPS, FP8 (float8_e4m3fn), H100 SXM: 1,402.6 of 1,979 TFLOP/s = 70.9%
    # (stas00/ml-engineering, compute/accelerator/README.md, MAMF table "FP8", torch 2.7.0+cu126).
    matmul_efficiency_by_dtype={"float8": 0.709},
    # FlashAttention-2 on H100 SXM5, head dim 128, sequence 16k (Shah et al. 2024, FlashAttention-3,
    # arXiv:2407.08608, Fig. 5 and 6, the FlashAttention-2 bars): forward 370 TFLOP/s, backward 322, of 989: 0.374,
    # 0.326 (its abstract: "FlashAttention-2 achieving only 35% utilization on the H100 GPU"). The same figures give
    # cuDNN's kernels of mid-2024 595 and 516 (0.60, 0.52) and FlashAttention-3 648 and 561: a stack known to run
    # those passes hw.replace(attention_efficiency=...). How either choice does against measured runs of 2024:
    # docs/planning.md, "Checking against published runs".
    attention_efficiency=(0.374, 0.326),
    # H100 SXM5 datasheet / Hopper whitepaper: 132 SMs.
    sms=132,
)

#: The named presets of ``Hardware.preset`` (values, so nothing here can change).
PRESETS: Mapping[str, Hardware] = MappingProxyType({h.name: h for h in (A100_SXM_80GB, H100_SXM_80GB)})
