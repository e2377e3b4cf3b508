"""From the profile's measured step to the solver's step terms: what each candidate's
backward and recomputation hold beyond activations, and what the end of the forward does.

The profile ran one training step with every candidate checkpointed and kept each phase's
peak (``measure.StepPeaks``). The solver's peak model (``policy._cost_model``) predicts
that very step from the activation terms it knows plus ``grads``, ``recompute_grads`` and
``tail``; each of those is the measured phase peak minus the model's activation terms for
that plan. Gradients, backward temporaries and parameter gradients do not depend on what
is checkpointed, so the same terms then predict every other plan.
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Tuple

from ._profile import ModelProfile
from ._solver import CostItem

__all__ = ["with_step_terms"]


def with_step_terms(
    ordered: Sequence[Tuple[str, CostItem]], profile: ModelProfile
) -> Tuple[List[Tuple[str, CostItem]], int]:
    """``ordered`` (the solver's items in forward order) with ``forward``, ``grads`` and
    ``recompute_grads`` filled in from the profile's step, and the solver's ``tail``.

    Without a measured step the items are returned as they are and the tail is 0: the
    model then predicts the activation peak only.
    """
    step = profile.step
    if step is None:
        return list(ordered), 0
    base = profile.base_bytes
    held = joined = 0  # what the candidates before hold in the measured (all-checkpointed) step
    result: List[Tuple[str, CostItem]] = []
    for name, item in ordered:
        carried = item.joins or 0
        joined += carried
        recompute, backward = step.recompute.get(name), step.backward.get(name)
        forward = step.forward.get(name)
        if item.before is not None and forward is not None:
            # Its forward: the base saved before it, what the candidates before it hold
            # and its own earlier calls' checkpoints, its input, and its own working set.
            earlier = item.inputs - item.call_inputs
            item = dataclasses.replace(
                item, forward=max(0, forward - (item.before - joined + held + carried + earlier))
            )
        if item.before is not None and recompute is not None and backward is not None:
            under = item.before - joined + held + carried + item.inputs
            item = dataclasses.replace(
                item,
                recompute_grads=max(0, recompute - under - item.rebuilt),
                grads=max(0, backward - (under - item.saved) - item.call_kept),
            )
        held += carried + item.inputs
        result.append((name, item))
    tail = max(0, step.end - (base - joined + held))
    return result, tail

