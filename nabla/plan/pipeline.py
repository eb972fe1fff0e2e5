"""A pipelined job priced from one stage's report for one microbatch: the 1F1B or interleaved schedule's
bubble and the stage-to-stage sends (Narayanan et al., SC'21, sec. 2.2), and the memory of its first stage with
the microbatches the schedule keeps in flight (Korthikanti et al., MLSys'23, sec. 4.2.3). Pipelines sit outside
SPMD."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from ..errors import ShardingError
from ..args import is_int
from .cluster import Cluster
from .report import Report
from .schedule import NCCL_SMS

SCHEDULES = ("1f1b", "interleaved")


def in_flight(stages: int, microbatches: int, schedule: str = "1f1b", virtual_stages: int = 1) -> float:
    """Microbatches whose activations the first stage holds at once, in units of one microbatch through the
    whole stage. 1F1B: ``min(p, m)`` (it runs ``p - 1`` warm-up forwards, then one more before its first
    backward). Interleaved (Megatron-LM's ``get_num_warmup_microbatches``): ``2 (p - 1) + (v - 1) p`` warm-up
    chunk forwards plus one, each a ``1/v`` chunk: ``p (1 + (p - 1) / (p v))``, as Korthikanti et al. count
    it; never more than the ``m v`` chunks there are."""
    p, m, v = stages, microbatches, virtual_stages
    if schedule == "1f1b":
        return float(min(p, m))
    return min(2 * (p - 1) + (v - 1) * p + 1, m * v) / v


@dataclass(frozen=True)
class PipelineMemory:
    """Per device id of a stage: ``peak`` (the stage's own peak for one microbatch's forward and backward passes,
    plus the activations the schedule keeps of the other microbatches in flight, ``(in_flight - 1) * kept``; or
    its optimizer update's, which runs once when none is in flight) and ``by_kind`` (params,
    grads and optimizer state as the stage holds them; activations with the microbatches in flight), against
    ``capacity``. ``fits``: every device's peak within it."""

    peak: Mapping[int, int]
    by_kind: Mapping[str, Mapping[int, int]]
    capacity: int
    in_flight: float
    kept: Mapping[int, int]

    @property
    def fits(self) -> bool | None:
        return all(v <= self.capacity for v in self.peak.values()) if self.peak else None

    def __str__(self) -> str:
        top = max(self.peak.values(), default=0)
        return (f"memory: peak {top / 2**30:.2f} GiB of {self.capacity / 2**30:.2f} GiB per device with "
                f"{self.in_flight:g} microbatches in flight ({'fits' if self.fits else 'DOES NOT FIT'})")


@dataclass(frozen=True)
class PipelineReport:
    """One training step of ``stages`` stages over ``microbatches`` microbatches, each stage split in
    ``virtual_stages`` model chunks. Times in seconds, per device:

    ``step_time = (v*m + p - 1) * microbatch_time / v + p2p_time + grad_time``, of which
    ``bubble_time = (p - 1) * microbatch_time / v`` (a fraction ``(p - 1) / (v * m)`` of the ideal
    ``m * microbatch_time``). Each of the ``v*m + p - 1`` chunk steps sends an activation forward and a gradient
    back: ``p2p_time = 2 * (v*m + p - 1) * send_time`` when they block (``overlap_p2p`` False). Overlapped
    (the stage report's overlap has ``"p2p"``: Megatron-LM's ``--overlap-p2p-communication``, sends and receives
    posted before the chunk's compute and waited after it), a chunk step's two sends run beside its compute
    ``t = microbatch_time / v`` and show only where they outlast it, slowing it meanwhile by the SMs NCCL takes
    (``schedule.NCCL_SMS``, fraction ``f``); the fill and the drain still wait for every stage's send:
    ``p2p_time = 2 (p - 1) send_time + (v*m + p - 1) (max(0, 2 send_time - t) + f min(2 send_time, t))``.
    ``grad_time`` is the gradient reductions, once."""

    stage_report: Report
    stages: int
    microbatches: int
    schedule: str
    virtual_stages: int
    microbatch_time: float
    send_time: float
    grad_time: float
    overlap_p2p: bool = False
    stolen: float = 0.0  # the fraction of the SMs an overlapped send occupies

    @property
    def bubble_fraction(self) -> float:
        return (self.stages - 1) / (self.virtual_stages * self.microbatches)

    @property
    def bubble_time(self) -> float:
        return (self.stages - 1) * self.microbatch_time / self.virtual_stages

    @property
    def p2p_time(self) -> float:
        if not self.overlap_p2p:
            return 2 * self._chunk_steps * self.send_time
        t, two = self.microbatch_time / self.virtual_stages, 2 * self.send_time
        return 2 * (self.stages - 1) * self.send_time + self._chunk_steps * (max(0.0, two - t) + self.stolen * min(two, t))

    @property
    def _chunk_steps(self) -> int:
        return self.virtual_stages * self.microbatches + self.stages - 1

    @property
    def step_time(self) -> float:
        return (self.microbatches * self.microbatch_time + self.bubble_time + self.p2p_time + self.grad_time)

    @property
    def memory(self) -> PipelineMemory:
        """The first stage's memory: its parameters, gradients and optimizer state, and the activations of the
        microbatches the schedule holds in flight (the stage report's peak holds one)."""
        mem = self.stage_report.memory
        if not mem.recorded:
            raise ShardingError("pipeline_estimate: the stage report has no memory record (made by nb.estimate, it "
                                "has one)")
        n = in_flight(self.stages, self.microbatches, self.schedule, self.virtual_stages)
        extra = {d: int(round((n - 1) * mem.kept.get(d, 0))) for d in mem.peak}
        peak = {d: b + extra[d] for d, b in mem.peak.items()}
        costs = self.stage_report.timeline.costs
        if mem.live and len(mem.live) == len(costs):
            # the other microbatches are in flight during the forward and backward passes, not during an update
            # the stage program runs after them (once per step, when no activation is alive)
            last = max((i for i, c in enumerate(costs) if c.phase in ("backward", "recompute")), default=len(costs) - 1)
            passes, after = max(mem.live[:last + 1], default=0), max(mem.live[last + 1:], default=0)
            top = max(mem.peak.values(), default=0)
            peak = {d: (max(passes + extra[d], after) if b == top else b + extra[d]) for d, b in mem.peak.items()}
        by_kind = {k: MappingProxyType({d: b + (extra.get(d, 0) if k == "activations" else 0) for d, b in v.items()})
                   for k, v in mem.by_kind.items()}
        return PipelineMemory(MappingProxyType(peak), MappingProxyType(by_kind), mem.capacity, n, mem.kept)

    @property
    def tflops_per_device(self) -> float:
        return self.microbatches * self.stage_report.flops / self.step_time / 1e12

    @property
    def mfu(self) -> float:
        return self.microbatches * self.stage_report.model_flops / self.step_time / self.stage_report.peak_flops

    def __str__(self) -> str:
        return (f"pipeline {self.schedule} p={self.stages} m={self.microbatches} v={self.virtual_stages}: step "
                f"{self.step_time * 1e3:.3f} ms (bubble {self.bubble_time * 1e3:.3f} ms = "
                f"{self.bubble_fraction:.1%}, p2p {self.p2p_time * 1e3:.3f} ms, gradients "
                f"{self.grad_time * 1e3:.3f} ms) | {self.tflops_per_device:.1f} TFLOP/s per device | "
                f"MFU {self.mfu:.1%}" + (f"\n{self.memory}" if self.stage_report.memory.recorded else ""))


def pipeline_estimate(stage_report: Report, stages: int, microbatches: int, schedule: str = "1f1b",
                      virtual_stages: int = 1, p2p_bytes: int | None = None,
                      cluster: Cluster | None = None) -> PipelineReport:
    """Price a pipeline of ``stages`` copies of the stage that ``stage_report`` estimated for one microbatch
    (forward and backward, gradient reductions included: they are taken out of each microbatch and paid
    once). ``p2p_bytes``: what each device sends at a stage boundary per microbatch (default none); a
    send runs on the network when the job's stages span nodes (``stages * stage size > devices_per_node``
    of ``cluster``, default the stage's cluster), else on NVLink. Sends overlap the compute when the stage
    report's ``overlap`` has ``"p2p"`` (``PipelineReport``)."""
    for what, v in (("stages", stages), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not is_int(v) or v < 1:
            raise ShardingError(f"pipeline_estimate: {what} must be an int >= 1, got {v!r}")
    if schedule not in SCHEDULES:
        raise ShardingError(f"pipeline_estimate: schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if schedule == "1f1b" and virtual_stages != 1:
        raise ShardingError(f"pipeline_estimate: the 1f1b schedule has one model chunk per stage, got "
                            f"virtual_stages={virtual_stages}; use schedule='interleaved'")
    if schedule == "interleaved" and microbatches % stages:
        raise ShardingError(f"pipeline_estimate: the interleaved schedule needs microbatches ({microbatches}) to "
                            f"be a multiple of stages ({stages}), as in Megatron-LM")
    if not isinstance(stage_report, Report):
        raise ShardingError(f"pipeline_estimate: stage_report must be a Report, got {type(stage_report).__name__}")
    cluster = stage_report.cluster if cluster is None else cluster
    send = 0.0
    if p2p_bytes:
        if not is_int(p2p_bytes) or p2p_bytes < 0:
            raise ShardingError(f"pipeline_estimate: p2p_bytes must be an int >= 0, got {p2p_bytes!r}")
        tier = "network" if stages * stage_report.mesh.size > cluster.devices_per_node else "nvlink"
        latency, bandwidth = cluster.hardware.link(tier)
        send = latency + p2p_bytes / bandwidth
    per_microbatch = stage_report.step_time - stage_report.exposed_grad_comm
    sms = cluster.hardware.sms
    return PipelineReport(stage_report, int(stages), int(microbatches), schedule, int(virtual_stages),
                          per_microbatch, send, stage_report.exposed_grad_comm, "p2p" in stage_report.overlaps,
                          min(NCCL_SMS / sms, 0.9) if sms else 0.0)
