"""Entry points for training scripts: a command-line flag, an environment variable, a config dict.

All of them end in the same :func:`ckptwrap.wrap_model` call::

    parser = argparse.ArgumentParser()
    ckptwrap.config.add_argparse_args(parser)
    args = parser.parse_args()
    model = ckptwrap.config.apply_from_args(model, args)

or, from a YAML/JSON config section::

    model = ckptwrap.config.from_config({"policy": "every:2", "use_reentrant": False}).apply(model)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Mapping, Optional

from torch import nn

from ._errors import CheckpointConfigError
from .policy import as_policy
from .wrap import CheckpointOptions, wrap_model

__all__ = [
    "ENV_VAR",
    "ActivationCheckpointingConfig",
    "add_argparse_args",
    "from_args",
    "apply_from_args",
    "from_config",
]

ENV_VAR = "CKPTWRAP_POLICY"
"""Environment variable that supplies the policy when the flag is not given."""

_OPTION_KEYS = ("use_reentrant", "preserve_rng_state", "early_stop", "determinism_check", "debug")


@dataclasses.dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """A policy and engine options, ready to apply to a model."""

    policy: str = "none"
    """Policy string, e.g. ``"blocks"`` or ``"type:Block;last:4"``."""
    nested: bool = False
    """Keep selected modules inside other selected modules as nested checkpoints."""
    options: CheckpointOptions = dataclasses.field(default_factory=CheckpointOptions)
    """Engine options for every selected module."""

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str):
            raise CheckpointConfigError(
                f"policy must be a policy string, got {self.policy!r} ({type(self.policy).__name__})."
            )
        as_policy(self.policy)  # fail on a malformed policy now, not when the model is built

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap ``model`` in place as configured and return it."""
        return wrap_model(model, self.policy, nested=self.nested, **self.options.as_kwargs())


def add_argparse_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--activation-checkpointing SPEC`` and the engine-option flags to ``parser``.

    The policy defaults to the ``CKPTWRAP_POLICY`` environment variable, else ``none``.

    Args:
        parser: The script's parser (or an argument group's parser).

    Returns:
        ``parser``, for chaining.
    """
    group = parser.add_argument_group("activation checkpointing (ckptwrap)")
    group.add_argument(
        "--activation-checkpointing",
        metavar="SPEC",
        default=os.environ.get(ENV_VAR, "none"),
        help=(
            "which modules to checkpoint: none, blocks, all, type:NAME, name:GLOB, every:N, "
            "first:K, last:K, fraction:P, budget:NN%% or budget:SIZE (measured on the first "
            "training step), plus selective[:OPS] or offload, joined by ';' "
            "(default: $%s or 'none')" % ENV_VAR
        ),
    )
    group.add_argument(
        "--ac-use-reentrant",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="use the re-entrant engine (default: no)",
    )
    group.add_argument(
        "--ac-preserve-rng-state",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="replay RNG state so dropout matches (default: yes)",
    )
    group.add_argument(
        "--ac-early-stop",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="stop recomputation once every needed tensor exists (default: yes)",
    )
    group.add_argument(
        "--ac-determinism-check",
        choices=("default", "none"),
        default="default",
        help="check recomputed shapes, dtypes and devices (default: default)",
    )
    group.add_argument(
        "--ac-nested",
        action="store_true",
        help="keep selected modules inside selected modules as nested checkpoints",
    )
    return parser


def from_args(args: argparse.Namespace) -> ActivationCheckpointingConfig:
    """The configuration given by flags that :func:`add_argparse_args` added."""
    try:
        policy = args.activation_checkpointing
    except AttributeError:
        raise CheckpointConfigError(
            "the namespace has no activation_checkpointing attribute; call "
            "ckptwrap.config.add_argparse_args(parser) before parsing."
        ) from None
    options = CheckpointOptions(
        use_reentrant=args.ac_use_reentrant,
        preserve_rng_state=args.ac_preserve_rng_state,
        early_stop=args.ac_early_stop,
        determinism_check=args.ac_determinism_check,
    )
    return ActivationCheckpointingConfig(policy=policy, nested=args.ac_nested, options=options)


def apply_from_args(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    """Wrap ``model`` in place as the parsed flags say and return it."""
    return from_args(args).apply(model)


def from_config(config: Optional[Mapping[str, Any]]) -> ActivationCheckpointingConfig:
    """Read a config section such as ``{"policy": "every:2", "use_reentrant": false}``.

    Keys: ``policy`` (default: the environment variable, else ``none``), ``nested`` and the
    engine options ``use_reentrant``, ``preserve_rng_state``, ``early_stop``,
    ``determinism_check``, ``debug``. A missing or empty section means the defaults.

    Raises:
        CheckpointConfigError: An unknown key or a value of the wrong type.
    """
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise CheckpointConfigError(
            f"expected a mapping for the activation checkpointing config, got {type(config).__name__}."
        )
    allowed = ("policy", "nested") + _OPTION_KEYS
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise CheckpointConfigError(
            f"unknown activation checkpointing config key(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(allowed)}."
        )
    nested = config.get("nested", False)
    if not isinstance(nested, bool):
        raise CheckpointConfigError(f"config key 'nested' must be true or false, got {nested!r}.")
    options = CheckpointOptions(**{key: config[key] for key in _OPTION_KEYS if key in config})
    policy = config.get("policy", os.environ.get(ENV_VAR, "none"))
    return ActivationCheckpointingConfig(policy=policy, nested=nested, options=options)
