"""The interface every backend implements (its own module, so the backends build on it and the package
imports them): where arrays live, and the jobs an interpreter of recorded steps hands a backend (place,
add once, move, an operand's local steps, the kernel). Eager dispatch (``executor``) and ``nb.jit``
(``jit/lower``) run the same algorithm over them: the grid backends (``grid``: numpy, eager jax) do each
job on every device's blocks at once, ``jax_local`` on one device's block inside ``shard_map``."""

from __future__ import annotations

from typing import Any

import numpy as np


class Backend:
    """One place for arrays: its array namespace, how blocks reach their devices, and how to read them."""

    name = "?"

    def owns(self, a: Any) -> bool:
        """Whether array ``a`` lives on this backend."""
        raise NotImplementedError

    @property
    def xp(self) -> Any:
        """The numpy-like namespace kernels and moves call."""
        raise NotImplementedError

    def commit(self, x: Any, spec: Any) -> Any:
        """Stored blocks ``x`` (the grid of ``spec``'s own atoms in front) laid on the devices that own them;
        called after every placement, kernel and move. Also makes them immutable."""
        raise NotImplementedError

    def to_host(self, x: Any) -> np.ndarray:
        raise NotImplementedError

    def fill(self, x: Any, regions: tuple, value: Any) -> Any:
        """A copy of ``x`` with ``value`` written at each index tuple of ``regions``."""
        raise NotImplementedError

    # -- the interpreter's jobs (abstract runs, data None, go to ``shapes``: each job gives None) --
    def place(self, value: Any, spec: Any) -> Any:
        """A host value laid out as ``spec`` (each device keeps its block; no communication). Partial axes
        hold the value at coordinate 0 and the additive identity elsewhere."""
        raise NotImplementedError

    def add_once(self, x: Any, spec: Any, axes: tuple[str, ...], zero: Any = None) -> Any:
        """Blocks ``x`` laid out as ``spec`` made partial over ``axes`` as well: a value that joins a partial
        sum counts once per group, so it stays on coordinate 0 and ``zero`` (default: the additive identity,
        -0.0 for floats) goes elsewhere. Local: nothing moves."""
        raise NotImplementedError

    def move(self, x: Any, plan: Any, shape: tuple[int, ...] = (), reduce_op: str = "sum") -> Any:
        """Blocks ``x`` of a value of global ``shape`` carried through a reshard ``plan``, each step by its
        collective's registry entry (reductions combine with ``reduce_op``)."""
        raise NotImplementedError

    def regrid(self, x: Any, shape: tuple[int, ...]) -> Any:
        """Blocks seen on the kernel's common grid ``shape`` (its finer cuts); a device's own block is as is."""
        raise NotImplementedError

    def local(self, step: Any, x: Any) -> Any:
        """A factor kind's ``LocalStep`` (a halo exchange, a mirror) done to an operand's blocks."""
        raise NotImplementedError

    def bucket(self, entry: Any, blocks: list, plans: tuple, shapes: list) -> list:
        """Several partial values' blocks, each summed by its ``plan`` (one all_reduce over the same mesh axes, and
        local cuts), as one collective (DDP's fused gradient buffer) by ``entry``, the registry's ``"bucket"`` (its
        ``move`` on the grid, its ``lower`` on a device's block), so eager dispatch and ``nb.jit`` sum alike."""
        raise NotImplementedError

    def kernel(self, op: Any, arrays: list, prog: Any) -> Any:
        """``op``'s kernel on operands made ready for program ``prog`` (``executor.ready``), its result in
        ``prog.dtype`` laid out as ``prog.result`` (the post plan's moves done): one call site for eager
        dispatch and ``nb.jit``, so how a result is shaped, cast and moved cannot drift between them."""
        raise NotImplementedError

    def enter(self) -> Any:
        """Called when a ``with nb.backend(...)`` block starts; returns what ``leave`` needs to restore."""
        return None

    def leave(self, token: Any) -> None:
        return None
