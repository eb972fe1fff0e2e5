"""Plan, then move: a pure, cached planner from (shape, dtype, source spec, target spec) to the cheapest
sequence of collectives under the cost model (``search``), each move naming its registered collective (``moves``;
a backend carries a plan out: ``Backend.move``). The planner searches over move generators (local slices, all_gather,
all_to_all, reduce_scatter, all_reduce) on the mesh atoms, plus a general exchange in which every device
receives exactly the pieces it lacks (collective_permute rounds, ``exchange``); ``lower_bound`` is what no plan
can beat (``bounds``)."""

from __future__ import annotations

from .bounds import boxes, lacking, lower_bound
from .exchange import Exchange, Round, exchange_detail, exchange_rounds, planned_exchange
from .moves import (GENERATORS, LegalMoves, Move, Segment, State, cuts_before_reductions, gathers,
                    local_slices, reductions, register_generator, spec_of, unregister_generator)
from .search import Hop, Plan, _plan, plan  # _plan: the plan cache itself (reshard._plan.cache_info())

__all__ = ["Exchange", "GENERATORS", "Hop", "LegalMoves", "Move", "Plan", "Round", "Segment", "State", "boxes",
           "cuts_before_reductions", "exchange_detail", "exchange_rounds", "gathers", "lacking", "local_slices",
           "lower_bound", "plan", "planned_exchange", "reductions", "register_generator", "spec_of",
           "unregister_generator"]
