"""Cost formulas: communication (α-β), compute (roofline) and memory, each citing its source.

Graph walks that apply these formulas to nodes live in ``autopar.passes``; this package holds the
arithmetic only, so one formula has one home.
"""

from autopar.cost.comm import (
    all_gather_cost,
    all_reduce_cost,
    all_to_all_cost,
    p2p_cost,
    reduce_scatter_cost,
)
from autopar.cost.compute import roofline_time
from autopar.cost.memory import OPTIMIZER_BYTES_PER_PARAM, training_state_bytes

__all__ = [
    "OPTIMIZER_BYTES_PER_PARAM",
    "all_gather_cost",
    "all_reduce_cost",
    "all_to_all_cost",
    "p2p_cost",
    "reduce_scatter_cost",
    "roofline_time",
    "training_state_bytes",
]
