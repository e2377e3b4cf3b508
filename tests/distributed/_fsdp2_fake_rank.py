"""One rank of FSDP2 on a fake process group, on fake tensors: ckptwrap's plan per rank
against torch's FSDPMemTracker over two training iterations of the same model, sharding,
inputs and optimizer. Run as a script (the fake group is process-wide state):

    python _fsdp2_fake_rank.py WORLD_SIZE POLICY     # or POLICY "meta": a meta model

prints one JSON line: the plan's iteration peak per rank and the tracker's, and whether
FSDP2's sharded parameters are still the model's after planning (or, for "meta", the
refusal's message).
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import ckptwrap


def _loss(out):
    return out.logits.float().mean()


def _model(mesh):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, use_cache=False,
    )
    model = transformers.LlamaForCausalLM(config).train()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def main(world_size: int, policy: str) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    mesh = init_device_mesh("cpu", (world_size,))
    ids = torch.randint(32000, (1, 1024), generator=torch.Generator().manual_seed(0))
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
        planned = _model(mesh)
        fake_ids = mode.from_tensor(ids)
        plan = ckptwrap.plan(planned, policy, example_kwargs={"input_ids": fake_ids}, optimizer="adamw", loss_fn=_loss)
        step = plan.plain_peak if policy == "none" else plan.predicted_peak
        predicted = plan.device_memory.whole_peak(step)
        parameters = plan.device_memory.parameters
        # FSDP2 keeps its own record of each sharded parameter: still the model's own.
        states = [m._get_fsdp_state() for m in planned.modules() if hasattr(m, "_get_fsdp_state")]
        group_params = [p for state in states if state._fsdp_param_group for p in state._fsdp_param_group.fsdp_params]
        registered = {id(p) for p in planned.parameters()}
        sharded = bool(group_params) and all(id(p.sharded_param) in registered for p in group_params)

        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        model = _model(mesh)
        if policy != "none":
            ckptwrap.wrap_model(model, policy)
        # The optimizer as planned on a CPU step: one parameter at a time.
        optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs((fake_ids,))
        with tracker:
            for _ in range(2):
                _loss(model(input_ids=fake_ids)).backward()
                optimizer.step()
                optimizer.zero_grad()
                tracker.reset_mod_stats()  # per-module numbers; the peak stays
        snapshot = tracker.get_tracker_snapshot("peak")
        total = next(value["Total"] for device, value in snapshot.items() if device.type == "cpu")
    dist.destroy_process_group()
    print(json.dumps({"predicted": predicted, "tracked": total, "parameters": parameters, "sharded": sharded}))


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
