"""Measuring one training step into a profile: the step runs with every outermost
candidate checkpointed (the plan of least memory, whose phases can be told apart), and
this recorder, fed by the candidates as they run and are recomputed, learns what each
would keep, take and cost if it were plain, and what the step held phase by phase.

The step may be the user's own (a training forward, the user's loss, the user's
backward: whatever they keep alive counts) or one run on example inputs
(``_profile``). Nothing runs that the step would not run: a candidate's saved tensors
are seen as its region drops them (``engine.observe_saved``), its operators through a
dispatch mode inside its forward, and its working set as it is recomputed (through the
same mode, put on the stack for the recomputation alone: the backward around it runs with
none, as an unmetered one does).

Bookkeeping never raises into the step: a failure ends the recording (``failed``) and
the step goes on as it would have.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import _torch_private
from .._warn import note
from ..engine import is_recomputing, observe_saved, saved_observer
from ..measure import SavePolicy, policy_watch, tensors
from ._calls import Call, CallBook
from ._module_costs import ModelProfile
from ._phases import PhaseMeter
from ._progress import ProgressBar
from ._records import Record
from ._step import by_phase

__all__ = ["StepRecorder"]


class StepRecorder:
    """Learns a profile from one step (see the module).

    Args:
        model: The model whose step is measured.
        targets: ``(qualified name, module)`` of every candidate, in model order; those
            nested in another are measured inside it, through forward hooks.
        device: Where the step allocates.
        save_policy: The selective tier's policy, if the candidates run under it.
        timed: Whether to keep times (a step run for its bytes alone keeps none).
        bar: A progress bar to move as candidates are measured.
        watch_base: Whether to follow what the forward saves outside the candidates
            through saved-tensor hooks of the model's forward (see ``begin``).
    """

    def __init__(
        self,
        model: nn.Module,
        targets: Sequence[Tuple[str, nn.Module]],
        device: torch.device,
        *,
        save_policy: Optional[SavePolicy] = None,
        timed: bool = True,
        bar: Optional[ProgressBar] = None,
        watch_base: bool = True,
    ) -> None:
        self.model = model
        self.phases = PhaseMeter(device)
        self.failed: Optional[str] = None
        self._policy = save_policy
        self._timed = timed
        self._watch_base = watch_base
        self._book = CallBook(targets, bar)
        names = [name for name, _ in targets]
        self.outermost = [
            (name, module) for name, module in targets
            if name and not any(name.startswith(other + ".") for other in names if other)
        ]
        outer = {id(module) for _, module in self.outermost}
        self._nested = [(name, module) for name, module in targets if id(module) not in outer]
        self._handles: List[Any] = []
        self._windows: Dict[int, List[Any]] = {}  # per nested module: windows open in recomputation
        self._base_hooks: Any = None
        self._outer_hooks: Any = None
        self._accumulated: List[Tuple[int, int]] = []  # (phase index, bytes) of grads that existed
        self.done = False

    # ------------------------------------------------------------------ the step

    def begin(self, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Start measuring, just before the model's forward runs on these inputs.

        Parameters, buffers and the inputs were there before the step: their storages
        never count. What the forward saves outside the candidates is seen through
        saved-tensor hooks pushed here and popped by :meth:`forward_done`; they hand each
        tensor on unchanged (to the hooks already in force, if any)."""
        model = self.model
        for tensor in [*model.parameters(), *model.buffers()]:
            self._book.exclude(tensor, state=True)
        for tensor in tensors((args, kwargs)):
            self._book.exclude(tensor)
        for name, module in self._nested:
            self._handles.append(module.register_forward_pre_hook(self._nested_pre, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._nested_post, always_call=True))
        for unit in _torch_private.fsdp2_units(model):
            # After FSDP2's own pre-hook (put first), which gathers the unit's parameters.
            self._handles.append(unit.register_forward_pre_hook(self._unit_gathered))
        for param in model.parameters():
            if param.requires_grad and param.grad is not None:
                # Accumulating into an existing gradient: a step from fresh gradients
                # would hold it from here on (see ``_grown``).
                self._handles.append(param.register_post_accumulate_grad_hook(self._grad_accumulated))
        self.phases.start()
        if self._watch_base and _torch_private.saved_tensors_hooks_enabled():
            self._outer_hooks = _torch_private.top_saved_tensors_hooks()
            self._base_hooks = torch.autograd.graph.saved_tensors_hooks(self._base_pack, self._base_unpack)
            self._base_hooks.__enter__()

    def forward_done(self, output: Any = None, *, follow: bool = True) -> None:
        """The model's forward returned ``output`` (or raised): stop following what it
        saves, leave the caller's mode stack and, with ``follow``, count the backward from
        the output's tensors that need grad (see ``PhaseMeter.follow``)."""
        hooks, self._base_hooks = self._base_hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        self.phases.leave()
        if follow and output is not None and self.failed is None:
            self.phases.follow([t for t in tensors(output) if t.requires_grad])

    def finish(self) -> Optional[ModelProfile]:
        """The step's backward has ended: the profile it gives, or None if the recording
        failed."""
        self.done = True
        self.forward_done(follow=False)
        self.phases.finish()
        self._remove_hooks()
        if self.failed is not None:
            return None
        try:
            return self._profile()
        except Exception as error:  # noqa: BLE001 - a recording must never break the step
            self._fail(error)
            return None

    def abandon(self, why: str) -> None:
        """End without a profile (the step never finished, or failed); nothing once
        finished."""
        if self.done:
            return
        self.done = True
        if self.failed is None:
            self.failed = why
        self.forward_done(follow=False)
        self.phases.finish()
        self._remove_hooks()

    # ------------------------------------------------------------------ candidates' regions

    def region(
        self,
        module: nn.Module,
        call: Callable[..., Any],
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        run: Callable[[Callable[..., Any]], Any],
    ) -> Any:
        """One call of an outermost candidate: ``run(fn)`` runs ``fn`` (``call``, watched)
        as the checkpointed region, with ``args`` and ``kwargs``."""
        record = self._book.records.get(id(module))
        if record is None or self.failed is not None or is_recomputing() or self.phases.finished:
            return run(call)
        self.phases.cut(f"forward:{record.name}")
        frame = self._guarded(self._book.begin, record, args, kwargs)
        observer = None if frame is None else self._saved
        with observe_saved(observer, self.phases.adopt):
            output = run(functools.partial(self._run_watched, record, frame, call))
        if frame is not None:
            self._guarded(self._book.end, frame, output)
        self.phases.cut(f"after:{record.name}")
        return output

    def _run_watched(self, record: Record, frame: Optional[Call], call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The region's function: in the forward, the candidate's operators recorded; in
        the recomputation, its phase cut and its working set followed."""
        if is_recomputing():
            if self.failed is not None or self.phases.finished:
                return call(*args, **kwargs)
            self.phases.cut(f"recompute:{record.name}")
            window = self.phases.window()
            try:
                # A forward inside a node of the backward: counted by operators, as the
                # forward was (the backward itself runs with no dispatch mode).
                with self.phases.counting():
                    return call(*args, **kwargs)
            finally:
                self._guarded(self._book.recomputed, record, window.close())
                self.phases.cut(f"backward:{record.name}")
        if frame is None:
            return call(*args, **kwargs)
        with frame.ops, policy_watch(self._policy, frame.policy_tally):
            return call(*args, **kwargs)

    def _nested_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        record = self._book.records[id(module)]
        if self.failed is not None or self.phases.finished:
            return None
        if is_recomputing():
            self._windows.setdefault(id(module), []).append(self.phases.window())
            return None
        frame = self._guarded(self._book.begin, record, tuple(args), dict(kwargs))
        if frame is not None:
            frame.ops.__enter__()
            if self._policy is not None:
                frame.policy_mode = policy_watch(self._policy, frame.policy_tally)
                frame.policy_mode.__enter__()
        return None

    def _nested_post(self, module: nn.Module, args: Any, output: Any) -> None:
        record = self._book.records[id(module)]
        windows = self._windows.get(id(module))
        if is_recomputing():
            if windows:
                self._guarded(self._book.recomputed, record, windows.pop().close())
            return None
        frame = next((f for f in reversed(self._book.stack) if f.record is record), None)
        if frame is None:
            return None
        if frame.policy_mode is not None:
            frame.policy_mode.__exit__(None, None, None)
        frame.ops.__exit__(None, None, None)
        self._guarded(self._book.end, frame, output)
        return None

    # ------------------------------------------------------------------ bookkeeping

    def _guarded(self, work: Callable[..., Any], *args: Any) -> Any:
        if self.failed is not None:
            return None
        try:
            return work(*args)
        except Exception as error:  # noqa: BLE001 - a recording must never break the step
            self._fail(error)
            return None

    def _fail(self, error: BaseException) -> None:
        self.failed = f"{type(error).__name__}: {error}"
        note(f"ckptwrap stopped measuring a step of {type(self.model).__name__}: {self.failed}")

    def _saved(self, tensor: torch.Tensor) -> None:
        """A tensor an outermost region saves."""
        if self.failed is None:
            self._guarded(self._book.saved, tensor)

    def _base_pack(self, tensor: torch.Tensor) -> Any:
        """Note what the forward saves outside the candidates, and hand it on: packed by
        the hooks in force, if any, else detached (as ``Tally.pack`` keeps it; autograd
        gives it back its ``grad_fn`` when it unpacks it). Kept as it is, an operator's
        own output saved by its node (``exp`` saves its result) would hold that node
        through its ``grad_fn``: a cycle through C++ that no garbage collection breaks,
        freed only if the backward runs the node. An output the loss never reads then
        outlived the step, unlike unmetered (Wan's VAE: its posterior's ``std`` and
        ``var``, and through them the moments they came from: 6,144 bytes)."""
        # While a region saves its own inputs on entry, it is that region keeping them.
        if self.failed is None and saved_observer() is None and not is_recomputing():
            self._guarded(self._book.base_saved, tensor)
        outer = self._outer_hooks
        return tensor.detach() if outer is None else outer[0](tensor)

    def _base_unpack(self, packed: Any) -> torch.Tensor:
        outer = self._outer_hooks
        return packed if outer is None else outer[1](packed)

    def _unit_gathered(self, module: nn.Module, args: Any) -> None:
        """An FSDP2 unit is called, its parameters gathered by FSDP2 just before: they are
        its state, as a candidate's are (``CallBook.begin``), never activations.

        Its operators save them (a linear layer's weight, for its input's gradient), and
        what the forward saves outside the candidates is counted at the bytes it has
        when saved, as held to the backward. But FSDP2 frees a unit's gathered parameters
        after its forward (``resize_(0)`` of their storages) and gathers them again for
        its backward: with no candidate around a unit, every unit's gathered parameters
        were counted as activations held at once. Under ``none``, whose peak is the
        larger of that count and the step's measured one, a rank of Llama-8B sharded per
        layer over 8 ranks read 41,553 MiB at 32 layers and 4,096 tokens where the step
        holds 34,669 (all 32 layers' 416 MiB counted; at 16 layers +1%, the logits and
        their gradient outweighing most of them). The step itself counts them while they
        are gathered, as the counter follows the resizes."""
        self._guarded(self._book.gathered, module)

    def _grad_accumulated(self, param: torch.Tensor) -> None:
        self._accumulated.append((len(self.phases._labels) - 1, param.nbytes))

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for windows in self._windows.values():
            for window in windows:
                window.close()
        self._windows.clear()

    # ------------------------------------------------------------------ the profile

    def _profile(self) -> ModelProfile:
        book = self._book
        book.finish_joins()
        phases = _grown(self.phases.phases, self._accumulated)
        step = by_phase(phases, self.phases.at_allocator)
        if not self._timed:
            step = dataclasses.replace(step, seconds={})
        kept = sum(record.outer_kept for record in book.order)
        policy = self._policy is not None
        return ModelProfile(
            modules=tuple(book.cost(record, timed=self._timed, policy=policy) for record in book.order),
            total_activation_bytes=book.base.bytes + kept,
            base_bytes=book.base.bytes,
            step=step,
        )


def _grown(phases: List[Any], accumulated: List[Tuple[int, int]]) -> List[Any]:
    """Phases as a step from fresh gradients would have held them: a gradient that
    existed before the step was accumulated into, where a fresh step would have kept the
    new one from then on."""
    if not accumulated:
        return phases
    grown = []
    extra = 0
    for index, phase in enumerate(phases):
        extra += sum(nbytes for at, nbytes in accumulated if at == index)
        if extra:
            phase = phase._replace(peak=phase.peak + extra, moments=tuple(m + extra for m in phase.moments))
        grown.append(phase)
    return grown
