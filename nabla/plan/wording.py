"""Autoshard in words: what a plan chose per layer class (parameters, batch-carrying inputs, gradient
reductions, backward collectives), and why a memory limit cannot be met."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..spec import ShardingSpec
from . import layers as L
from .report import Report
from .search import Search, Tried
from .steps import MATMUL_OPS


def _who(cls: L.LayerClass) -> str:
    """A layer class by its labels: ``layer 0 .. layer 31 (32 alike)``; steps outside any ``nb.named_scope``."""
    labels = [i.label or "outside named scopes" for i in cls.instances]
    return labels[0] if len(labels) == 1 else f"{labels[0]} .. {labels[-1]} ({len(labels)} alike)"


def infeasible(s: Search, best: Tried) -> str:
    """What the least memory is, where it goes (by kind, per layer class) and the largest argument blocks."""
    gib = 2 ** 30
    by = {k: max(v.values(), default=0) for k, v in best.report.memory.by_kind.items()}
    if best.extra:
        by["optimizer state (Adam, assumed)"] = best.extra
    if best.choice and not best.full:  # priced by the model: where its memory goes, per layer class
        mult = 1.0 + s.opt_ratio[0]
        per = []
        for ci, cls in enumerate(s.classes):
            p, n = s.prices[ci][best.choice[ci]], len(cls.instances)
            lay = s.cands[ci][best.choice[ci]].layouts
            w = sum(L.block_bytes(l, sl.shape, sl.dtype.itemsize) * mult
                    for sl, l in zip(s.slot_of[ci], lay) if sl.param and sl.dtype is not None)
            who = _who(cls)
            per += [(n * w, f"parameters and optimizer state of {who}"),
                    (n * (p.held - w), f"values saved for the backward pass in {who}"),
                    (n * (p.late - w), f"gradients of {who} (laid out as their parameters)"),
                    (p.transient, f"temporaries while one instance of {who} runs")]
        by = {k: v for v, k in per}
    kinds = sorted(by.items(), key=lambda kv: -kv[1])[:3]
    big = sorted(((L.block_bytes(sp, s.info[i].shape, np.dtype(s.info[i].dtype).itemsize), s.info[i].path)
                  for i, sp in enumerate(best.specs) if sp is not None), reverse=True)[:3]
    return (f"autoshard: no layout fits in {s.limit / gib:.2f} GiB per device; the least memory any layout reaches "
            f"is {best.memory / gib:.2f} GiB per device ({best.name}), dominated by "
            + ", ".join(f"{k}: {v / gib:.2f} GiB" for k, v in kinds)
            + "; the largest argument blocks per device: " + ", ".join(f"{p} {b / gib:.3f} GiB" for b, p in big))


# ---- in words ---------------------------------------------------------------------------------------------


def _name(path: str) -> str:
    """A leaf's last key: ``params['layers'][0]['wq']`` -> ``wq``."""
    return path.rsplit("[", 1)[-1].strip("]'\"") if "[" in path else path


def _axes(axes: Sequence[str]) -> str:
    return " and ".join(axes)


def _data(name: str, spec: ShardingSpec | None, roles: Sequence[str]) -> str:
    """A batch-carrying input's layout in words: which of its dims (the batch, the sequence, another) are cut."""
    cut = [(d, ds.axes) for d, ds in enumerate(spec.dim_specs) if ds.axes] if spec is not None else []
    if not cut:
        return f"{name} replicated"
    role = lambda d: roles[d] if d < len(roles) and roles[d] else f"dim {d}"  # noqa: E731
    return f"{name} " + ", ".join(f"{role(d)}-sharded over {_axes(ax)}" for d, ax in cut)


def _param(name: str, spec: ShardingSpec | None, matmul: bool, batch: set, seq: set) -> str:
    """A parameter's layout in words: FSDP where its axis also cuts the batch; a matrix a matmul reads column- or
    row-parallel (the sequence cut over the same axis: sequence parallelism); any other cut by its dim."""
    if spec is None:
        return f"{name} on the host"
    cut = [(d, ax) for d, ds in enumerate(spec.dim_specs) for ax in ds.axes]
    if not cut:
        return f"{name} replicated"
    parts = []
    for d, ax in cut:
        if ax in batch:
            parts.append(f"dim {d} over {ax} (FSDP: gathered for use)")
        elif matmul and len(spec.dim_specs) == 2:
            parts.append(f"{'column' if d == 1 else 'row'}-parallel over {ax}"
                         + (f" (the sequence cut over {ax} too)" if ax in seq else ""))
        else:
            parts.append(f"dim {d} over {ax}")
    return f"{name} " + ", ".join(parts)


def _gradients(spec: ShardingSpec | None, summed: set) -> str:
    """How a parameter's gradient was finished: summed over the mesh axes its partial sums spanned, kept cut over
    those the parameter is cut over (a reduce_scatter)."""
    if not summed:
        return ""
    cut = {a for ds in spec.dim_specs for a in ds.axes} if spec is not None else set()
    order = [a for a in spec.mesh.axis_names if a in summed] if spec is not None else sorted(summed)
    scattered = [a for a in order if a in cut]
    if len(scattered) == len(order):
        return f"reduce-scattered over {_axes(order)}"
    if not scattered:
        return f"summed over {_axes(order)} (all_reduce)"
    return f"summed over {_axes(order)}, reduce-scattered over {_axes(scattered)}"


def plan_words(s: Search, chosen: Tried) -> list[str]:
    """Per layer class: each parameter's layout, each batch-carrying input's (the arguments by name, values from
    other layers as activations), how the gradients were summed in the chosen layout's full run, and the
    collectives its backward pass runs."""
    specs, rep = chosen.specs, chosen.report
    lines = []
    for ci, cls in enumerate(s.classes):
        inst, slots = cls.instances, s.slot_of[ci]
        priced = s.part(chosen.choice, ci) if chosen.choice else None
        batch: set = set()
        seq: set = set()
        data = []
        for e, sl in enumerate(slots):
            if not sl.data:
                continue
            i = s.serials.get(inst[0].inputs[e])
            lay = L.without_partial(specs[i] if i is not None else priced.inputs[e] if priced else None)
            for d, ds in enumerate(lay.dim_specs if lay is not None else ()):
                (batch if d < len(sl.roles) and sl.roles[d] == "batch" else
                 seq if d < len(sl.roles) and sl.roles[d] == "sequence" else set()).update(ds.axes)
            named = i is not None and all(j.inputs[e] in s.serials for j in inst)  # an argument in every instance
            data.append(_data(_name(s.info[i].path) if named else "activations", lay, sl.roles))
        ws, grads = [], {}
        for e, sl in enumerate(slots):
            i = s.serials.get(inst[0].inputs[e])
            if not sl.param or i is None:
                continue
            name = _name(s.info[i].path)
            ws.append(_param(name, specs[i], s.reader.get(i) in MATMUL_OPS, batch, seq))
            how = _gradients(specs[i], (chosen.sums or {}).get(s.info[i].path, set()))
            if how:
                grads.setdefault(how, []).append(name)
        text = f"{_who(cls)}: " + "; ".join(ws + list(dict.fromkeys(data)) or ["no parameters"])
        if len(grads) == 1:
            text += "; gradients " + next(iter(grads))
        elif grads:
            text += "; gradients: " + "; ".join(f"{', '.join(ns)} {how}" for how, ns in grads.items())
        inside = _backward_moves(rep, {i.label or "-" for i in inst}, len(inst))
        if inside:
            text += "; backward: " + ", ".join(f"{k} x{n}" for k, n in sorted(inside.items()))
        lines.append(text)
    return lines


def _backward_moves(rep: Report, labels: set, count: int) -> dict[str, int]:
    """Collective kind -> how many the backward steps of the layers ``labels`` run (one layer's worth)."""
    phase = {c.index: c.phase for c in rep.timeline.costs}
    counts: dict[str, int] = {}
    for iv in rep.timeline.intervals:
        if iv.stream == "comm" and (iv.layer or "-") in labels and phase.get(iv.step) == "backward" \
                and not str(iv.user).startswith("grad of"):
            counts[iv.name] = counts.get(iv.name, 0) + 1
    return {k: max(1, n // count) for k, n in counts.items()}
