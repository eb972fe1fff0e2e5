"""Pytrees: nested dicts, lists and tuples (and named tuples) of tensors, flattened to their leaves and rebuilt,
as jax.tree_util does; what grad, jit, the optimizers and export walk arguments with."""

from __future__ import annotations

from typing import Any, Callable, Sequence



def flatten(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list, Any]:
    """Leaves (depth first, dicts in insertion order) and the structure to rebuild them with; ``is_leaf`` marks
    values taken whole (as jax.tree_util's)."""
    if is_leaf is not None and is_leaf(tree):
        return [tree], "leaf"
    if isinstance(tree, dict):
        leaves, defs = [], []
        for k, v in tree.items():
            lv, d = flatten(v, is_leaf)
            leaves += lv
            defs.append((k, d, len(lv)))
        return leaves, ("dict", tuple(defs))
    if isinstance(tree, (list, tuple)):
        leaves, defs = [], []
        for v in tree:
            lv, d = flatten(v, is_leaf)
            leaves += lv
            defs.append((d, len(lv)))
        return leaves, (type(tree), tuple(defs))
    if tree is None:
        return [], None
    return [tree], "leaf"


def unflatten(treedef: Any, leaves: Sequence) -> Any:
    leaves = list(leaves)
    if treedef == "leaf":
        return leaves[0]
    if treedef is None:
        return None
    kind, defs = treedef
    if kind == "dict":
        out, i = {}, 0
        for k, d, n in defs:
            out[k] = unflatten(d, leaves[i:i + n])
            i += n
        return out
    items, i = [], 0
    for d, n in defs:
        items.append(unflatten(d, leaves[i:i + n]))
        i += n
    if kind is tuple:
        return tuple(items)
    return kind(*items) if hasattr(kind, "_fields") else kind(items)  # a NamedTuple takes its fields


def _outline(tree: Any) -> str:
    """A pytree's structure in a line: dict keys, list and tuple lengths, leaves as their shapes."""
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k!r}: {_outline(v)}" for k, v in tree.items()) + "}"
    if isinstance(tree, (list, tuple)):
        inner = ", ".join(_outline(v) for v in tree)
        return f"[{inner}]" if isinstance(tree, list) else f"({inner}{',' if len(tree) == 1 else ''})"
    return "None" if tree is None else f"<{'x'.join(map(str, getattr(tree, 'shape', ()))) or 'scalar'}>"


def leaf_paths(tree: Any, prefix: str, dotted: bool = False) -> list[str]:
    """Each leaf's path in ``tree`` (as ``flatten`` orders them), JAX's keystr style: ``p['w1']``, ``layers[0]``;
    ``dotted``: ``p.w1``, ``layers.0`` (names an ONNX graph can hold)."""
    if isinstance(tree, dict):
        return [q for k, v in tree.items()
                for q in leaf_paths(v, f"{prefix}.{k}" if dotted else f"{prefix}[{k!r}]", dotted)]
    if isinstance(tree, (list, tuple)):
        return [q for i, v in enumerate(tree)
                for q in leaf_paths(v, f"{prefix}.{i}" if dotted else f"{prefix}[{i}]", dotted)]
    return [] if tree is None else [prefix]
