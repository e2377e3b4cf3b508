"""One rank of FSDP2 on a fake process group, on fake tensors: ckptwrap's plan per rank
against torch's FSDPMemTracker over two training iterations of the same model, sharding,
inputs and optimizer. Run as a script (the fake group is process-wide state):

    python _fsdp2_fake_rank.py WORLD_SIZE POLICY [TOKENS [SHARDING]]   # or POLICY "meta"
    python _fsdp2_fake_rank.py WORLD_SIZE plain TOKENS LAYERS

prints one JSON line: the plan's iteration peak per rank and the tracker's, whether
FSDP2's sharded parameters are still the model's after planning and whether planning
left any gradient on the model, FSDP2's or the model's (or, for "meta", the refusal's
message; for "plain", the un-checkpointed step's peak as ``none`` measures it and as
``blocks`` derives it from a step with every layer checkpointed, on a model of LAYERS
layers).

Before the tracked iterations one iteration runs untracked on a model of its own, the
same otherwise: DTensor computes what an operator gives on shards once per operator and
placements and caches it, and inside the caller's FakeTensorMode it does so on fake
tensors of the whole parameter's size, which the tracker counts as allocated (the first
AdamW step read +156 MiB at 2 ranks, Llama of width 512, 512 tokens; later ones are
exact). A real step allocates none of it.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

# This checkout's ckptwrap, not whichever one is installed: a script's own folder leads
# sys.path, the working directory does not.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import ckptwrap


def _loss(out):
    return out.logits.float().mean()


SHARDINGS = {"default": {}, "keep-gathered": {"reshard_after_forward": False}, "bf16-params": {"mixed": True}}
"""FSDP2's defaults; each layer's gathered parameters kept from its forward to its
backward; bfloat16 parameters with gradients reduced in float32."""


def _model(mesh, layers=4, reshard_after_forward=True, mixed=False):
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).train()
    options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mixed:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    return model


def _fsdp_params(model):
    states = [m._get_fsdp_state() for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    return [p for state in states if state._fsdp_param_group for p in state._fsdp_param_group.fsdp_params]


def _iteration(model, optimizer, ids):
    _loss(model(input_ids=ids)).backward()
    optimizer.step()
    optimizer.zero_grad()


def plain(world_size: int, tokens: int, layers: int) -> None:
    """The un-checkpointed step's peak per rank, measured (``none``) and derived from the
    step with every layer checkpointed (``blocks``)."""
    warnings.simplefilter("ignore")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    mesh = init_device_mesh("cpu", (world_size,))
    ids = torch.randint(32000, (1, tokens), generator=torch.Generator().manual_seed(0))
    with FakeTensorMode() as mode:
        model = _model(mesh, layers)
        fake_ids = mode.from_tensor(ids)
        found = {
            policy: ckptwrap.plan(model, policy, example_kwargs={"input_ids": fake_ids}, loss_fn=_loss).plain_peak
            for policy in ("none", "blocks")
        }
    dist.destroy_process_group()
    print(json.dumps(found))


def main(world_size: int, policy: str, tokens: int = 1024, sharding: str = "default") -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    mesh = init_device_mesh("cpu", (world_size,))
    ids = torch.randint(32000, (1, tokens), generator=torch.Generator().manual_seed(0))
    if policy == "meta":
        with torch.device("meta"):
            model = _model(mesh)
        try:
            ckptwrap.plan(model, "blocks", example_kwargs={"input_ids": ids}, loss_fn=_loss)
        except ckptwrap.CheckpointConfigError as error:
            print(json.dumps({"refused": str(error)}))
        else:
            print(json.dumps({"refused": ""}))
        dist.destroy_process_group()
        return
    with FakeTensorMode() as mode:
        planned = _model(mesh, **SHARDINGS[sharding])
        fake_ids = mode.from_tensor(ids)
        plan = ckptwrap.plan(planned, policy, example_kwargs={"input_ids": fake_ids}, optimizer="adamw", loss_fn=_loss)
        step = plan.plain_peak if policy == "none" else plan.predicted_peak
        predicted = plan.device_memory.whole_peak(step)
        parameters = plan.device_memory.parameters
        # FSDP2 keeps its own record of each sharded parameter: still the model's own.
        group_params = _fsdp_params(planned)
        registered = {id(p) for p in planned.parameters()}
        sharded = bool(group_params) and all(id(p.sharded_param) in registered for p in group_params)
        # The planned step's backward is FSDP2's, into fresh gradients: none stays behind.
        held = [*planned.parameters(), *(p.sharded_param for p in group_params)]
        held += [p._unsharded_param for p in group_params if hasattr(p, "_unsharded_param")]
        no_grads = all(t.grad is None for t in held) and all(
            p.unsharded_accumulated_grad is None for p in group_params
        )

        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        for warm_up in (True, False):  # see the module
            model = _model(mesh, **SHARDINGS[sharding])
            if policy != "none":
                ckptwrap.wrap_model(model, policy)
            # The optimizer as planned on a CPU step: one parameter at a time.
            optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
            if warm_up:
                _iteration(model, optimizer, fake_ids)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((fake_ids,))
        with tracker:
            for _ in range(2):
                _iteration(model, optimizer, fake_ids)
                tracker.reset_mod_stats()  # per-module numbers; the peak stays
        snapshot = tracker.get_tracker_snapshot("peak")
        total = next(value["Total"] for device, value in snapshot.items() if device.type == "cpu")
    dist.destroy_process_group()
    print(json.dumps({
        "predicted": predicted, "tracked": total, "parameters": parameters, "sharded": sharded, "no_grads": no_grads,
    }))


if __name__ == "__main__":
    if sys.argv[2] == "plain":
        plain(int(sys.argv[1]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        main(int(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:4]), *sys.argv[4:5])
