"""A device's timeline for a program of steps: a compute stream and a comm stream, collectives blocking or, under
``overlap``, scheduled as the fastest stacks run them (gradient sums, prefetched parameter gathers, TP collectives
pipelined with their GEMMs), each still taking the SMs its kernels occupy from the compute beside it."""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable, NamedTuple, Sequence

from ..errors import ShardingError
from ..mesh import DeviceMesh
from .cluster import Cluster
from .comm import event_time
from .compute import kernel_times
from .fusion import EXECUTOR_OPS, kind as fusion_kind
from .steps import MATMUL_OPS, StepLike, is_grad_reduction

#: What ``overlap`` may name (api.md): gradient sums, parameter gathers, tensor-parallel collectives, pipeline sends
OVERLAP_MODES = ("grads", "params", "tp", "p2p")

#: SMs a collective's kernels occupy while compute runs beside them, and the chunks a pipelined one is cut into.
#: NCCL (gradient sums, FSDP and optimizer gathers): "the concurrent ncclAllGather kernel launches 24 blocks" on
#: an H100, one per SM, seen in Nsight Systems (forums.developer.nvidia.com, "Compute-communication overlap causes
#: severe GEMM performance degradation because of tail effect", 2025); taken for every GPU (no other count found).
NCCL_SMS = 24
#: Transformer Engine's userbuffers, as Megatron-LM's ``--tp-comm-overlap`` runs them (NVIDIA/TransformerEngine,
#: transformer_engine/pytorch/module/base.py, ``initialize_ub``'s ``get_default_config``): an all_gather feeding a
#: GEMM is a "ring_exchange" in ``tp_size`` chunks on 1 SM (the copy engines move the data); a reduce_scatter of a
#: GEMM's result is a "pipeline" of 4 chunks on 16 SMs; the backward pass's other overlaps are "bulk", 16 SMs.
RING_SMS, PIPELINE_SMS, PIPELINE_SPLITS, BULK_SMS = 1, 16, 4, 16


def overlap_modes(overlap: Any, who: str = "estimate") -> frozenset[str]:
    """The modes ``overlap`` turns on: ``"none"``, ``"grads"``, ``"all"``, one mode, or a tuple of them."""
    if isinstance(overlap, str):
        items: tuple = () if overlap == "none" else (overlap,)
    else:
        try:
            items = tuple(overlap)
        except TypeError:
            items = (overlap,)
    bad = [m for m in items if not isinstance(m, str) or m not in OVERLAP_MODES + ("all",)]
    if bad or (not isinstance(overlap, str) and not items):
        raise ShardingError(f"{who}: overlap must be 'none', 'grads', 'all' or a tuple of {list(OVERLAP_MODES)}, "
                            f"got {overlap!r}")
    return frozenset(OVERLAP_MODES) if "all" in items else frozenset(items)


class Interval(NamedTuple):
    """One busy span of a stream (``"compute"`` or ``"comm"``), in seconds from the start of the step."""

    stream: str
    start: float
    end: float
    step: int  # index of the step in program order
    name: str  # the kernel op, or the collective kind
    layer: str | None
    user: str


class StepCost(NamedTuple):
    """What one step cost: its kernel, its collectives, and how far it held back the compute stream beyond
    its kernel (``exposed``: waiting for collectives, or its kernel slowed by one running beside it; the comm
    stream's tail after the last kernel is charged to the step it ran for)."""

    index: int
    layer: str | None
    user: str
    phase: str
    kernel: float
    comm: float
    exposed: float
    flops: int
    kernel_of: int = -1  # the first step of the kernel this step's work ran in (itself unless fused)


class Timeline(NamedTuple):
    """The schedule of one device. ``exposed_comm = step_time - compute_time``: time the compute stream waits."""

    intervals: tuple[Interval, ...]
    costs: tuple[StepCost, ...]
    step_time: float
    compute_time: float
    comm_time: float

    @property
    def exposed_comm(self) -> float:
        return self.step_time - self.compute_time


def simulate(steps: Iterable[StepLike], cluster: Cluster, mesh: DeviceMesh, overlap: Any = "none",
             drop_grad_comm: bool = False, fusion: bool = True,
             kernels: tuple[Sequence[float], Sequence[int]] | None = None, durations: dict | None = None) -> Timeline:
    """Lay ``steps`` (program order) out on a compute and a comm stream. A step's collectives run before its
    kernel, in order on the comm stream. A collective not overlapped waits for the compute before it and the
    compute after it waits for it. ``overlap`` (``overlap_modes``) overlaps, each as a stack schedules it:

    - ``"grads"``: gradient sums (backward steps run for ``"grad of ..."``, and what an optimizer update sums
      after the backward pass) start when their data is ready and the comm stream is free; nothing waits for
      them until the step ends (DDP, FSDP, Megatron's ``--overlap-grad-reduce``).
    - ``"params"``: an all_gather of a parameter (a value no step made: an argument; or a cast or view of one
      alone, as float8 or bf16 copies of weights are gathered) starts as soon as the compute
      reaches the layer (``nb.named_scope`` run of steps) before its own: prefetched one layer ahead, as FSDP
      does; the step that reads it waits for it. The parameter all_gathers after the backward pass (a distributed
      optimizer's, of the updated parameters) run at the start of the step, under the next forward pass, which
      they must finish within (Megatron's ``--overlap-param-gather``).
    - ``"tp"``: the other collectives (tensor- and context-parallel activations) as Transformer Engine's
      userbuffers run them: one that feeds a matmul-class kernel is pipelined with it in ``k`` chunks (the ring
      exchange: chunk ``i + 1`` moves while chunk ``i`` multiplies); one on a matmul's result (through
      elementwise steps only) in ``PIPELINE_SPLITS`` chunks; any other starts when its data is ready, no earlier
      than the kernel before its reader, and its reader waits.

    A pipelined pair of collective ``c`` and GEMM ``g`` in ``n`` chunks takes ``pair_time``: ``c/n + (n-1)
    max(c/n, g/n + f/(1-f) min(c/n, g/n)) + g/n``, ``f`` the fraction of SMs the collective occupies (several
    collectives feeding one matmul, keys and values, are one pipeline); a collective beside compute slows that
    compute to ``1 - f`` of its speed (``NCCL_SMS``, ``RING_SMS``, ``PIPELINE_SMS``, ``BULK_SMS`` over ``hardware.sms``; none
    when ``sms`` is 0). ``drop_grad_comm`` leaves gradient sums out (to measure them). ``fusion``: chains of
    elementwise steps priced as one kernel (``compute.kernel_times``); ``kernels``: the ``kernel_times`` of
    ``steps`` already computed (it then wins over ``fusion``); ``durations``: collectives' times by ``(kind,
    axes, bytes, group)``, filled and reused (a program repeats its collectives), and how each step's collectives
    run (classed once for the same ``steps``)."""
    modes = overlap_modes(overlap)
    steps = steps if isinstance(steps, (list, tuple)) else list(steps)
    kernels = kernel_times(steps, cluster.hardware, fusion) if kernels is None else kernels
    return _lay_out(steps, kernels, cluster, mesh, modes, drop_grad_comm, {} if durations is None else durations,
                    True)


def step_end(steps: Sequence[StepLike], kernels: tuple[Sequence[float], Sequence[int]], cluster: Cluster,
             mesh: DeviceMesh, overlap: Any, drop_grad_comm: bool, durations: dict) -> float:
    """``simulate(...).step_time`` without the timeline's records (what ``exposed_grad_comm`` needs twice);
    ``durations`` caches collectives' times and the steps' classes between calls."""
    return _lay_out(steps, kernels, cluster, mesh, overlap_modes(overlap), drop_grad_comm, durations, False)


def pair_time(comm: float, gemm: float, chunks: int, stolen: float) -> float:
    """A collective of ``comm`` seconds pipelined with a GEMM of ``gemm`` seconds in ``chunks`` chunks, the
    collective occupying a fraction ``stolen`` of the SMs while it moves: the first chunk's transfer (or the
    last one's), then ``chunks - 1`` rounds each as long as the slower of a transfer and a GEMM chunk (slowed
    while the transfer beside it runs), then the last GEMM chunk."""
    n = max(1, int(chunks))
    c, g = comm / n, gemm / n
    return c + (n - 1) * max(c, g + stolen / (1 - stolen) * min(c, g)) + g


# event classes (a blocking gradient sum is told apart from other blocking collectives, for ``drop_grad_comm``)
_BLOCK, _GRADS, _PARAMS, _WRAP, _RING, _PIPE, _BULK, _BLOCK_GRAD = range(8)


def _classes(steps: Sequence[StepLike], modes: frozenset[str]) -> tuple[list, dict[int, int], int]:
    """Per step, per event, how the schedule runs it (``_BLOCK`` ... ``_BULK``) and, for a pipelined one, the
    matmul step it is paired with; the producer of each value; where the optimizer's tail starts.

    A gradient sum is a collective of a backward step run for ``"grad of ..."``, or one in the backward pass that
    moves a value only elementwise steps separate from such a step (a gradient that a cast or a scale forced to
    be summed on its way to its parameter), or one after the backward pass that is not an all_gather."""
    made: dict[int, int] = {}
    last_bwd = -1
    for i, s in enumerate(steps):
        out = getattr(s, "out", 0)
        if out and out not in made:
            made[out] = i
        if s.phase in ("backward", "recompute"):
            last_bwd = i
    tail = last_bwd + 1 if last_bwd >= 0 else len(steps)
    kinds = [fusion_kind(t) for t in steps] if any(s.events for s in steps) else []
    # parameters: values no step made that a forward step reads first (arguments; a pipeline stage's incoming
    # gradient is read first in the backward pass), and what casts and views make of them alone
    params: set[int] = set()
    seen: set[int] = set()
    for i, s in enumerate(steps):
        r = getattr(s, "reads", ())
        for v, _ in r:
            if v not in made and v not in seen:
                seen.add(v)
                if s.phase == "forward":
                    params.add(v)
        if kinds and kinds[i] in ("loop", "alias") and r and all(v in params for v, _ in r):
            params.add(getattr(s, "out", 0))
    grad_values: set[int] = set()  # values on their way to a parameter's gradient through elementwise steps only
    for i in range(last_bwd if kinds else -1, -1, -1):
        s = steps[i]
        if s.phase != "backward":
            continue
        if is_grad_reduction(s) or (kinds[i] in ("loop", "alias") and getattr(s, "out", 0) in grad_values):
            grad_values.update(v for v, _ in getattr(s, "reads", ()))
    out: list = []
    for i, s in enumerate(steps):
        evs = s.events
        if not evs:
            out.append(())
            continue
        moves = getattr(s, "moves", ()) or ()
        grad = is_grad_reduction(s)
        row = []
        for j, e in enumerate(evs):
            v = moves[j] if j < len(moves) else 0
            if grad or (i >= tail and e.kind != "all_gather") or (s.phase == "backward" and v in grad_values):
                row.append((_GRADS if "grads" in modes else _BLOCK_GRAD, -1))
            elif i >= tail:
                row.append((_WRAP if "params" in modes else _BLOCK, -1))
            elif e.kind == "all_gather" and v in params:
                row.append((_PARAMS if "params" in modes else _BLOCK, -1))
            elif "tp" not in modes:
                row.append((_BLOCK, -1))
            else:
                row.append(_tp_class(steps, kinds, made, i, v))
        out.append(tuple(row))
    return out, made, tail


def _tp_class(steps: Sequence[StepLike], kinds: list[str], made: dict[int, int], i: int, v: int) -> tuple[int, int]:
    """A tensor-parallel collective at step ``i`` moving value ``v``: a ring exchange with the matmul that reads
    it (this step, or the first kernel reading what this relayout made), a pipeline with the matmul that made it
    (directly or through elementwise steps, nothing opaque between them), or a bulk overlap."""
    s = steps[i]
    if s.op in MATMUL_OPS and v != getattr(s, "out", 0):
        return _RING, i
    if kinds[i] == "opaque" and s.op in EXECUTOR_OPS and getattr(s, "out", 0):  # a relayout: who reads it?
        j = _reader(steps, kinds, i)
        if j >= 0 and steps[j].op in MATMUL_OPS:
            return _RING, j
    m = _maker(steps, kinds, made, v)
    if m < 0 or any(kinds[t] == "opaque" for t in range(m + 1, i)):
        return _BULK, -1
    return _PIPE, m


def _reader(steps: Sequence[StepLike], kinds: list[str], i: int, depth: int = 8) -> int:
    """The first step after ``i`` with a kernel that reads ``i``'s value (through views), or -1."""
    vals = {steps[i].out}
    for j in range(i + 1, min(len(steps), i + 1 + depth)):
        r = {v for v, _ in getattr(steps[j], "reads", ())}
        if r & vals:
            if kinds[j] == "alias":
                vals.add(steps[j].out)
                continue
            return j
    return -1


def _maker(steps: Sequence[StepLike], kinds: list[str], made: dict[int, int], v: int, depth: int = 6) -> int:
    """The latest matmul-class step whose result reaches ``v`` through elementwise steps only, or -1."""
    frontier, best = [v], -1
    for _ in range(depth):
        nxt = []
        for w in frontier:
            p = made.get(w, -1) if w else -1
            if p < 0:
                continue
            if steps[p].op in MATMUL_OPS:
                best = max(best, p)
            elif kinds[p] in ("loop", "alias"):
                nxt.extend(r for r, _ in getattr(steps[p], "reads", ()))
        if not nxt:
            break
        frontier = nxt
    return best


def _lay_out(steps: Sequence[StepLike], kernels: tuple[Sequence[float], Sequence[int]], cluster: Cluster,
             mesh: DeviceMesh, modes: frozenset[str], drop_grad_comm: bool, durations: dict, record: bool):
    times, first = kernels
    hw = cluster.hardware
    sms = hw.sms

    def stolen(n: int) -> float:
        return min(n / sms, 0.9) if sms else 0.0

    f_nccl, f_ring, f_pipe, f_bulk = stolen(NCCL_SMS), stolen(RING_SMS), stolen(PIPELINE_SMS), stolen(BULK_SMS)
    key = ("classes", modes, id(steps), len(steps))  # the same steps priced twice (exposed_grad_comm): classed once
    got = durations.get(key)
    if got is None or got[0] is not steps:
        got = durations[key] = (steps, _classes(steps, modes))
    classes, made, tail = got[1]

    def duration(e) -> float:
        key = (e.kind, e.axes, e.bytes, e.group)
        d = durations.get(key)
        if d is None:
            d = durations[key] = event_time(e, cluster, mesh)
        return d

    comp = comm = 0.0  # when each stream is next free
    pending: deque = deque()  # (start, end, fraction of SMs): collectives running beside compute, beyond ``comp``
    ready: dict[int, float] = {}  # value -> when the step that made it finished
    kstart: list[float] = [0.0] * len(steps)  # when each step's kernel started
    intervals: list[Interval] = []
    costs: list[StepCost] = []
    last_comm_owner = -1
    # the parameter gathers of a distributed optimizer's update run at the start, under the next forward pass
    wrap_end = 0.0
    for i in range(tail, len(steps)):
        for (cls, _), e in zip(classes[i], steps[i].events):
            if cls == _WRAP:
                d = duration(e)
                if record:
                    intervals.append(Interval("comm", comm, comm + d, i, e.kind, steps[i].layer, steps[i].user))
                if d and f_nccl:
                    pending.append((comm, comm + d, f_nccl))
                comm += d
    wrap_end = comm
    waiting_wrap = wrap_end > 0
    layer = object()
    run_start = prev_run_start = 0.0  # when the compute reached the current layer's run, and the one before it
    last_kernel = -1  # the last step with a kernel
    ring = None  # the open ring exchange: (its matmul, start, seconds so far, the last kernel when it opened)
    for i, s in enumerate(steps):
        before = comp
        if s.layer != layer:
            layer, prev_run_start, run_start = s.layer, run_start, comp
        if waiting_wrap and s.phase in ("backward", "recompute"):
            comp = max(comp, wrap_end)
            waiting_wrap = False
        comm_total = 0.0
        moves = getattr(s, "moves", ()) or ()
        prev_v, prev_end = None, 0.0
        for j, e in enumerate(s.events):
            cls, pair = classes[i][j]
            if cls == _WRAP or (drop_grad_comm and cls in (_GRADS, _BLOCK_GRAD)):
                continue
            d = duration(e)
            v = moves[j] if j < len(moves) else 0
            at = prev_end if v and v == prev_v else ready.get(v, comp) if v else comp  # when its data is ready
            if cls in (_BLOCK, _BLOCK_GRAD):
                start = max(comp, comm)
                end = comm = comp = start + d
            elif cls == _RING:  # an all_gather (or any collective) feeding a matmul (``pair``), chunked
                if ring is not None and ring[0] == pair and ring[3] == last_kernel:  # joins the same pipeline
                    start, total = ring[1], ring[2] + d
                else:
                    start, total = max(comp, comm, at), d
                ring = (pair, start, total, last_kernel)
                span = pair_time(total, times[pair], e.group, f_ring) - times[pair]
                end = start + total
                comm = max(start + total, start + span)
                comp = max(comp, start + span)
                start = end - d
            elif cls == _PIPE:  # a collective of a matmul's result, chunked with it as the matmul produces it
                g = times[pair]
                span = pair_time(d, g, PIPELINE_SPLITS, f_pipe) - g
                start = max(comp, comm, at)
                end = comp = start + span
                start = max(comm, end - d)
                comm = max(comm, end)
            else:  # grads, params, bulk: start early, the compute slowed beside them
                if cls == _GRADS:
                    start, f = max(at, comm), f_nccl
                elif cls == _PARAMS:
                    start, f = max(prev_run_start, comm), f_nccl
                else:
                    start, f = max(at, comm, kstart[last_kernel] if last_kernel >= 0 else 0.0), f_bulk
                end = comm = start + d
                if f and d:
                    if start < comp:
                        comp += f * (min(end, comp) - start)  # the kernels it ran beside took that much longer
                    if end > comp:
                        pending.append((max(start, comp), end, f))
                if cls != _GRADS:
                    comp = max(comp, end)
            if record:
                intervals.append(Interval("comm", start, end, i, e.kind, s.layer, s.user))
            prev_v, prev_end = v, end
            comm_total += d
            last_comm_owner = i
        k = times[i]
        kstart[i] = comp
        end = comp + k if not pending or not k else _run(comp, k, pending)
        if record:
            if k:
                intervals.append(Interval("compute", comp, end, i, s.op, s.layer, s.user))
            costs.append(StepCost(i, s.layer, s.user, s.phase, k, comm_total, end - k - before, int(s.flops),
                                  first[i]))
        if k:
            last_kernel = i
        comp = end
        out = getattr(s, "out", 0)
        if out:
            ready[out] = comp
    if waiting_wrap:
        comp = max(comp, wrap_end)
    end = max(comp, comm)
    if not record:
        return end
    if end > comp and last_comm_owner >= 0:  # the comm stream's tail: charged to the step it ran for
        c = costs[last_comm_owner]
        costs[last_comm_owner] = c._replace(exposed=c.exposed + end - comp)
    compute_time = sum(c.kernel for c in costs)
    return Timeline(tuple(intervals), tuple(costs), end, compute_time, sum(c.comm for c in costs))


def _run(t: float, work: float, pending: deque) -> float:
    """When a kernel of ``work`` seconds started at ``t`` ends, slowed to ``1 - f`` of its speed while each
    pending collective ``(start, end, f)`` runs beside it; spent collectives are dropped."""
    while pending and work > 0:
        s, e, f = pending[0]
        if e <= t:
            pending.popleft()
            continue
        if s > t:
            if work <= s - t:
                return t + work
            work -= s - t
            t = s
        cap = (e - t) * (1 - f)
        if work <= cap:
            return t + work / (1 - f)
        work -= cap
        t = e
        pending.popleft()
    return t + work
