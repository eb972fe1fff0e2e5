"""Autoshard's search: each layer class's candidates priced by replaying its steps (steady state, forward and
backward), the choice as a MILP (milp.py), a choice's specs, its estimate in full or stitched from the replayed
layers. What the candidates are is candidates.py's; verifying and naming the result is autoshard.py's."""

from __future__ import annotations

import time as _time
from itertools import count, product
from math import prod
from typing import Any, NamedTuple, Sequence

import numpy as np

from .. import collectives as C
from ..errors import ShardingError
from ..pytree import flatten, unflatten
from ..spec import DimSpec, ShardingSpec
from ..tensor import Tensor
from . import layers as L
from . import milp
from .candidates import (Candidate, Slot, _ways, all_layouts, arg_leaves, axis_options, baseline_options,
                         data_dims_only, given_layout, layout_key, layout_of, megatron_classes, mesh_of, reshard_time)
from .estimate import estimate
from .report import Report, estimate_steps, step_time

#: a class whose arguments have at most this many layouts together is searched over all of them
EXHAUSTIVE = 256
#: more combinations of per-axis options than this: each axis's options are screened alone first, and the
#: KEEP_FAST fastest and KEEP_SMALL smallest (with the standard layouts') are combined
SCREEN, KEEP_FAST, KEEP_SMALL = 48, 3, 2
#: a class fed by another is priced under the layouts the FEEDS fastest of its producer's candidates hand over
#: (those cutting the batch and sequence only) and the standard layouts'; producers handing over anything else are
#: left out
FEEDS = 3

class Priced(NamedTuple):
    steps: tuple  # the replay's steps (forward, backward, gradient reductions), as the estimator reads them
    time: float  # seconds of one instance
    held: float  # bytes per device held until the backward pass: parameters, optimizer state, inputs, saved values
    transient: float  # bytes per device alive only while an instance runs
    inputs: tuple  # the layouts the instance was priced with (a steady state: what the previous one gives)
    outputs: tuple  # the layouts of its outputs
    late: float  # bytes per device held at the end of the backward pass: parameters, optimizer state, inputs and
    # the gradients, each summed into its parameter's layout when the backward pass completes it
    gradients: tuple  # per input, the layout of the gradient the backward pass hands back (None: none)
    names: tuple = ()  # the replay's values that cross layers (``layers.Replayed.names``)

# ---- pricing ----------------------------------------------------------------------------------------------

_strip = L.without_partial


class Search:
    """Everything one autoshard call learns about the program."""

    def __init__(self, fn, cluster, args, memory_limit, fixed, overlap):
        self.fn, self.cluster, self.overlap = fn, cluster, overlap
        self.t0 = _time.perf_counter()
        leaves, _ = flatten(args)
        self.mesh = mesh_of(leaves, cluster)
        self.leaves, self.info, self.tree = arg_leaves(args, fn, self.mesh, fixed)
        self.limit = float(cluster.hardware.hbm_bytes if memory_limit is None else memory_limit)
        self._prices: dict = {}
        self.replays = L.Replays(lambda steps: step_time(steps, cluster, self.mesh, overlap))
        self.refined: dict = {}  # (producer, its candidate, consumer, its candidate) -> Priced
        self.has_tp = False  # some class has parameters Megatron's cut applies to
        self.kept: set[str] = set()  # standard layouts the arguments' closed or fixed dims change
        self.kept_rows: set[str] = set()  # baseline rows that are such a changed layout only
        self.record()

    # -- the program --
    def abstract(self, specs: Sequence[Any]) -> tuple:
        out = [Tensor(None, s, x.shape, x.dtype) if isinstance(x, Tensor) else x for x, s in zip(self.leaves, specs)]
        return unflatten(self.tree, out)

    def record(self) -> None:
        mesh = self.mesh
        specs = []
        for x, lf in zip(self.leaves, self.info):
            if not isinstance(x, Tensor):
                specs.append(None)
            elif lf.fixed is not None:
                specs.append(lf.fixed)
            else:
                specs.append(ShardingSpec(mesh, [DimSpec(b, is_open=f) for b, f in zip(lf.base, lf.free)]))
        rec = L.Recorder(stop_at_backward=True)
        args = self.abstract(specs)
        self.serials = {}
        for i, x in enumerate(flatten(args)[0]):
            if isinstance(x, Tensor):
                self.serials[L.serial(x)] = i
        try:
            with C.recording(rec):
                self.fn(*args)
        except L.Stop:  # the forward program is all the search reads: the backward pass is replayed per layer
            pass
        self.tags = rec.tags
        fwd, self.train = L.forward_program(rec.steps, frozenset(self.serials))
        if not fwd:
            raise ShardingError("autoshard: the function ran no op; there is nothing to shard")
        self.segs = L.segments(fwd)
        self.classes = L.classes(self.segs, self.serials)
        self.params = {i for s, i in self.serials.items() if self.tags.get(s) == "params"}
        opt = [(s, k) for s, k in rec.tags.items() if k == "optimizer"]
        self.opt_ratio = self._optimizer_ratio(rec.steps, opt)
        self.reader: dict[int, str] = {}  # leaf -> the op that reads it first (a matmul: column- or row-parallel)
        for st in fwd:
            for u in st.uses:
                if u.value in self.serials:
                    self.reader.setdefault(self.serials[u.value], st.name)
        self.dims = L.value_dims(fwd)
        self.batch, self.seq = self._batch_and_sequence(fwd)

    def _batch_and_sequence(self, fwd: Sequence) -> tuple[int | None, int | None]:
        """The program-wide dim classes of the batch and of the sequence. The batch: in a training step, the first
        dim most of the arguments that are not parameters share (token ids, targets, masks, labels: their first
        dims joined through the ops between them); without a backward pass, the result's first dim, else the first
        dim most arguments share (on a tie, the later argument's: data comes after the parameters). The sequence: the
        second dim most values of three or more dims with the batch first share."""
        first: dict[int, int] = {}
        for v, i in self.serials.items():
            d = self.dims.get(v, ())
            if d and (i not in self.params or not self.train):
                first[d[0]] = first.get(d[0], 0) + 1
        out = self.dims.get(fwd[-1].out, ())
        if not self.train and out:
            batch = out[0]
        else:
            last = {self.dims[v][0]: i for v, i in sorted(self.serials.items(), key=lambda t: t[1]) if self.dims.get(v)}
            batch = max(first, key=lambda c: (first[c], last[c]), default=None)
        seqs: dict[int, int] = {}
        for d in self.dims.values():
            if len(d) >= 3 and d[0] == batch and d[1] != batch:
                seqs[d[1]] = seqs.get(d[1], 0) + 1
        return batch, max(seqs, key=seqs.get, default=None)

    def _optimizer_ratio(self, steps, opt) -> tuple[float, bool]:
        """Bytes of optimizer state per byte of parameter: as recorded, else mixed-precision Adam's (fp32 master
        copy and two moments: 12 bytes per 16-bit parameter, or two moments, 8 bytes, per 32-bit one)."""
        if not self.train:
            return 0.0, False
        if opt:
            sizes = {}
            for s in steps:
                sizes.setdefault(s.out, prod(s.out_shape) * s.out_dtype.itemsize)
                for u in s.uses:
                    if u.value:
                        sizes.setdefault(u.value, prod(u.shape) * u.dtype.itemsize)
            pbytes = sum(prod(self.info[i].shape) * np.dtype(self.info[i].dtype).itemsize for i in self.params)
            return sum(sizes.get(s, 0) for s, _ in opt) / max(1, pbytes), False
        items = [np.dtype(self.info[i].dtype).itemsize for i in self.params]
        item = max(items, default=4)
        return (12.0 / item if item <= 2 else 8.0 / item), True

    # -- slots and candidates --
    def slots(self, cls: L.LayerClass) -> list[Slot]:
        rep = cls.rep
        info = {}
        for s in rep.steps:
            for u in s.uses:
                if u.value:
                    info.setdefault(u.value, u)
        out = []
        for e, v in enumerate(rep.inputs):
            u = info[v]
            leaf = self.serials.get(v)
            lf = self.info[leaf] if leaf is not None else None
            roles = tuple("batch" if c == self.batch else "sequence" if c == self.seq else ""
                          for c in self.dims.get(v, (None,) * len(u.shape)))
            carries = "batch" in roles
            param = cls.params[e] and (leaf in self.params if self.train else not carries)
            if lf is not None:
                base, free, used = lf.base, lf.free, lf.used
                given = given_layout(self.mesh, lf)
            elif u.src is None:
                base, free, used, given = ((),) * len(u.shape), (False,) * len(u.shape), frozenset(), None
            else:
                base, free, used = ((),) * len(u.shape), (True,) * len(u.shape), frozenset()
                given = _strip(u.src)
            # an argument carries the batch when one of its dims is the batch's class (ids, targets, masks); a
            # value flowing in from another layer is an activation
            data = not param and bool(u.shape) and (carries if lf is not None else
                                                    u.src is not None and np.dtype(u.dtype).kind in "fcV")
            out.append(Slot(tuple(u.shape), np.dtype(u.dtype) if (u.src is not None or lf is not None) else None,
                            cls.dims[e], base, free, used, param, data, given, roles, lf is not None,
                            lf is not None and (lf.fixed is not None or not all(lf.free) or bool(lf.used)),
                            np.dtype(u.dtype)))
        return out

    def candidates(self, cls: L.LayerClass, slots: list[Slot]) -> tuple[list[Candidate], dict[str, int]]:
        """The layouts to price for one class (the standard layouts first), and each standard layout's index."""
        mesh = self.mesh
        cands: dict[tuple, Candidate] = {}
        base = baseline_options(mesh, cls, slots)
        if megatron_classes(cls, slots):
            self.has_tp = True
        named = {}
        for name, opts in base.items():
            lay = tuple(layout_of(mesh, s, opts) for s in slots)
            cands.setdefault(lay, Candidate(lay, opts))
            named[name] = list(cands).index(lay)
            if any(s.constrained and s.dtype is not None and l != layout_of(mesh, s.opened(), opts)
                   for s, l in zip(slots, lay)):
                self.kept.add(name)  # the user's closed or fixed dims make it another layout than its name says
        each = [all_layouts(mesh, s) for s in slots]
        if len(cls.instances) == 1 and prod(len(e) for e in each) <= EXHAUSTIVE:
            for lay in product(*each):
                cands.setdefault(tuple(lay), Candidate(tuple(lay), None))
        else:
            opts = axis_options(cls, slots)
            live = [a for a in mesh.axis_names if mesh.axis_size(a) > 1]
            keep = {a: opts for a in live}
            if len(live) > 1 and len(opts) ** len(live) > SCREEN:
                keep = {a: self._screen(cls, slots, opts, a, [o[mesh.axis_names.index(a)] for o in base.values()])
                        for a in live}
            for choice in product(*(keep[a] for a in live)):
                full = iter(choice)
                per_axis = tuple(next(full) if a in live else None for a in mesh.axis_names)
                lay = tuple(layout_of(mesh, s, per_axis) for s in slots)
                cands.setdefault(lay, Candidate(lay, per_axis))
        return list(cands.values()), named

    def _screen(self, cls: L.LayerClass, slots: list[Slot], opts: list, axis: str, given: list) -> list:
        """The options worth combining on ``axis``: each priced alone (the other axes doing nothing), the
        fastest few and the most frugal few kept, with those the standard layouts use."""
        mesh = self.mesh
        scored = []
        for o in opts:
            per_axis = tuple(o if a == axis else None for a in mesh.axis_names)
            lay = tuple(layout_of(mesh, s, per_axis) for s in slots)
            p = self.price(cls, slots, Candidate(lay, per_axis))
            scored.append((p.time, p.held + p.transient, opts.index(o), o))
        fast = [o for *_, o in sorted(scored, key=lambda t: (t[0], t[1], t[2]))[:KEEP_FAST]]
        small = [o for *_, o in sorted(scored, key=lambda t: (t[1], t[0], t[2]))[:KEEP_SMALL]]
        return list(dict.fromkeys(fast + small + given))

    # -- pricing one class --
    def feeds(self, cls: L.LayerClass) -> dict[int, int]:
        """Inputs of ``cls`` that the previous instance's output ``j`` gives (the class repeats: a steady state)."""
        if len(cls.instances) < 2:
            return {}
        a, b = cls.instances[0], cls.instances[1]
        outs = {a.steps[k].out: j for j, k in enumerate(a.outputs)}
        return {e: outs[v] for e, v in enumerate(b.inputs) if v in outs}

    def price(self, cls: L.LayerClass, slots: list[Slot], cand: Candidate) -> Priced:
        key = (id(cls), cand.layouts)
        if key not in self._prices:
            self._prices[key] = self._price(cls, slots, cand)
        return self._prices[key]

    def _price(self, cls: L.LayerClass, slots: list[Slot], cand: Candidate, cotangents: list | None = None) -> Priced:
        shapes = [s.shape for s in slots]
        dtypes = [s.recorded if s.recorded is not None else np.float32 for s in slots]
        # differentiated: parameters, and values flowing in from other layers (in a repeated class, the first
        # instance's input may be an argument: the others' is the layer before's output)
        diff = [s.param or (not cls.params[e] and s.given is not None) or
                self.serials.get(cls.rep.inputs[e]) in self.params for e, s in enumerate(slots)]
        layouts = list(cand.layouts)
        params = [sl.param for sl in slots]
        cts = None if cotangents is None else list(cotangents)
        r = self.replays(cls, layouts, shapes, dtypes, diff, self.train, cts, params)
        feeds = self.feeds(cls)
        # a repeated layer's steady state: its input as the one before hands it over, its output's cotangent as
        # the next one's input gradient comes back (one more replay settles it; from a given cotangent, the
        # layers' backward passes may take a few to settle)
        for _ in range(1 if cotangents is None else 3):
            if not feeds:
                break
            new = [None] * len(r.outputs)
            for e, j in feeds.items():
                new[j] = r.gradients[e]
            now = cts if cts is not None else [_strip(o) for o in r.outputs]
            if all(layout_key(r.outputs[j]) == layout_key(layouts[e]) and (new[j] is None or layout_key(new[j]) == layout_key(now[j]))
                   for e, j in feeds.items()):
                break
            for e, j in feeds.items():
                layouts[e] = r.outputs[j]
            cts = new
            r = self.replays(cls, layouts, shapes, dtypes, diff, self.train, cts, params)
        r = self.replays.settled(r)
        opt = self.opt_ratio[0]
        held = params = 0.0
        for e, (s, lay) in enumerate(zip(slots, cand.layouts)):
            if s.dtype is None:
                continue
            b = L.block_bytes(lay, s.shape, s.dtype.itemsize)
            if s.param:
                params += b
            elif not s.data or cls.rep.inputs[e] in self.serials:
                held += b  # an argument the program reads (a batch, targets) stays all step (the values flowing
                # from layer to layer are counted where they are saved)
        # what the backward pass of this layer leaves behind: its parameters' gradients, each summed into the
        # parameter's layout as soon as the pass completes it (nb.grad finishes gradients as DDP/FSDP do, so one
        # layer's raw partial gradients never wait for the next layer's): one parameter's bytes again
        held += params * (1 + opt)
        late = held + params if self.train else held
        held += r.saved
        return Priced(r.steps, r.time, held, max(0.0, r.peak - r.base), tuple(layouts), r.outputs, late,
                      r.gradients, r.names)

    # -- the program as a MILP --
    def solve(self):
        where = self._producers()
        self.slot_of, self.cands, self.named, self.prices, self.fed = [], [], [], [], []
        for ci, cls in enumerate(self.classes):
            slots = self.slots(cls)
            fed = self._fed(ci, cls, where)
            if fed is None:
                cands, named = self.candidates(cls, slots)
                self.fed.append(None)
            else:
                cands, named, feeds = self._fed_candidates(cls, slots, *fed)
                self.fed.append((fed[0], feeds))
            self.slot_of.append(slots)
            self.cands.append(cands)
            self.named.append(named)
            self.prices.append([self.price(cls, slots, c) for c in cands])
        groups = []
        for cls, prices in zip(self.classes, self.prices):
            n = len(cls.instances)
            groups.append(milp.Group([p.time * n for p in prices], [p.held * n for p in prices],
                                     [p.transient for p in prices], [p.late * n for p in prices]))
        self.groups = groups
        self.edges = self._edges()
        self.priced_seconds = _time.perf_counter() - self.t0

    def refine(self, choice: Sequence[int]) -> bool:
        """Price each repeated class of ``choice`` that feeds another from the gradient that one hands back (a
        layer's backward pass starts from what the next class's gives it, not from its own steady state); the
        difference goes on the MILP's edge between the two. Whether anything new was priced."""
        changed = False
        for cj, fed in enumerate(self.fed):
            if fed is None or len(self.classes[fed[0]].instances) < 2:
                continue
            ci, (a, b) = fed[0], (choice[fed[0]], choice[cj])
            if (ci, a, cj, b) in self.refined:
                continue
            _, js = self._fed(cj, self.classes[cj], self._producers())
            back = self.prices[cj][b].gradients
            cts = [None] * len(self.prices[ci][a].outputs)
            for e, j in js.items():
                cts[j] = back[e]
            p = self._price(self.classes[ci], self.slot_of[ci], self.cands[ci][a], cts)
            self.refined[(ci, a, cj, b)] = p
            edge = next(k for k, ed in enumerate(self.edges) if (ed.a, ed.b) == (ci, cj))
            self.edges[edge].cost[a, b] += len(self.classes[ci].instances) * (p.time - self.prices[ci][a].time)
            changed = True
        return changed

    def part(self, choice: Sequence[int], ci: int) -> Priced:
        """Class ``ci``'s pricing under ``choice`` (refined where its consumer's gradient was taken into account)."""
        for cj, fed in enumerate(self.fed):
            if fed is not None and fed[0] == ci and (ci, choice[ci], cj, choice[cj]) in self.refined:
                return self.refined[(ci, choice[ci], cj, choice[cj])]
        return self.prices[ci][choice[ci]]

    def _producers(self) -> dict[int, tuple[int, int]]:
        """Serial -> (class, output) of the segment that makes it."""
        where = {}
        for ci, cls in enumerate(self.classes):
            for inst in cls.instances:
                for j, k in enumerate(inst.outputs):
                    where[inst.steps[k].out] = (ci, j)
        return where

    def _fed(self, ci: int, cls: L.LayerClass, where: dict) -> tuple[int, dict[int, int]] | None:
        """(the earlier class, input -> its output) when every activation flowing into ``cls`` comes from one
        earlier class: then ``cls`` is priced as that class's outputs reach it, not as it would like them."""
        src, feeds = None, {}
        for inst in cls.instances:
            for e, v in enumerate(inst.inputs):
                if v in self.serials or v not in where or where[v][0] == ci:
                    continue
                pa, j = where[v]
                if pa > ci or src not in (None, pa) or feeds.get(e, j) != j:
                    return None
                src, feeds[e] = pa, j
        return (src, feeds) if src is not None else None

    def _fed_candidates(self, cls: L.LayerClass, slots: list[Slot], pa: int, js: dict[int, int]):
        """The candidates of a class fed by class ``pa``: for each layout that class's candidates hand over, this
        class's own choices with its activations laid out so. Also per candidate, the layout it is fed.

        The layouts fed: the standard layouts'; those of the fastest producers that cut the activations on
        their batch and sequence dims only (a cheap producer, an embedding lookup, is fastest handing over its
        output cut on the hidden dim, which no layer after it wants); and the layouts this class's own fastest
        candidates take their activations in when free to choose, as the fastest producer handing each over
        does (behind an embedding lookup, the layers' best layout: 70B on 64 H100s, 1.26 s -> 0.82 s)."""
        by_feed: dict[tuple, dict] = {}
        ranked = sorted(range(len(self.prices[pa])), key=lambda a: self.prices[pa][a].time)
        wanted = set(self.named[pa].values())
        extra = 0
        for a in ranked:  # the layouts the fastest producers hand over, and the standard layouts'
            p = self.prices[pa][a]
            lay = {e: p.outputs[j] for e, j in js.items()}
            key = tuple(layout_key(lay[e]) for e in sorted(lay))
            if key in by_feed or a not in wanted and (extra >= FEEDS or not all(
                    data_dims_only(lay[e], slots[e]) for e in lay)):
                continue
            by_feed[key] = lay
            extra += a not in wanted
        free = sorted((self.price(cls, slots, c) for c in self.candidates(cls, slots)[0]), key=lambda p: p.time)
        for want in dict.fromkeys(tuple(layout_key(_strip(p.inputs[e])) for e in sorted(js)) for p in free[:FEEDS]):
            for a in ranked:  # the fastest producer handing it over (a sum may be pending)
                lay = {e: self.prices[pa][a].outputs[j] for e, j in js.items()}
                if tuple(layout_key(_strip(lay[e])) for e in sorted(lay)) == want:
                    by_feed.setdefault(tuple(layout_key(lay[e]) for e in sorted(lay)), lay)
                    break
        cands, feeds, named_by = [], [], {}
        for key, lay in by_feed.items():
            # the activations as they come; the arguments that carry the batch (targets, masks) cut as they are
            fslots = [sl._replace(free=(False,) * len(sl.shape), given=lay[e]) if e in lay else
                      sl._replace(free=(False,) * len(sl.shape), given=self._follow(sl, [(slots[k], lay[k])
                                                                                        for k in lay]))
                      if sl.leaf and sl.data and not sl.constrained else sl for e, sl in enumerate(slots)]
            c, nm = self.candidates(cls, fslots)
            named_by[key] = {n: len(cands) + i for n, i in nm.items()}
            cands += c
            feeds += [key] * len(c)
        named = {}
        for n, a in self.named[pa].items():
            p = self.prices[pa][a]
            key = tuple(layout_key(p.outputs[js[e]]) for e in sorted(js))
            if n in named_by.get(key, {}):
                named[n] = named_by[key][n]
        return cands, named, feeds

    def _follow(self, slot: Slot, fed: Sequence[tuple[Slot, Any]]) -> ShardingSpec:
        """An argument that carries the batch, laid out as the activations fed in are: each of its free batch and
        sequence dims cut over the axes the activations' dim of that role is cut over (its kept axes first)."""
        cut: dict[str, list] = {}
        for sl, spec in fed:
            for d, ds in enumerate(spec.dim_specs if spec is not None else ()):
                if d < len(sl.roles) and sl.roles[d] and sl.roles[d] not in cut:
                    cut[sl.roles[d]] = [a for a in ds.axes]
        dims, taken = [list(b) for b in slot.base], set(slot.used)
        for d, role in enumerate(slot.roles):
            for a in cut.get(role, []) if slot.free[d] else []:
                if a not in taken and slot.shape[d] % (_ways(self.mesh, dims[d]) * self.mesh.axis_size(a)) == 0:
                    dims[d].append(a)
                    taken.add(a)
        return ShardingSpec(self.mesh, [DimSpec(tuple(d)) for d in dims])

    def _edges(self) -> list[milp.Edge]:
        where = {}  # serial -> (class index, output index) of the segment that makes it
        seg_class = {}
        for ci, cls in enumerate(self.classes):
            for inst in cls.instances:
                seg_class[id(inst)] = ci
                for j, k in enumerate(inst.outputs):
                    where[inst.steps[k].out] = (ci, j, inst.steps[k])
        costs: dict[tuple, np.ndarray] = {}
        for ci, fed in enumerate(self.fed):  # a fed class's candidate takes only what its producer hands over
            if fed is not None:
                pa, feeds = fed
                _, js = self._fed(ci, self.classes[ci], self._producers())
                given = [tuple(layout_key(p.outputs[js[e]]) for e in sorted(js)) for p in self.prices[pa]]
                costs[(pa, ci)] = np.array([[0.0 if g == f else np.inf for f in feeds] for g in given])
        for ci, cls in enumerate(self.classes):
            for inst in cls.instances:
                for e, v in enumerate(inst.inputs):
                    if v not in where or where[v][0] == ci:
                        continue
                    if self.fed[ci] is not None and where[v][0] == self.fed[ci][0]:
                        continue
                    pa, j, st = where[v]
                    shape, item = st.out_shape, st.out_dtype.itemsize
                    src = [p.outputs[j] for p in self.prices[pa]]
                    dst = [p.inputs[e] for p in self.prices[ci]]
                    m = np.zeros((len(src), len(dst)))
                    for a, s in enumerate(src):
                        for b, d in enumerate(dst):
                            if s is None or d is None:
                                continue
                            t = reshard_time(shape, item, s, _strip(d), self.cluster)
                            if self.train:
                                t += reshard_time(shape, item, _strip(d), _strip(s), self.cluster)
                            m[a, b] = t
                    key = (pa, ci)
                    costs[key] = costs.get(key, 0) + m
        fed = {(f[0], ci) for ci, f in enumerate(self.fed) if f is not None}
        return [milp.Edge(a, b, np.array(m, dtype=float)) for (a, b), m in costs.items() if np.any(m) or (a, b) in fed]

    def realize(self, choice: Sequence[int]) -> list:
        """Per leaf, its spec under ``choice`` (a candidate per class; the first class that reads a leaf sets it)."""
        specs: list = [None] * len(self.leaves)
        for ci, cls in enumerate(self.classes):
            cand = self.cands[ci][choice[ci]]
            for inst in cls.instances:
                for e, v in enumerate(inst.inputs):
                    i = self.serials.get(v)
                    if i is not None and specs[i] is None and cand.layouts[e] is not None:
                        specs[i] = _strip(cand.layouts[e])
        for i, (x, lf) in enumerate(zip(self.leaves, self.info)):
            if isinstance(x, Tensor) and specs[i] is None:
                specs[i] = given_layout(self.mesh, lf)
            if lf.fixed is not None:
                specs[i] = lf.fixed
        return specs

    def measure(self, specs: Sequence[Any]) -> tuple[Report, float, float, dict]:
        """The real estimate of ``specs``: the report, memory per device including the optimizer state the program
        lacks, that state, and per parameter path the mesh axes its gradient was summed over (as logged)."""
        with C.comm_log() as log:
            rep = estimate(self.fn, self.cluster, self.overlap)(*self.abstract(specs))
        peak = max(rep.memory.peak.values(), default=0)
        extra = self.assumed(specs)
        sums: dict[str, set] = {}
        for st in log.steps:
            if st.phase == "backward" and str(st.user).startswith("grad of "):
                axes = sums.setdefault(str(st.user)[len("grad of "):], set())
                axes.update(a for e in st.events if e.kind in ("all_reduce", "reduce_scatter") for a in e.axes)
        return rep, peak + extra, extra, sums

    def assumed(self, specs: Sequence[Any]) -> float:
        """Bytes per device of the optimizer state the program does not hold (mixed-precision Adam's)."""
        ratio, assumed = self.opt_ratio
        if not assumed:
            return 0.0
        return sum(L.block_bytes(specs[i], self.info[i].shape, np.dtype(self.info[i].dtype).itemsize)
                   for i in self.params) * ratio

    def _handed_over(self, order: Sequence, parts: dict, fresh: Any) -> list[dict[int, int]]:
        """Per instance laid end to end, the names of the values it shares with its neighbours: an input is the
        output of the instance that makes it, and that output's cotangent the input's gradient."""
        made = {inst.steps[k].out: (n, j) for n, (_, inst) in enumerate(order) for j, k in enumerate(inst.outputs)}
        names: list[dict[int, int]] = [{} for _ in order]
        for n, (ci, inst) in enumerate(order):
            ins, _, _, gouts = parts[ci].names or ((), (), (), ())
            for e, v in enumerate(inst.inputs):
                if v not in made or e >= len(ins) or not ins[e]:
                    continue
                m, j = made[v]
                _, outs, cts, _ = parts[order[m][0]].names or ((), (), (), ())
                if j < len(outs) and outs[j]:
                    names[n][ins[e]] = names[m].setdefault(outs[j], next(fresh))
                if j < len(cts) and cts[j] and gouts[e]:
                    names[m][cts[j]] = names[n].setdefault(gouts[e], next(fresh))
        return names

    def stitched(self, choice: Sequence[int]) -> tuple[Report, float, float]:
        """The estimate of ``choice`` from the replayed layers laid end to end as the program runs them: every
        segment's forward steps, then each segment's backward steps (its gradient reductions among them, where
        its backward pass completes each gradient, as in a full run) in reverse; memory as the model counts it
        (held values of every segment, plus the largest transient)."""
        order = [(ci, inst) for inst in self.segs for ci, cls in enumerate(self.classes) if inst in cls.instances]
        self.refine(choice)
        parts = {ci: self.part(choice, ci) for ci in range(len(self.classes))}
        fresh = count(1)
        names = self._handed_over(order, parts, fresh)
        fwd, bwd = [], []
        for (ci, inst), given in zip(order, names):
            st = L.renamed(parts[ci].steps, fresh, inst.label or None, given)
            fwd.append([x for x in st if x.phase != "backward"])
            bwd.append([x for x in st if x.phase == "backward"])
        steps = [x for f in fwd for x in f] + [x for b in reversed(bwd) for x in b]
        t, mem = milp.evaluate(self.groups, self.edges, choice)
        extra = self.assumed(self.realize(choice))
        held = sum(parts[ci].held * len(self.classes[ci].instances) for ci in parts)
        top = max((p.transient for p in parts.values()), default=0.0)
        every = self.mesh.devices
        record = _Modelled({d: int(mem) for d in every},
                           {"held (parameters, gradients, optimizer, saved values)": {d: int(held) for d in every},
                            "temporaries": {d: int(top) for d in every}})
        rep = estimate_steps(steps, self.cluster, self.mesh, self.overlap, memory=record)
        return rep, mem, extra


class _Modelled(NamedTuple):
    """A memory record the model made (not ``nb.memory_log``'s): what a stitched estimate reports."""

    peak: dict
    by_kind: dict


#: stitched estimates within this fraction of the best are told apart by running both in full
CLOSE = 0.03
#: a forward program of at most this many steps is priced by running it (every layout compared runs the real
#: estimator); a larger one by its replayed layers laid end to end, and only the choice runs in full
EXACT_STEPS = 600


class Tried(NamedTuple):
    """A layout priced: its name (a standard layout's, or "search"), the candidate per class it came from, its spec
    per argument leaf, its estimate and the bytes per device it needs."""

    name: str
    choice: tuple
    specs: list
    report: Report
    memory: float  # bytes per device (optimizer state the program lacks included)
    extra: float  # of which optimizer state the program lacks
    full: bool = False  # the estimate ran the program (nb.estimate), rather than stitching replayed layers
    sums: dict | None = None  # when full: parameter path -> the mesh axes its gradient was summed over
