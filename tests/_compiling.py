"""What the torch.compile tests share: a backend that keeps the graphs it compiles, and a
compiler reset around every test."""

from __future__ import annotations

from typing import Any, List

import pytest
import torch


class Recorder:
    """A backend that keeps every graph it is given and compiles it with ``aot_eager``
    (which traces, partitions and recomputes like the default backend, without
    generating code)."""

    def __init__(self) -> None:
        self.graphs: List[torch.fx.GraphModule] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs.append(graph)
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)

    def checkpoints(self) -> int:
        """Checkpoint operators in the graphs compiled so far."""
        checkpoint_op = torch.ops.higher_order.tag_activation_checkpoint
        return sum(node.target is checkpoint_op for g in self.graphs for node in g.graph.nodes)


@pytest.fixture(autouse=True)
def fresh_compiler():
    """The compiler's caches emptied before and after each test of a module that imports
    this fixture."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
