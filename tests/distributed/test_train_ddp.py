"""``examples/train_ddp.py`` runs under torchrun on two CPU ranks, at tiny sizes, and finds
every rank's parameters equal to its one-process run (within the tolerance it states)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from _dist_setup import loopback_environment

_SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
_TINY = ["--layers", "2", "--width", "32", "--heads", "2", "--seq-len", "16", "--batch", "4", "--steps", "2"]


@pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)
@pytest.mark.parametrize(
    "flags, wrapped",
    [
        (["--activation-checkpointing", "blocks"], "2 module(s) blocks.0, blocks.1"),
        (["--parallel", "fsdp2", "--activation-checkpointing", "every:2", "--ac-use-reentrant"], "(re-entrant): 1 module(s) blocks.0"),
    ],
    ids=["ddp-blocks", "fsdp2-every:2-reentrant"],
)
def test_train_ddp_under_torchrun(flags, wrapped):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        command + [str(_SCRIPT), *_TINY, *flags],
        env=dict(os.environ, **loopback_environment()),
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert wrapped in done.stdout
    # Rounding may differ (the ranks sum gradients in another order): the line says which.
    assert re.search(
        r"on every rank: (equal the one-process run, bit for bit|match the one-process run "
        r"within rtol=0\.0001, atol=1e-06 \(max \|difference\| [0-9.e+-]+\))$",
        done.stdout, flags=re.MULTILINE,
    ), done.stdout
