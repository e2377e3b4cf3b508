"""The offload arithmetic of benchmarks/gpu_llama.py: the host link's measured bandwidth,
the bytes a block sends over it, and how many blocks' copies the link can hide behind
the plain step's compute.

A block's saved tensors go to the host during the forward and come back during the
backward, so with the first K blocks offloaded, K x bytes per block must fit in the
forward at the to-host bandwidth and in the backward at the from-host bandwidth.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import List, Optional

import torch

__all__ = ["Arithmetic", "Link", "blocks_hidden", "describe", "measure_link", "partial_offload_policy"]

_GB = 1e9
_MIB = 1024 * 1024
LINK_BYTES = 1 << 30
"""Size of the pinned copy that measures the link."""


@dataclasses.dataclass
class Link:
    """The host link's measured bandwidth, bytes per second each way."""

    to_host: float
    from_host: float


@dataclasses.dataclass
class Arithmetic:
    """What the offload target is judged on: the link, the bytes and the plain step."""

    link: Optional[Link]
    blocks: int = 0
    bytes_per_block: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    hidden: Optional[int] = None
    """Blocks whose copies the link can hide behind compute (None: not known)."""
    note: str = ""
    offload_to_host: Optional[int] = None
    """Bytes every-block offload sends to the host in one step (its statistics)."""
    offload_from_host: Optional[int] = None


def measure_link(device: torch.device, nbytes: int = LINK_BYTES, repeats: int = 5) -> Optional[Link]:
    """Bandwidth of pinned host <-> ``device`` copies, from CUDA events (median of
    ``repeats``); None off CUDA."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def seconds(dst: torch.Tensor, src: torch.Tensor) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000

    seconds(host, on_device), seconds(on_device, host)  # warm-up
    to_host = statistics.median(nbytes / seconds(host, on_device) for _ in range(repeats))
    from_host = statistics.median(nbytes / seconds(on_device, host) for _ in range(repeats))
    del host, on_device
    torch.cuda.empty_cache()
    return Link(to_host, from_host)


def blocks_hidden(link: Link, bytes_per_block: float, forward_s: float, backward_s: float) -> int:
    """How many blocks' copies the link can hide: each block goes to the host during the
    forward and comes back during the backward."""
    if bytes_per_block <= 0:
        return 0
    return math.floor(min(link.to_host * forward_s, link.from_host * backward_s) / bytes_per_block)


def partial_offload_policy(arithmetic: Arithmetic, *, smoke_test: bool) -> Optional[str]:
    """``first:K;offload`` with K from the link, the bytes per block and the plain step;
    None where no such row makes sense (the reason goes to ``arithmetic.note``)."""
    if arithmetic.offload_to_host:
        arithmetic.bytes_per_block = arithmetic.offload_to_host / max(arithmetic.blocks, 1)
    if arithmetic.link is not None and arithmetic.forward_s > 0 and arithmetic.bytes_per_block > 0:
        arithmetic.hidden = blocks_hidden(arithmetic.link, arithmetic.bytes_per_block,
                                          arithmetic.forward_s, arithmetic.backward_s)
        k = min(arithmetic.hidden, arithmetic.blocks)
        if k == 0:
            arithmetic.note = "the link hides no block's copies: no partial offload row"
            return None
        if k >= arithmetic.blocks:
            arithmetic.note = "the link hides every block's copies: the offload row is the target's"
            return None
        return f"first:{k};offload"
    if smoke_test:
        arithmetic.note = "no CUDA link to measure: K is half the blocks, for the smoke test"
        return f"first:{max(arithmetic.blocks // 2, 1)};offload"
    arithmetic.note = "the link or the bytes per block could not be measured: no partial offload row"
    return None


def describe(arithmetic: Arithmetic) -> List[str]:
    """The offload arithmetic as lines of text: the link, the bytes, the plain step, K."""
    lines = []
    link = arithmetic.link
    if link is None:
        lines.append("host link: not measured (no CUDA device)")
    else:
        lines.append(f"host link: to host {link.to_host / _GB:.1f} GB/s, from host {link.from_host / _GB:.1f} GB/s "
                     f"(pinned {LINK_BYTES // _MIB} MiB copy, CUDA events, median of 5)")
    sent = arithmetic.offload_to_host
    if sent is not None:
        lines.append(f"offload (every block): {sent / _GB:.2f} GB to the host and "
                     f"{(arithmetic.offload_from_host or 0) / _GB:.2f} GB back per step, "
                     f"{arithmetic.bytes_per_block / _GB:.3f} GB per block (ckptwrap's offloader statistics)")
    if link is not None and arithmetic.forward_s > 0 and sent:
        step_s = arithmetic.forward_s + arithmetic.backward_s
        copy_s = sent / min(link.to_host, link.from_host)
        lines.append(f"plain step {step_s * 1000:.0f} ms (forward {arithmetic.forward_s * 1000:.0f} ms, backward "
                     f"{arithmetic.backward_s * 1000:.0f} ms); every block's copies take {copy_s * 1000:.0f} ms "
                     f"each way, so offloading every block costs at least {max(1.0, copy_s / step_s):.2f} x none")
        whole_step = math.floor(min(link.to_host, link.from_host) * step_s / max(arithmetic.bytes_per_block, 1))
        lines.append(f"blocks the link can hide behind compute: K = floor(min(to-host x forward, from-host x "
                     f"backward) / bytes per block) = {arithmetic.hidden} of {arithmetic.blocks} "
                     f"(bandwidth x whole step / bytes per block would say {whole_step})")
    if arithmetic.note:
        lines.append(f"partial offload: {arithmetic.note}")
    return lines
