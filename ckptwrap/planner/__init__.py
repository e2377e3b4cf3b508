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

from ._costs import ModelProfile, ModuleCost, OpCost, StepPeaks, packet_name, region_bytes
from ._device_memory import DEVICE_MARGIN, DeviceMemory, OPTIMIZERS, OptimizerSpec, StepBudget, optimizer_spec
from ._metering import ProgressBar, StepRecorder, measure_inputs, resolve_targets, should_show
from ._peak_model import (
    CostItem,
    CostOption,
    format_bytes,
    forward_items,
    forward_levels,
    predicted_peak,
    with_step_terms,
)
from ._plan import Plan, PlanEntry
from ._planner import Choice, Decision, PlannedStep, ShapePlanner, step_items
from ._shapes import InputLayout, PlanSettings, as_example, is_measuring, read_layout
from ._solver import (
    BudgetSolution,
    PercentBudget,
    lowest_plan,
    pooled_times,
    resolve_budget,
    smallest_reachable_peak,
    solve_budget,
)
from ._unreal import DEVICE_RATES, DeviceRates, device_rates, outside_fake, step_device, unreal

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
    "PlannedStep",
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
    "ProgressBar",
    "measure_inputs",
    "resolve_targets",
    "should_show",
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
