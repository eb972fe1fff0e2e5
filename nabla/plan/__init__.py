"""Planning on a real cluster from recorded steps: hardware and clusters as data, and pure functions that price
kernels, collectives, schedules and pipelines. Reads steps only; the executor records them."""

from .cluster import Cluster, Tier
from .comm import Phase, event_time, phases
from .compute import kernel_time
from .hardware import Hardware
from .report import MemoryReport, Report, estimate_steps
from .schedule import Interval, StepCost, Timeline, simulate
from .steps import MATMUL_OPS, Step, StepLike, is_grad_reduction

__all__ = ["Cluster", "Hardware", "Interval", "MATMUL_OPS", "MemoryReport", "Phase", "Report", "Step", "StepCost",
           "StepLike", "Tier", "Timeline", "estimate_steps", "event_time", "is_grad_reduction", "kernel_time",
           "phases", "simulate"]
