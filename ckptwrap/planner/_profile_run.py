"""How one profile runs: a memory pass and a timing pass over the model's forward, and the
forward hooks that measure each candidate call in them.

Storage bookkeeping is ``measure``'s, the candidates' records are in ``_records``, timing
and RNG state in ``_timing``.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._hf import cache_free_arguments, fresh_caches
from ..measure import (
    SavePolicy,
    StorageCounter,
    StorageMap,
    Tally,
    differentiable,
    policy_watch,
    saving,
    tensor_storages,
    tensors,
)
from ._ops import OpRecorder, merge_calls, with_times
from ._progress import ProgressBar
from ._records import InputLedger, Record, _Frame, _highest
from ._timing import (
    RngState, device_of, time_forward, time_ops, time_replay, time_unsaved_replay,
)

__all__ = ["Record", "SavePolicy", "Session"]


class Session:
    """One profile: the memory pass, then the timing pass, with the hooks they need."""

    def __init__(
        self,
        model: nn.Module,
        targets: List[Tuple[str, nn.Module]],
        args: Tuple[Any, ...],
        kwargs: Dict[str, Any],
        *,
        repeats: int,
        bar: ProgressBar,
        save_policy: Optional[SavePolicy] = None,
    ) -> None:
        self._model = model
        self._policy = save_policy
        self._calls = 0  # outermost candidate calls so far in the memory pass
        # The last outermost candidate call's output, as the model's forward received it.
        self._last_output: Optional[Tuple[Record, torch.Tensor]] = None
        self._args = args
        self._kwargs = kwargs
        self._repeats = repeats
        self._bar = bar
        self._records = {id(module): Record(name, module) for name, module in targets}
        self.records: List[Record] = list(self._records.values())
        state = [*model.parameters(), *model.buffers()]
        self._state_storages = StorageMap.of(state)
        inputs = tensors((args, kwargs))
        self._excluded = self._state_storages.union(StorageMap.of(inputs))
        # Without any tensor that needs grad, nothing in the model's forward would need it.
        self._grad_possible = any(t.requires_grad for t in [*model.parameters(), *inputs])
        devices = {t.device for t in [*state, *inputs]}
        self._devices = [d for d in devices if d.type not in ("cpu", "meta")]
        self.start_rng = RngState(self._devices)
        self._base = Tally(self._excluded)
        self._frames: List[_Frame] = []
        self._inputs = InputLedger(self._excluded, self._base, self.records)
        # True while a measurement runs: candidates called inside it are not calls of their own.
        self._busy = False
        self._seen_in_pass: set = set()
        self._selective_warm = False

    def run(self) -> None:
        """Run both passes; afterwards ``records`` and ``base_bytes`` hold the results."""
        handles: List[Any] = []
        try:
            handles += self._hook(self._memory_pre, self._memory_post)
            handles += [
                module.register_forward_pre_hook(self._note_state, prepend=True)
                for module in self._model.modules()
            ]
            # Each pass writes into its own copy of any KV cache given, not the caller's.
            args, kwargs = fresh_caches(self._args, self._kwargs)
            with torch.enable_grad(), saving(self._base):
                output = self._model(*args, **kwargs)
            del output
            self._end_pass()
            for handle in handles:
                handle.remove()
            handles.clear()
            if self._repeats:
                # The same RNG stream as the memory pass, so the forward takes the same branches.
                self.start_rng.restore()
                self._bar.set_label("timing")
                handles += self._hook(self._time_pre, self._time_post)
                args, kwargs = fresh_caches(self._args, self._kwargs)
                with torch.no_grad():
                    self._model(*args, **kwargs)
                self._end_pass()
        finally:
            for handle in handles:
                handle.remove()

    def _note_state(self, module: nn.Module, args: Any) -> None:
        """Exclude the parameters and buffers a module holds as it is called: FSDP2 swaps
        its sharded parameters for gathered ones just before, and those are its state,
        gathered and freed by FSDP2, not activations (a ``Linear`` saves its weight)."""
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            for storage in tensor_storages(tensor):
                if storage not in self._state_storages:
                    self._state_storages.setdefault(storage, None)
                    self._excluded.setdefault(storage, None)

    @property
    def base_bytes(self) -> int:
        """Bytes of the storages the memory pass counted outside the candidates."""
        return self._base.bytes

    def _hook(self, pre: Callable[..., Any], post: Callable[..., Any]) -> List[Any]:
        handles = []
        for record in self.records:
            handles.append(record.module.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(record.module.register_forward_hook(post))
        return handles

    def _end_pass(self) -> None:
        self._last_output = None
        for record in self.records:
            # A chain needs both ends called once; a later call may have shown otherwise.
            joined = record.joined
            record.joins_previous = (
                record.joins_previous and record.calls == 1 and joined is not None and joined.calls == 1
            )
        self._bar.update(len(self._records) - len(self._seen_in_pass))
        self._seen_in_pass = set()

    def _enter(self, module: nn.Module) -> Optional[Record]:
        """The module's record if this call is to be measured, else ``None``."""
        if self._busy:
            return None
        record = self._records[id(module)]
        record.depth += 1
        if record.depth > 1:
            return None
        if id(module) not in self._seen_in_pass:
            self._seen_in_pass.add(id(module))
            self._bar.update()
        return record

    def _leave(self, module: nn.Module) -> bool:
        """Whether the call that ends now was measured."""
        if self._busy:
            return False
        record = self._records[id(module)]
        record.depth -= 1
        return record.depth == 0

    def _needs_grad(self, tensor: torch.Tensor, *, guess: bool) -> bool:
        """Whether ``tensor`` requires grad in a plain forward with autograd on.

        Inside another candidate the forward runs under no_grad, so the answer is a guess:
        an activation needs grad when anything in the model does.
        """
        if tensor.requires_grad or not guess or not differentiable(tensor):
            return tensor.requires_grad
        if self._excluded.holds(tensor):
            return False
        return self._grad_possible

    def _memory_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        record = self._enter(module)
        if record is None:
            return None
        nested = bool(self._frames)
        grad = self._frames[-1].grad if nested else torch.is_grad_enabled()
        call_args, call_kwargs = _as_checkpointed(module, args, kwargs)
        inputs = tensors((call_args, call_kwargs))
        grads = [self._needs_grad(t, guess=nested) for t in inputs]
        run_args, run_kwargs, run_inputs = self._copies(call_args, call_kwargs, grads)
        input_storages = StorageMap.of(run_inputs)
        tally = Tally(self._excluded, inputs=input_storages)
        policy_tally = Tally(self._excluded.union(input_storages))
        # What a recomputation holds at its highest: saved tensors and temporaries alike.
        meter = StorageCounter(device_of(run_inputs, module).type, trace=True)
        recorder = OpRecorder(tally)
        self._busy = True
        try:
            # The module's forward alone, skipping its hooks (they ran for the real call);
            # the RNG is put back so the real call draws the same numbers.
            with RngState(self._devices).kept(), torch.set_grad_enabled(grad):
                with saving(tally), policy_watch(self._policy, policy_tally), meter:
                    with recorder:
                        output = module.forward(*run_args, **run_kwargs)
            outputs = tensors(output)
            out_grads = [t.requires_grad for t in outputs]
            frame = _Frame(nested, grad, out_grads, [tally.holds(t) for t in outputs])
            record.output_bytes += Tally(self._state_storages).add_tensors(outputs).bytes
            del output, outputs
        finally:
            self._busy = False
        record.calls += 1
        record.kept_bytes += tally.bytes
        record.call_kept_bytes = max(record.call_kept_bytes, tally.bytes)
        record.created_bytes += meter.created_bytes
        record.forward_moments = _highest(record.forward_moments, tuple(meter.moments))
        record.outer_kept += 0 if nested else tally.bytes
        record.flops += recorder.flops
        record.forward_peak_bytes = max(record.forward_peak_bytes, meter.peak_bytes)
        record.policy_saved_bytes += policy_tally.bytes
        record.policy_saved_kept_bytes += policy_tally.shared_bytes(tally)
        record.call_modes.append((grads, grad))
        record.ops = merge_calls(record.ops, recorder.ops(), first=record.calls == 1)
        self._frames.append(frame)
        if nested:
            call_inputs = Tally(self._excluded).add_tensors(inputs).bytes
            record.input_bytes += call_inputs
            record.call_input_bytes = max(record.call_input_bytes, call_inputs)
            return None
        # Inputs the module saves stay alive in a real forward, but as no candidate's
        # kept bytes: they belong to the base.
        saved = [t for t, copy in zip(inputs, run_inputs) if tally.input_hits.holds(copy)]
        self._inputs.add(record, inputs, saved, self._calls)
        # Whether the call continues a chain depends on how the forward really called it.
        self._note_join(record, args, kwargs, saved)
        self._base.add_tensors(saved)
        # Backward reaches this call once everything saved after it is freed.
        record.base_before_bytes, record.position = self._base.bytes, self._calls
        if record.first_position < 0:
            record.first_position = self._calls
        self._calls += 1
        torch.set_grad_enabled(False)
        return None

    def _memory_post(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not self._leave(module):
            return None
        frame = self._frames.pop()
        if frame.nested:
            return None
        torch.set_grad_enabled(frame.grad)
        record = self._records[id(module)]
        output = self._stand_in(output, frame, record)
        if isinstance(output, torch.Tensor):
            self._last_output = (record, output)
        return output

    def _stand_in(self, output: Any, frame: _Frame, record: Record) -> Any:
        """Outputs that need grad like those of a forward with autograd on, so that what
        follows the module saves for backward what it would in a real forward."""
        leaves, spec = tree_flatten(output)
        known = sum(isinstance(leaf, torch.Tensor) for leaf in leaves) == len(frame.out_grads)
        index = 0
        for position, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                continue
            if known:
                needs_grad = frame.out_grads[index]
                if frame.out_kept[index]:
                    self._hand_over(leaf, record)
            else:
                needs_grad = frame.grad and self._needs_grad(leaf, guess=True)
            index += 1
            if needs_grad and not leaf.requires_grad and differentiable(leaf):
                leaves[position] = leaf.detach().requires_grad_()
        return tree_unflatten(leaves, spec)

    def _note_join(self, record: Record, args: Any, kwargs: Any, saved: List[torch.Tensor]) -> None:
        """Whether this call continues a chain: its only input is the output the previous
        candidate call handed to the model's forward. If anything after it saves that input
        as well, a segment through both would not free it: the chain is then broken."""
        previous, self._last_output = self._last_output, None
        record.joins_previous = bool(
            previous is not None
            and record.calls == 1
            and previous[0].calls == 1
            and not kwargs
            and len(args) == 1
            and args[0] is previous[1]
        )
        if not record.joins_previous:
            return
        record.joined = previous[0]  # type: ignore[index]

        def seen_again() -> None:
            record.joins_previous = False

        for storage in (s for tensor in saved for s in tensor_storages(tensor)):
            self._base.watched[storage] = seen_again

    def _hand_over(self, output: torch.Tensor, record: Record) -> None:
        """An output the module saves is in its kept bytes. If what follows saves it too
        (the next block's first layer, say), checkpointing the module does not free it:
        it is then counted in the base, and noted as handed over."""

        def claim(nbytes: int) -> None:
            record.handed_over_bytes += nbytes
            record.outer_kept -= nbytes

        # Keyed by the storage itself, never by a bare address: if nothing saves the output
        # it is freed, and a later storage at its address must not take the claim.
        for storage in tensor_storages(output):
            self._base.claims.setdefault(storage, claim)

    def _time_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        record = self._enter(module)
        if record is None:
            return None
        args, kwargs = _as_checkpointed(module, args, kwargs)
        inputs = tensors((args, kwargs))
        index, record.timed = record.timed, record.timed + 1
        grads, grad = [self._needs_grad(t, guess=True) for t in inputs], True
        modes = record.call_modes
        if index < len(modes) and len(modes[index][0]) == len(inputs):
            grads, grad = modes[index]
        run_args, run_kwargs, run_inputs = self._copies(args, kwargs, grads)
        device = device_of(run_inputs, module)
        self._busy = True
        try:
            with RngState(self._devices).kept(), torch.set_grad_enabled(grad):
                samples = [
                    time_forward(module, run_args, run_kwargs, device)
                    for _ in range(self._repeats)
                ]
                op_runs = [
                    time_ops(module, run_args, run_kwargs, device) for _ in range(self._repeats)
                ]
                if not self._selective_warm:
                    # Its first use pays one-time costs that no step pays again.
                    time_unsaved_replay(module, run_args, run_kwargs, device)
                    self._selective_warm = True
                selective = [
                    time_unsaved_replay(module, run_args, run_kwargs, device)
                    for _ in range(self._repeats)
                ]
                replays = samples
                if self._policy is not None:
                    replays = [
                        time_replay(module, run_args, run_kwargs, device, self._policy)
                        for _ in range(self._repeats)
                    ]
        finally:
            self._busy = False
        record.forward_time += statistics.median(samples)
        record.recompute_time += statistics.median(replays)
        # What the selective dispatch mode adds to a forward, whatever it saves.
        record.selective_overhead += max(0.0, statistics.median(selective) - statistics.median(samples))
        record.ops = with_times(record.ops, op_runs)
        return None

    def _time_post(self, module: nn.Module, args: Any, output: Any) -> None:
        self._leave(module)

    def _copies(
        self, args: Any, kwargs: Any, grads: List[bool]
    ) -> Tuple[Any, Any, List[torch.Tensor]]:
        """Inputs for a measurement, cut from the model's graph and its data.

        Activations are copied, so a module that changes its input in place neither changes
        the real forward's data nor meets autograd's ban on changing a leaf; those that need
        grad become non-leaves, as in a real forward. Parameters and buffers are only detached.
        """
        leaves, spec = tree_flatten((args, kwargs))
        wanted = iter(grads)
        copies: List[torch.Tensor] = []
        with torch.enable_grad():
            for position, leaf in enumerate(leaves):
                if not isinstance(leaf, torch.Tensor):
                    continue
                needs_grad = next(wanted) and differentiable(leaf)
                copy = leaf.detach()
                if self._state_storages.holds(leaf):
                    copy.requires_grad_(needs_grad)
                else:
                    copy = copy.requires_grad_(needs_grad).clone()
                leaves[position] = copy
                copies.append(copy)
        run_args, run_kwargs = tree_unflatten(leaves, spec)
        return run_args, run_kwargs, copies


def _as_checkpointed(module: nn.Module, args: Any, kwargs: Any) -> Tuple[Any, Any]:
    """The arguments a checkpointed call of ``module`` gets: a layer that would write a KV
    cache gets none. The measurement runs the forward besides the real call, so a write
    there would be a second one, whether the module is later checkpointed or not."""
    rewritten = cache_free_arguments(module, tuple(args), dict(kwargs))
    return (args, kwargs) if rewritten is None else rewritten
