"""The budget planner, in one place: profiling for plans, costs over input shapes, and the
solver that turns them into a :class:`Plan`.
"""

from ._costs import (
    MeasuredChoice,
    as_example,
    forward_items,
    forward_levels,
    measure_and_choose,
    resolve_budget,
)
from ._ops import OpCost, packet_name
from ._plan import Plan, PlanEntry
from ._profile import ModelProfile, ModuleCost, profile_modules
from ._progress import should_show
from ._shapes import CAPACITY, ShapePlans, Shapes, bucket_of, describe, input_shapes
from ._solver import (
    BudgetSolution,
    CostItem,
    CostOption,
    PercentBudget,
    format_bytes,
    pooled_times,
    predicted_peak,
    smallest_reachable_peak,
    solve_budget,
)
from ._step import StepPeaks
from ._step_terms import with_step_terms

__all__ = [
    "BudgetSolution",
    "CAPACITY",
    "CostItem",
    "CostOption",
    "MeasuredChoice",
    "ModelProfile",
    "ModuleCost",
    "OpCost",
    "PercentBudget",
    "Plan",
    "PlanEntry",
    "ShapePlans",
    "Shapes",
    "StepPeaks",
    "as_example",
    "bucket_of",
    "describe",
    "format_bytes",
    "forward_items",
    "forward_levels",
    "input_shapes",
    "measure_and_choose",
    "packet_name",
    "pooled_times",
    "predicted_peak",
    "profile_modules",
    "resolve_budget",
    "should_show",
    "smallest_reachable_peak",
    "solve_budget",
    "with_step_terms",
]
