"""The budget planner, in one place: profiling for plans, costs over input shapes, and the
solver that turns them into a :class:`Plan`.

``ShapePlanner`` is the interface the marking layer plans through: for each training
forward it returns a :class:`Decision` (the plan solved for that shape, or: run the plan
of least memory and measure the step with a :class:`StepRecorder`, then hand the
profile back), and it takes the readings of checked steps. The rest is for the tools
around it: the profiler on given inputs (``profile_modules``), the peak model and solver
(``CostItem``, ``predicted_peak``, ``solve_budget``), the items of a profile
(``forward_items``, ``with_step_terms``).
"""

from ._choose import Choice, step_items
from ._peak_model import CostItem, CostOption, format_bytes, predicted_peak
from ._inputs import InputLayout, as_example, read_layout
from ._items import forward_items, forward_levels, with_step_terms
from ._ops import OpCost, packet_name
from ._plan import Plan, PlanEntry
from ._measuring import PlanSettings, is_measuring
from ._step import region_bytes
from ._planner import Decision, ShapePlanner
from ._recorder import StepRecorder
from ._module_costs import ModelProfile, ModuleCost
from ._profile import profile_modules
from ._rates import DEVICE_RATES, DeviceRates, device_rates
from ._device_memory import DEVICE_MARGIN, DeviceMemory, StepBudget
from ._optimizer import OPTIMIZERS, OptimizerSpec, optimizer_spec
from ._unreal import outside_fake, step_device, unreal
from ._solver import (
    BudgetSolution,
    PercentBudget,
    lowest_plan,
    pooled_times,
    resolve_budget,
    smallest_reachable_peak,
    solve_budget,
)
from ._step import StepPeaks

__all__ = [
    "BudgetSolution",
    "Choice",
    "CostItem",
    "CostOption",
    "Decision",
    "InputLayout",
    "ModelProfile",
    "ModuleCost",
    "OpCost",
    "PercentBudget",
    "Plan",
    "PlanEntry",
    "PlanSettings",
    "ShapePlanner",
    "StepPeaks",
    "StepRecorder",
    "as_example",
    "DEVICE_RATES",
    "DeviceRates",
    "device_rates",
    "DEVICE_MARGIN",
    "DeviceMemory",
    "OPTIMIZERS",
    "OptimizerSpec",
    "StepBudget",
    "optimizer_spec",
    "format_bytes",
    "is_measuring",
    "forward_items",
    "forward_levels",
    "lowest_plan",
    "packet_name",
    "pooled_times",
    "predicted_peak",
    "profile_modules",
    "read_layout",
    "region_bytes",
    "resolve_budget",
    "smallest_reachable_peak",
    "solve_budget",
    "step_device",
    "outside_fake",
    "unreal",
    "step_items",
    "with_step_terms",
]
