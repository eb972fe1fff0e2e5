"""Seeing what happens: ``nb.visualize_sharding`` (which device holds which block; ``visualize``) and ``nb.explain``
(op by op, the shardings chosen and every collective with its reason and cost; ``explainer``). Both read what the
executor recorded; neither changes it."""

from .explainer import explain, explain_steps
from .visualize import render_sharding, short, visualize_sharding

__all__ = ["explain", "explain_steps", "render_sharding", "short", "visualize_sharding"]
