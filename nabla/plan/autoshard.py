"""``nb.autoshard``: the argument shardings with the least estimated step time within a memory limit. The search
(search.py: candidates.py's layouts priced by replaying layers.py's layers, a MILP in milp.py) proposes; this
module checks the proposals and the standard layouts with the estimator in full, keeps the fastest that fits,
and names it (wording.py)."""

from __future__ import annotations

import time as _time
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import ShardingError
from ..pytree import flatten, unflatten
from ..scoped import few_collections
from ..spec import DimSpec, ShardingSpec
from ..tensor import Tensor
from ..trace import regathering
from . import milp
from .cluster import Cluster
from .report import Report
from .schedule import overlap_modes
from .search import CLOSE, EXACT_STEPS, Search, Tried
from .wording import infeasible, plan_words


class ShardingPlan:
    """What ``nb.autoshard`` chose: ``specs`` (a pytree of ``ShardingSpec`` shaped like the arguments), ``report``
    (``nb.estimate``'s report of the chosen layout, with ``.baselines``: name -> report of each standard layout),
    ``memory`` (bytes per device the choice needs, optimizer state included), ``layouts`` (name -> the specs of
    each standard layout), ``policy`` (None, or ``"regather"`` where the layout fits only with its gathered
    activations kept as shards: run ``nb.checkpoint(fn, policy="regather")``), ``apply(*args)``;
    ``print(plan)`` says what it chose per layer, in words, against each baseline."""

    def __init__(self, specs, tree, paths, report, baselines, memory, memory_limit, source, words, seconds,
                 assumed_optimizer, mesh, exact, same=(), compared=None, policy=None):
        self.specs = specs
        self._tree, self.paths = tree, paths
        self.report = report
        self.baselines = baselines
        self.memory = memory
        self.memory_limit = memory_limit
        self.source = source  # "search", "given" (nothing to choose) or the name of the baseline that was kept
        self.words = words
        self.seconds = seconds
        self.assumed_optimizer = assumed_optimizer
        self.mesh = mesh
        self.exact = exact  # every compared layout ran in full (else: the baselines are stitched from layers)
        self.same = tuple(same)  # the standard layouts whose layout is the one chosen (as they are, no dim kept)
        self.compared = compared or report  # the chosen layout priced as the baselines were (stitched or in full)
        self.policy = policy  # "regather": run fn as nb.checkpoint(fn, policy="regather") (gathered copies not kept)

    @property
    def step_time(self) -> float:
        return self.report.step_time

    def apply(self, *args: Any) -> Any:
        """``args`` laid out as chosen (a placed tensor moves with ``with_sharding``, an unplaced one is placed);
        one argument gives one result, several a tuple."""
        leaves, tree = flatten(args)
        specs, _ = flatten(self.specs)
        if len(leaves) != len(specs):
            raise ShardingError(f"autoshard: apply got {len(leaves)} argument leaves, the plan has {len(specs)} "
                                f"({', '.join(self.paths)})")
        out = []
        for x, s in zip(leaves, specs):
            if isinstance(x, Tensor) and s is not None:
                x = x.with_sharding(s) if x.sharding is not None else x.shard(s)
            out.append(x)
        res = unflatten(tree, out)
        return res[0] if len(args) == 1 else res

    def jax_shardings(self, jax_mesh: Any) -> Any:
        """The chosen layouts as ``jax.sharding.NamedSharding``s on ``jax_mesh`` (a ``jax.sharding.Mesh`` with this
        plan's axis names and sizes), shaped like the arguments: ``jax.jit(fn, in_shardings=plan.jax_shardings(m))``
        runs the JAX program as nabla planned it."""
        from jax.sharding import NamedSharding  # (only this method needs jax)
        sizes = dict(zip(getattr(jax_mesh, "axis_names", ()), getattr(jax_mesh, "axis_sizes", ())))
        want = dict(zip(self.mesh.axis_names, self.mesh.shape))
        if sizes != want:
            raise ShardingError(f"autoshard: jax_shardings needs a jax mesh with axes {want}, got {sizes}")
        leaves, tree = flatten(self.specs)
        closed = [ShardingSpec(s.mesh, [DimSpec(d.axes) for d in s.dim_specs]) for s in leaves]  # (no UNCONSTRAINED)
        return unflatten(tree, [NamedSharding(jax_mesh, s.to_partition_spec()) for s in closed])

    def __str__(self) -> str:
        gib = 2 ** 30
        how = ("every dim is closed or fixed: the layout given" if self.source == "given" else
               "searched" + (f" (the {' = '.join(self.same)} layout)" if self.same else "")
               if self.source == "search" else f"the {self.source} layout (the search found nothing faster)")
        lines = [f"autoshard on {self.mesh!r}: {how}, in {self.seconds:.2f} s"]
        lines += [f"  {w}" for w in self.words]
        if self.policy:
            lines.append(f"  run it as nb.checkpoint(fn, policy={self.policy!r}): activations it gathers are kept as "
                         f"shards and gathered again in the backward pass (the layout does not fit otherwise)")
        extra = f" (incl. {self.assumed_optimizer / gib:.2f} GiB of Adam state the program does not hold)" \
            if self.assumed_optimizer else ""
        lines.append(f"chosen: step {self.report.step_time * 1e3:.3f} ms, memory {self.memory / gib:.2f} GiB per "
                     f"device of {self.memory_limit / gib:.2f}{extra}")
        ref = self.compared.step_time
        how = "ran in full" if self.exact else (f"stitched from replayed layers, as is the choice: "
                                                f"{ref * 1e3:.3f} ms")
        if self.baselines:
            lines.append(f"baselines ({how}):")
        width = max([16] + [len(n) for n in self.baselines])
        for name, (rep, mem) in self.baselines.items():
            fits = "" if mem <= self.memory_limit else "  (over the limit)"
            lines.append(f"  vs {name:<{width}} step {rep.step_time * 1e3:>10.3f} ms ({rep.step_time / ref:.2f}x), "
                         f"memory {mem / gib:.2f} GiB{fits}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"ShardingPlan(step_time={self.step_time:.6g}, memory={self.memory}, source={self.source!r})"


def autoshard(fn: Callable, cluster: Cluster, *args: Any, memory_limit: float | None = None,
              fixed: dict | None = None, overlap: str = "grads") -> ShardingPlan:
    """The shardings of ``args`` for which ``nb.estimate(fn, cluster, overlap)`` gives the least step time within
    ``memory_limit`` bytes per device (default: the device's HBM), ties toward less memory.

    ``args`` are tensors (or ``nb.abstract`` ones) on a mesh made by ``cluster.mesh(...)``: closed dims are kept,
    open dims (``nb.DimSpec([], is_open=True)``) and unplaced tensors are chosen. ``fixed`` maps argument paths
    (``"x"``, ``"p['w1']"``) to specs to keep. Memory counts what the program holds plus, for a training step
    without an optimizer, mixed-precision Adam's state (16 bytes per parameter with its bf16 copy and gradient).
    Never slower than the standard layouts (DP, FSDP, Megatron TP x DP or x FSDP, with sequence parallelism):
    each is priced, and kept when the search does not beat it. An infeasible limit raises ``ShardingError``
    naming the least memory any layout reaches and what dominates it."""
    if not isinstance(cluster, Cluster):
        raise ShardingError(f"autoshard: cluster must be an nb.Cluster, got {type(cluster).__name__}")
    overlap_modes(overlap, "autoshard")  # the estimator's modes: "none", "grads", "all" or a tuple of them
    if memory_limit is not None and (not isinstance(memory_limit, (int, float)) or memory_limit <= 0):
        raise ShardingError(f"autoshard: memory_limit must be a number of bytes > 0, got {memory_limit!r}")
    with few_collections():  # the search's records live until it ends (see few_collections)
        return _plan(Search(fn, cluster, args, memory_limit, fixed, overlap))


def _plan(s: Search) -> ShardingPlan:
    """The search run: proposals and baselines priced, the fastest that fits run in full, the plan worded."""
    s.solve()
    exact = sum(len(seg.steps) for seg in s.segs) <= EXACT_STEPS
    tried: dict[tuple, Tried] = {}

    def price(name: str, choice: Sequence[int]) -> Tried:
        specs = s.realize(choice)
        key = tuple(specs)
        if key not in tried:
            if exact:
                rep, mem, extra, sums = s.measure(specs)
                tried[key] = Tried(name, tuple(choice), specs, rep, mem, extra, True, sums)
            else:
                tried[key] = Tried(name, tuple(choice), specs, *s.stitched(choice))
        return tried[key]._replace(name=name, choice=tuple(choice))

    given = not any(any(lf.free) for lf in s.info)  # every dim closed or fixed: nothing to choose
    baselines = {} if given else _baselines(s, price)
    found = [price("given", [0] * len(s.classes))] if given else _proposals(s, price)
    fits = sorted((t for t in found + list(baselines.values()) if t.memory <= s.limit),
                  key=lambda t: (t.report.step_time, t.memory, t.name != "search"))
    ran: list[Tried] = []

    def in_full(t: Tried) -> Tried | None:
        """``t`` run through the estimator (as priced, when it ran in full), once; itself if it fits."""
        for r in ran:
            if r.specs == t.specs:
                return r if r.memory <= s.limit else None
        if not t.full:
            rep, mem, extra, sums = s.measure(t.specs)
            t = t._replace(report=rep, memory=mem, extra=extra, full=True, sums=sums)
        ran.append(t)
        return t if t.memory <= s.limit else None

    chosen, short = None, 1.0
    for t in fits[:3]:  # run the winner in full (a stitched estimate is checked), the next if it does not fit;
        # where the model fell short, the others are taken as short by as much
        if t.memory * short > s.limit:
            continue
        chosen = in_full(t)
        if chosen is not None:
            break
        short = max(short, ran[-1].memory / max(t.memory, 1.0))
    pool = fits + sorted((t for t in list(baselines.values()) + found if all(t.specs != f.specs for f in fits)),
                         key=lambda t: t.report.step_time)
    if chosen is None:  # the model can err either way: the others that fit by it, then the rest in order of time
        chosen = next((c for c in map(in_full, pool) if c is not None), None)
    lean = _regathered(s, chosen, pool) if exact else None  # (a small program: each try is one more full run)
    chosen, policy = (lean, "regather") if lean is not None else (chosen, None)
    if chosen is None:  # the least memory: as the model counts it where nothing fits by it, else as run in full
        least = [price("the least-memory layout", milp.least_memory(s.groups, s.edges).choice)] + found + \
            list(baselines.values()) if not fits and not given else ran
        raise ShardingError(infeasible(s, min(least, key=lambda t: t.memory)))
    if not exact:  # a close second (stitched estimates err by a few percent) runs in full too: the faster wins
        ahead = next(t for t in pool if t.specs == chosen.specs).report.step_time
        close = [t for t in fits if t.specs != chosen.specs and t.report.step_time <= ahead * (1 + CLOSE)
                 and all(r.specs != t.specs for r in ran)]
        second = in_full(close[0]) if close else None
        if second is not None and (second.report.step_time, second.memory) < (chosen.report.step_time, chosen.memory):
            chosen = second
    same = [n for n, t in baselines.items() if t.specs == chosen.specs and n not in s.kept_rows]
    source = "given" if given else "search" if any(f.specs == chosen.specs for f in found) else chosen.name
    compared = chosen.report if policy else next(t for t in pool if t.specs == chosen.specs).report  # (as the
    # baselines were priced)
    report = _with_baselines(chosen.report, {n: t.report for n, t in baselines.items()})
    words = plan_words(s, chosen)
    out_specs = unflatten(s.tree, [sp if isinstance(x, Tensor) else None for x, sp in zip(s.leaves, chosen.specs)])
    plan = ShardingPlan(out_specs, s.tree, [lf.path for lf in s.info], report,
                        {n: (t.report, t.memory) for n, t in baselines.items()}, chosen.memory, s.limit, source,
                        words, _time.perf_counter() - s.t0, chosen.extra, s.mesh, exact, same, compared, policy)
    plan.layouts = {n: unflatten(s.tree, [sp if isinstance(x, Tensor) else None for x, sp in zip(s.leaves, t.specs)])
                    for n, t in baselines.items()}
    return plan


def _regathered(s: Search, chosen: Tried | None, pool: Sequence[Tried]) -> Tried | None:
    """A faster layout that is over the limit only by the gathered copies of activations it keeps, run as
    ``nb.checkpoint(fn, policy="regather")`` runs it: each kept as its shard and gathered again in the backward
    pass (Megatron-LM's sequence parallelism: one all_gather more for less memory); the first two that are
    faster than ``chosen`` as they run are tried (where every layout ran in full: a small program)."""
    best = chosen.report.step_time if chosen is not None else float("inf")
    ahead = [t for t in pool if t.report.step_time < best and (chosen is None or t.specs != chosen.specs)]
    for t in ahead[:2]:
        with regathering():
            rep, mem, extra, sums = s.measure(t.specs)
        if mem <= s.limit and mem < t.memory and rep.step_time < best:
            return t._replace(report=rep, memory=mem, extra=extra, full=True, sums=sums)
    return None


def _baselines(s: Search, price: Callable[[str, Sequence[int]], Tried]) -> dict[str, Tried]:
    """The standard layouts priced, one row per distinct layout, named by the standard layouts it is ("DP = FSDP"
    where no parameter can be cut further); a layout the arguments' closed or fixed dims made from a standard
    one, and no standard layout is, says so ("TP x DP (given dims kept)"; ``s.kept_rows``)."""
    rows: dict[tuple, list[tuple[str, Tried]]] = {}
    for name in s.named[0]:
        if all(name in nm for nm in s.named) and (s.has_tp or not name.startswith("TP")):
            t = price(name, [nm[name] for nm in s.named])
            rows.setdefault(tuple(t.specs), []).append((name, t))
    out: dict[str, Tried] = {}
    for group in rows.values():
        names = [n for n, _ in group if n not in s.kept]
        label = " = ".join(names) if names else " = ".join(n for n, _ in group) + " (given dims kept)"
        if not names:
            s.kept_rows.add(label)
        out[label] = group[0][1]._replace(name=label)
    return out


def _proposals(s: Search, price: Callable[[str, Sequence[int]], Tried]) -> list[Tried]:
    """The MILP's choices, priced: its memory is checked by the estimate, tightened where it fell short and
    loosened once where it was cautious (the choice's estimate needed less than the model said); a choice whose
    layers' backward passes were priced from their own gradients is priced again from its consumer's."""
    found: list[Tried] = []
    limit, excluded, loosened = s.limit, [], False
    for _ in range(12):
        sol = milp.solve(s.groups, s.edges, limit, excluded)
        if sol is not None and s.refine(sol.choice):
            continue
        if sol is None or any(f.choice == sol.choice for f in found):
            break
        t = price("search", sol.choice)
        found.append(t)
        if t.memory > s.limit:
            excluded.append(sol.choice)
            limit = limit * s.limit / t.memory
        elif not loosened and np.isfinite(limit) and t.memory < 0.97 * sol.memory:
            loosened, limit = True, limit * sol.memory / max(t.memory, 1.0)
        else:
            break
    return found


def _with_baselines(rep: Report, baselines: dict) -> Report:
    object.__setattr__(rep, "baselines", baselines)
    return rep
