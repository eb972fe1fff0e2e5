"""Autoshard in words: what a plan chose per layer class (parameters, batch-carrying inputs, gradient
reductions, backward collectives), and why a memory limit cannot be met."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..spec import ShardingSpec
from . import layers as L
from .report import Report
from .search import Search, Tried

def _who(cls: L.LayerClass) -> str:
    labels = [i.label or "-" for i in cls.instances]
    return labels[0] if len(labels) == 1 else f"{labels[0]} .. {labels[-1]} ({len(labels)} alike)"


def infeasible(s: Search, best: Tried) -> str:
    """What the least memory is, where it goes (by kind, per layer class) and the largest argument blocks."""
    gib = 2 ** 30
    by = {k: max(v.values(), default=0) for k, v in best.report.memory.by_kind.items()}
    if best.extra:
        by["optimizer state (Adam, assumed)"] = best.extra
    if best.choice:
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


def _describe(spec: ShardingSpec, shape: tuple, batch_axes: set, seq_axes: set = frozenset()) -> str:
    """A parameter's layout in words: FSDP where its axis also cuts the batch, column/row-parallel otherwise."""
    if spec is None:
        return "on the host"
    cut = [(d, ax) for d, ds in enumerate(spec.dim_specs) for ax in ds.axes]
    if not cut:
        return "replicated"
    parts = []
    for d, ax in cut:
        if ax in batch_axes:
            parts.append(f"sharded over {ax} (FSDP: gathered for use)")
        elif len(shape) == 2:
            seq = f" (the sequence cut over {ax} too)" if ax in seq_axes else ""
            parts.append(f"{'column' if d == 1 else 'row'}-parallel over {ax}{seq}")
        else:
            parts.append(f"dim {d} over {ax}")
    return ", ".join(parts)


def plan_words(s: Search, specs: Sequence[Any], rep: Report) -> list[str]:
    """Per layer class: each parameter's layout, the batch-carrying inputs', and how gradients are reduced."""
    grads = _grad_moves(rep, s)
    lines = []
    for ci, cls in enumerate(s.classes):
        inst = cls.instances
        slots = s.slot_of[ci]
        labels = [i.label or "-" for i in inst]
        who = _who(cls)
        batch_axes: set = set()
        seq_axes: set = set()
        acts = []
        for e, sl in enumerate(slots):
            if not sl.data:
                continue
            i = s.serials.get(inst[0].inputs[e])
            lay = L.without_partial(specs[i] if i is not None else s.prices[ci][0].inputs[e])
            for d, ds in enumerate(lay.dim_specs if lay is not None else ()):
                for ax in ds.axes:
                    (batch_axes if d == 0 else seq_axes).add(ax)
                    acts.append(f"{'batch' if d == 0 else 'sequence' if d == 1 else f'dim {d}'}-sharded over {ax}")
        ws, kinds = [], set()
        for e, sl in enumerate(slots):
            i = s.serials.get(inst[0].inputs[e])
            if not sl.param or i is None:
                continue
            path = s.info[i].path
            name = path.rsplit("[", 1)[-1].strip("]'\"") if "[" in path else path
            ws.append(f"{name} {_describe(specs[i], sl.shape, batch_axes, seq_axes)}")
            for j in inst:
                k = s.serials.get(j.inputs[e])
                if k is not None:
                    kinds |= grads.get(s.info[k].path, set())
        text = f"{who}: " + ("; ".join(ws) if ws else "no parameters")
        text += "; activations " + (", ".join(dict.fromkeys(acts)) if acts else "replicated")
        if kinds:
            text += "; gradients " + " and ".join(_VERB.get(k, k) for k in sorted(kinds))
        inside = _backward_moves(rep, set(labels))
        if inside:
            text += "; backward: " + ", ".join(f"{k} x{n}" for k, n in sorted(inside.items()))
        lines.append(text)
    return lines


_VERB = {"all_reduce": "summed over the batch (all_reduce)", "reduce_scatter": "reduce-scattered to their shards",
         "all_gather": "gathered",
         "all_to_all": "exchanged (all_to_all)", "collective_permute": "permuted"}


def _backward_moves(rep: Report, labels: set) -> dict[str, int]:
    """Collective kind -> how many the backward steps of the layers ``labels`` run (one layer's worth)."""
    phase = {c.index: c.phase for c in rep.timeline.costs}
    counts: dict[str, int] = {}
    for iv in rep.timeline.intervals:
        if iv.stream == "comm" and (iv.layer or "-") in labels and phase.get(iv.step) == "backward" \
                and not str(iv.user).startswith("grad of"):
            counts[iv.name] = counts.get(iv.name, 0) + 1
    return {k: max(1, n // len(labels)) for k, n in counts.items()}


def _grad_moves(rep: Report, s: Search) -> dict[str, set]:
    """Parameter path -> the collectives and axes of its gradient's reduction in the chosen layout's estimate."""
    out: dict[str, set] = {}
    for iv in rep.timeline.intervals:
        user = str(iv.user)
        if iv.stream == "comm" and user.startswith("grad of "):
            out.setdefault(user[len("grad of "):], set()).add(iv.name)
    return out
