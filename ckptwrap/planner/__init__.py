"""The budget planner, in one place: profiling for plans, costs over input shapes, and the
solver that turns them into a :class:`Plan` (docs/layout.md maps its modules).

``ShapePlanner`` is the interface the marking layer plans through: at each training
forward, :meth:`ShapePlanner.begin` returns a :class:`PlannedStep` (what the forward runs
under, with the recorder of a measured step or the meter of a checked one), which the
marks follow and which hands the planner what it measured at the step's end; on given
inputs, :meth:`ShapePlanner.choose` measures one step (``measure_inputs``, its regions
run by the marking layer's runner). The rest is for the tools around it: the peak model
and solver (``CostItem``, ``predicted_peak``, ``solve_budget``), and the optimizers it prices. What
a step costs, measured or on fake tensors, is ``measure``'s.
"""

from ._device_memory import DeviceMemory, OPTIMIZERS, OptimizerSpec, optimizer_spec
from ._peak_model import CostItem, CostOption, format_bytes, predicted_peak, step_items
from ._plan import Plan, PlanEntry
from ._planner import Choice, Decision, PlannedStep, ShapePlanner
from ._shapes import PlanSettings, as_example, read_layout
from ._solver import BudgetSolution, smallest_reachable_peak, solve_budget

__all__ = [
    "BudgetSolution",
    "Choice",
    "CostItem",
    "CostOption",
    "Decision",
    "Plan",
    "PlanEntry",
    "PlanSettings",
    "PlannedStep",
    "ShapePlanner",
    "as_example",
    "DeviceMemory",
    "OPTIMIZERS",
    "OptimizerSpec",
    "optimizer_spec",
    "format_bytes",
    "predicted_peak",
    "read_layout",
    "smallest_reachable_peak",
    "solve_budget",
    "step_items",
]
