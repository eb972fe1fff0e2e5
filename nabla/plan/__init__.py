"""Planning on a real cluster from recorded steps: hardware and clusters as data, and pure functions that price
kernels, collectives, schedules and pipelines. Reads steps only; the executor records them."""

from .cluster import Cluster, Tier
from .comm import Phase, event_time, phases
from .compute import kernel_time, kernel_times
from .estimate import priced_step
from .formulas import gpt_flops, gpt_params, zero_model_state_bytes
from .hardware import Hardware
from .pipeline import PipelineReport, pipeline_estimate
from .report import MemoryReport, Report, estimate_steps
from .schedule import Interval, StepCost, Timeline, simulate
from .steps import MATMUL_OPS, PricedStep, StepLike, is_grad_reduction

__all__ = [
    "Cluster", "Hardware", "Interval", "MATMUL_OPS", "MemoryReport", "Phase", "PipelineReport", "Report", "PricedStep",
    "StepCost", "StepLike", "Tier", "Timeline", "estimate_steps", "event_time", "gpt_flops", "gpt_params",
    "is_grad_reduction", "kernel_time", "kernel_times", "phases", "pipeline_estimate", "priced_step", "simulate",
    "zero_model_state_bytes",
]
