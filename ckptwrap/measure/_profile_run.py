"""How one profile runs: a memory pass and a timing pass over the model's forward, the
forward hooks that measure each candidate call in them, and the tally of saved storages.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import FlopCounterMode

from ._peak import _StorageCounter
from ._progress import ProgressBar

__all__ = ["Record", "Session", "SavePolicy"]

SavePolicy = Callable[..., CheckpointPolicy]
"""A selective-checkpointing policy: ``policy(ctx, op, *args, **kwargs)`` says whether the
output of ``op`` is saved (``MUST_SAVE``/``PREFER_SAVE``) or recomputed."""
_SAVES = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def _tensor_storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``tensor``; a wrapper subclass (DTensor...) by its inner tensors."""
    if is_traceable_wrapper_subclass(tensor):
        attrs, _ = tensor.__tensor_flatten__()
        for attr in attrs:
            yield from _tensor_storages(getattr(tensor, attr))
        return
    try:
        yield tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        # Sparse and some other layouts have no single storage; they are rare as
        # activations, and counting them some other way would not be comparable.
        return


def _tensors(value: Any) -> List[torch.Tensor]:
    return [leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor)]


def _differentiable(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


class _Tally:
    """Distinct storages, by the address of their C++ object, with their total bytes.

    A weak reference to every storage seen pins that address, so a storage freed during the
    count cannot be mistaken for a new one allocated at the same place, yet no memory is kept.
    """

    def __init__(self, excluded: Iterable[int] = (), inputs: Iterable[int] = ()) -> None:
        self.bytes = 0
        self.input_hits: set = set()
        self._excluded = frozenset(excluded)
        self._inputs = frozenset(inputs)
        self._seen: Dict[int, Tuple[StorageWeakRef, int]] = {}
        # Storages another tally counted first, and what to tell it if this one takes them.
        self.claims: Dict[int, Callable[[int], None]] = {}
        # Storages to report when they are met again after being counted.
        self.watched: Dict[int, Callable[[], None]] = {}

    def add(self, storage: torch.UntypedStorage, *, count: bool = True) -> None:
        key = storage._cdata
        if key in self._seen:
            seen_again = self.watched.get(key)
            if seen_again is not None:
                seen_again()
            return
        if key in self._excluded:
            return
        if key in self._inputs:
            self.input_hits.add(key)
            return
        self._seen[key] = (StorageWeakRef(storage), storage.nbytes() if count else 0)
        if count:
            self.bytes += storage.nbytes()
            claim = self.claims.pop(key, None)
            if claim is not None:
                claim(storage.nbytes())

    def add_tensors(self, tensors: Iterable[torch.Tensor], *, count: bool = True) -> "_Tally":
        for tensor in tensors:
            for storage in _tensor_storages(tensor):
                self.add(storage, count=count)
        return self

    def holds(self, tensor: torch.Tensor) -> bool:
        return bool(_keys([tensor]) & self._seen.keys())

    def shared_bytes(self, other: "_Tally") -> int:
        """Bytes of the storages counted both here and in ``other``."""
        return sum(self._seen[key][1] for key in self._seen.keys() & other._seen.keys())

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """A saved-tensors pack hook: note the storage and save the tensor unchanged."""
        self.add_tensors((tensor,))
        return tensor


def _keys(tensors: Iterable[torch.Tensor]) -> set:
    """Identities of the storages behind ``tensors``."""
    return {storage._cdata for tensor in tensors for storage in _tensor_storages(tensor)}


def _saving(tally: _Tally) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensors hooks that note in ``tally`` what autograd saves, and save it as is."""
    return torch.autograd.graph.saved_tensors_hooks(tally.pack, lambda tensor: tensor)


class _PolicyTally(TorchDispatchMode):
    """Notes in ``tally`` the outputs of the operators that ``policy`` would save."""

    def __init__(self, policy: SavePolicy, tally: _Tally) -> None:
        super().__init__()
        self._policy, self._tally = policy, tally
        self._context = SelectiveCheckpointContext(is_recompute=False)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._policy(self._context, func, *args, **kwargs) in _SAVES:
            self._tally.add_tensors(_tensors(out))
        return out


@dataclasses.dataclass
class Record:
    """What the calls of one candidate have added up to so far."""

    name: str
    module: nn.Module
    calls: int = 0
    kept: int = 0
    outer_kept: int = 0  # from calls not nested in another candidate's: these make the total
    self_saved_inputs: int = 0  # input bytes it saves itself, counted in the base
    inputs: int = 0
    outputs: int = 0
    flops: int = 0
    time: float = 0.0
    replay_time: float = 0.0  # with a save policy: the forward replaying the saved outputs
    forward_peak: int = 0  # most bytes its forward's own storages held at once
    handed_over: int = 0  # kept bytes of its outputs that what follows saves as well
    policy_saved: int = 0  # bytes of the outputs the save policy keeps
    policy_saved_kept: int = 0  # the part of those its plain forward saves as well
    # Whether its one outermost call took the previous outermost candidate call's output
    # as its only input, saved by it and by nothing after it.
    joins_previous: bool = False
    joined: Optional["Record"] = None  # the record of that previous call
    base_before: Optional[int] = None  # base bytes when its last outermost call began
    position: int = -1  # order of its last outermost call among all outermost calls
    depth: int = 0  # > 1 while the module is inside a call of itself
    timed: int = 0
    # Per call of the memory pass: which tensor inputs need grad, and the grad mode; the
    # timing pass runs under no_grad and cannot see either.
    call_modes: List[Tuple[List[bool], bool]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Frame:
    """A candidate call in progress during the memory pass."""

    nested: bool
    grad: bool  # the grad mode the call would have run under
    out_grads: List[bool]  # per tensor output: whether it requires grad
    out_kept: List[bool]  # per tensor output: whether the module itself saves it


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
        self._state_keys = _keys(state)
        inputs = _tensors((args, kwargs))
        self._excluded = self._state_keys | _keys(inputs)
        # Without any tensor that needs grad, nothing in the model's forward would need it.
        self._grad_possible = any(t.requires_grad for t in [*model.parameters(), *inputs])
        devices = {t.device for t in [*state, *inputs]}
        self._devices = [d for d in devices if d.type not in ("cpu", "meta")]
        self.start_rng = RngState(self._devices)
        self._base = _Tally(self._excluded)
        self._frames: List[_Frame] = []
        # True while a measurement runs: candidates called inside it are not calls of their own.
        self._busy = False
        self._seen_in_pass: set = set()

    def run(self) -> None:
        """Run both passes; afterwards ``records`` and ``base_bytes`` hold the results."""
        handles: List[Any] = []
        try:
            handles += self._hook(self._memory_pre, self._memory_post)
            with torch.enable_grad(), _saving(self._base):
                output = self._model(*self._args, **self._kwargs)
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
                with torch.no_grad():
                    output = self._model(*self._args, **self._kwargs)
                del output
                self._end_pass()
        finally:
            for handle in handles:
                handle.remove()

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
        if tensor.requires_grad or not guess or not _differentiable(tensor):
            return tensor.requires_grad
        if _keys([tensor]) & self._excluded:
            return False
        return self._grad_possible

    def _memory_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        record = self._enter(module)
        if record is None:
            return None
        nested = bool(self._frames)
        grad = self._frames[-1].grad if nested else torch.is_grad_enabled()
        inputs = _tensors((args, kwargs))
        grads = [self._needs_grad(t, guess=nested) for t in inputs]
        run_args, run_kwargs, run_inputs = self._copies(args, kwargs, grads)
        tally = _Tally(self._excluded, inputs=_keys(run_inputs))
        policy_tally = _Tally(self._excluded | _keys(run_inputs))
        counter = FlopCounterMode(display=False)
        watch = contextlib.nullcontext() if self._policy is None else _PolicyTally(self._policy, policy_tally)
        # What a recomputation holds at its highest: saved tensors and temporaries alike.
        meter = _StorageCounter(_device_of(run_inputs, module).type)
        self._busy = True
        try:
            # The module's forward alone, skipping its hooks (they ran for the real call);
            # the RNG is put back so the real call draws the same numbers.
            with RngState(self._devices).kept(), torch.set_grad_enabled(grad):
                with _saving(tally), counter, watch, meter:
                    output = module.forward(*run_args, **run_kwargs)
            outputs = _tensors(output)
            out_grads = [t.requires_grad for t in outputs]
            frame = _Frame(nested, grad, out_grads, [tally.holds(t) for t in outputs])
            record.outputs += _Tally(self._state_keys).add_tensors(outputs).bytes
            del output, outputs
        finally:
            self._busy = False
        record.calls += 1
        record.kept += tally.bytes
        record.outer_kept += 0 if nested else tally.bytes
        record.inputs += _Tally(self._state_keys).add_tensors(inputs).bytes
        record.flops += counter.get_total_flops()
        record.forward_peak += meter.peak_bytes
        record.policy_saved += policy_tally.bytes
        record.policy_saved_kept += policy_tally.shared_bytes(tally)
        record.call_modes.append((grads, grad))
        self._frames.append(frame)
        if not nested:
            # Inputs the module saves stay alive in a real forward, but as no candidate's
            # kept bytes: they belong to the base.
            hits = tally.input_hits
            saved = [t for t, copy in zip(inputs, run_inputs) if _keys([copy]) & hits]
            record.self_saved_inputs += _Tally(self._state_keys).add_tensors(saved).bytes
            self._note_join(record, args, kwargs, saved)
            self._base.add_tensors(saved)
            # Backward reaches this call once everything saved after it is freed.
            record.base_before, record.position = self._base.bytes, self._calls
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
            if needs_grad and not leaf.requires_grad and _differentiable(leaf):
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

        for storage in (s for tensor in saved for s in _tensor_storages(tensor)):
            self._base.watched[storage._cdata] = seen_again

    def _hand_over(self, output: torch.Tensor, record: Record) -> None:
        """An output the module saves is in its kept bytes. If what follows saves it too
        (the next block's first layer, say), checkpointing the module does not free it:
        it is then counted in the base, and noted as handed over."""

        def claim(nbytes: int) -> None:
            record.handed_over += nbytes
            record.outer_kept -= nbytes

        for storage in _tensor_storages(output):
            self._base.claims.setdefault(storage._cdata, claim)

    def _time_pre(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        record = self._enter(module)
        if record is None:
            return None
        inputs = _tensors((args, kwargs))
        index, record.timed = record.timed, record.timed + 1
        grads, grad = [self._needs_grad(t, guess=True) for t in inputs], True
        modes = record.call_modes
        if index < len(modes) and len(modes[index][0]) == len(inputs):
            grads, grad = modes[index]
        run_args, run_kwargs, run_inputs = self._copies(args, kwargs, grads)
        device = _device_of(run_inputs, module)
        self._busy = True
        try:
            with RngState(self._devices).kept(), torch.set_grad_enabled(grad):
                samples = [
                    _time_forward(module, run_args, run_kwargs, device)
                    for _ in range(self._repeats)
                ]
                replays = samples
                if self._policy is not None:
                    replays = [
                        _time_replay(module, run_args, run_kwargs, device, self._policy)
                        for _ in range(self._repeats)
                    ]
        finally:
            self._busy = False
        record.time += statistics.median(samples)
        record.replay_time += statistics.median(replays)
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
                needs_grad = next(wanted) and _differentiable(leaf)
                copy = leaf.detach()
                if _keys([leaf]) & self._state_keys:
                    copy.requires_grad_(needs_grad)
                else:
                    copy = copy.requires_grad_(needs_grad).clone()
                leaves[position] = copy
                copies.append(copy)
        run_args, run_kwargs = tree_unflatten(leaves, spec)
        return run_args, run_kwargs, copies


class RngState:
    """The CPU RNG state and that of each accelerator device given, to put back later."""

    def __init__(self, devices: Iterable[torch.device]) -> None:
        self._cpu = torch.get_rng_state()
        self._devices = []
        for device in devices:
            module = torch.get_device_module(device.type)
            if hasattr(module, "get_rng_state"):
                self._devices.append((module, device, module.get_rng_state(device)))

    def restore(self) -> None:
        torch.set_rng_state(self._cpu)
        for module, device, state in self._devices:
            module.set_rng_state(state, device)

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Run the block, then put the RNG states back as they were before it."""
        try:
            yield
        finally:
            self.restore()


def _device_of(inputs: Sequence[torch.Tensor], module: nn.Module) -> torch.device:
    """Where the module computes: its first accelerator input, else its first parameter."""
    for tensor in [*inputs, *module.parameters(), *module.buffers()]:
        if tensor.device.type != "cpu":
            return tensor.device
    return torch.device("cpu")


def _time_forward(
    module: nn.Module, args: Any, kwargs: Dict[str, Any], device: torch.device
) -> float:
    """Seconds one ``module.forward`` takes, waiting for the device to finish its work."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            output = module.forward(*args, **kwargs)
            end.record()
            end.synchronize()
        # The output lives until here so that freeing its graph is not timed.
        del output
        return start.elapsed_time(end) / 1000.0
    synchronize = _synchronizer(device)
    synchronize()
    start_time = time.perf_counter()
    output = module.forward(*args, **kwargs)
    synchronize()
    elapsed = time.perf_counter() - start_time
    del output
    return elapsed


def _time_replay(
    module: nn.Module, args: Any, kwargs: Dict[str, Any], device: torch.device, policy: SavePolicy
) -> float:
    """Seconds a selective recomputation of ``module`` takes: its forward, with the outputs
    ``policy`` saves taken from a first, untimed forward instead of computed."""
    record, replay = create_selective_checkpoint_contexts(policy)
    with record:
        output = module.forward(*args, **kwargs)
    del output
    with replay:
        return _time_forward(module, args, kwargs, device)


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for ``device``; a no-op for the CPU and devices that cannot wait."""
    if device.type in ("cpu", "meta"):
        return lambda: None
    synchronize = getattr(getattr(torch, device.type, None), "synchronize", None)
    if not callable(synchronize):
        return lambda: None
    return lambda: synchronize(device)
