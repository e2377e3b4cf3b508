"""Entry points for training scripts: a command-line flag, an environment variable, a config dict.

All of them end in the same :func:`ckptwrap.wrap_model` call::

    parser = argparse.ArgumentParser()
    ckptwrap.config.add_argparse_args(parser)
    args = parser.parse_args()
    model = ckptwrap.config.apply_from_args(model, args)

or, from a YAML/JSON config section::

    model = ckptwrap.config.from_config({"policy": "every:2", "use_reentrant": False}).apply(model)

Where the policy comes from, first match wins: the explicit source (the ``policy`` key of
the config, or the ``--activation-checkpointing`` flag), then the ``CKPTWRAP_POLICY``
environment variable, then ``"none"``. The source is logged once, at INFO, on the
``ckptwrap.config`` logger.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any, Mapping, Optional, Set, Tuple

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
"""Environment variable that supplies the policy when neither the flag nor the config key does."""

_OPTION_KEYS = ("use_reentrant", "preserve_rng_state", "early_stop", "determinism_check", "debug")
_FLAG = "--activation-checkpointing"
# The attributes add_argparse_args puts on the namespace, in the order it adds them.
_NAMESPACE_ATTRIBUTES = (
    "activation_checkpointing",
    "ac_use_reentrant",
    "ac_preserve_rng_state",
    "ac_early_stop",
    "ac_determinism_check",
    "ac_nested",
)

_log = logging.getLogger(__name__)
# (source, policy) pairs already logged: a script that reads its config in a loop, or on
# every rank's restart of a component, says where the policy came from once, not each time.
_LOGGED: Set[Tuple[str, str]] = set()


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
        if not isinstance(self.nested, bool):
            raise CheckpointConfigError(
                f"nested must be True or False, got {self.nested!r} ({type(self.nested).__name__})."
            )
        if not isinstance(self.options, CheckpointOptions):
            raise CheckpointConfigError(
                f"options must be a CheckpointOptions, got {type(self.options).__name__}."
            )
        as_policy(self.policy)  # fail on a malformed policy now, not when the model is built

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap ``model`` in place as configured and return it."""
        return wrap_model(model, self.policy, nested=self.nested, **self.options.as_kwargs())


def add_argparse_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--activation-checkpointing SPEC`` and the engine-option flags to ``parser``.

    Left out, the flag parses to ``None``; :func:`from_args` then takes the policy from
    the ``CKPTWRAP_POLICY`` environment variable, read at that moment, else ``none``.

    Args:
        parser: The script's parser (or an argument group's parser).

    Returns:
        ``parser``, for chaining.
    """
    group = parser.add_argument_group("activation checkpointing (ckptwrap)")
    # argparse %-formats help texts, so a literal percent sign is written %%.
    group.add_argument(
        _FLAG,
        metavar="SPEC",
        default=None,
        help=(
            "which modules to checkpoint: none, blocks, all, type:NAME, name:GLOB, every:N, "
            "first:K, last:K, fraction:P, budget:NN%% or budget:SIZE (measured on the first "
            "training step), plus selective[:OPS] or offload, joined by ';' "
            f"(default: ${ENV_VAR}, else none)"
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
    """The configuration given by flags that :func:`add_argparse_args` added.

    The policy is the ``--activation-checkpointing`` flag when given; otherwise the
    ``CKPTWRAP_POLICY`` environment variable, read now, when set and not blank; otherwise
    ``"none"``. Where it came from is logged once at INFO on the ``ckptwrap.config`` logger.

    Args:
        args: The namespace ``parser.parse_args()`` returned.

    Returns:
        The configuration; nothing is applied yet.

    Raises:
        CheckpointConfigError: The namespace lacks the attributes ``add_argparse_args``
            adds, or the policy or an option is not valid.
    """
    missing = [name for name in _NAMESPACE_ATTRIBUTES if not hasattr(args, name)]
    if missing:
        raise CheckpointConfigError(
            f"the parsed arguments ({type(args).__name__}) lack {', '.join(missing)}, which "
            f"ckptwrap's flags set; allowed is the namespace of a parser that has them: call "
            f"ckptwrap.config.add_argparse_args(parser) before parsing."
        )
    policy = _resolve_policy(
        args.activation_checkpointing,
        args.activation_checkpointing is not None,
        f"the {_FLAG} flag",
        f"no {_FLAG} flag",
    )
    options = CheckpointOptions(
        use_reentrant=args.ac_use_reentrant,
        preserve_rng_state=args.ac_preserve_rng_state,
        early_stop=args.ac_early_stop,
        determinism_check=args.ac_determinism_check,
    )
    return ActivationCheckpointingConfig(policy=policy, nested=args.ac_nested, options=options)


def apply_from_args(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    """Wrap ``model`` in place as the parsed flags say and return it (see :func:`from_args`)."""
    return from_args(args).apply(model)


def from_config(config: Optional[Mapping[str, Any]]) -> ActivationCheckpointingConfig:
    """Read a config section such as ``{"policy": "every:2", "use_reentrant": false}``.

    Keys: ``policy``, ``nested`` and the engine options ``use_reentrant``,
    ``preserve_rng_state``, ``early_stop``, ``determinism_check``, ``debug``. A missing or
    empty section means the defaults. The policy is the ``policy`` key when present;
    otherwise the ``CKPTWRAP_POLICY`` environment variable, read now, when set and not
    blank; otherwise ``"none"``. Where it came from is logged once at INFO on the
    ``ckptwrap.config`` logger.

    Args:
        config: The section, or ``None``.

    Returns:
        The configuration; nothing is applied yet.

    Raises:
        CheckpointConfigError: An unknown key (any key that is not one of the strings
            above) or a value of the wrong type.
    """
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise CheckpointConfigError(
            f"expected a mapping for the activation checkpointing config, got {type(config).__name__}."
        )
    allowed = ("policy", "nested") + _OPTION_KEYS
    # Keys may be anything hashable (a YAML section can have integer keys): compare, never sort them.
    unknown = sorted((key for key in config if key not in allowed), key=repr)
    if unknown:
        raise CheckpointConfigError(
            f"unknown activation checkpointing config key(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(allowed)}."
        )
    nested = config.get("nested", False)
    if not isinstance(nested, bool):
        raise CheckpointConfigError(f"config key 'nested' must be true or false, got {nested!r}.")
    options = CheckpointOptions(**{key: config[key] for key in _OPTION_KEYS if key in config})
    policy = _resolve_policy(
        config.get("policy"), "policy" in config, "the config key 'policy'", "the config has no 'policy' key"
    )
    return ActivationCheckpointingConfig(policy=policy, nested=nested, options=options)


def _resolve_policy(explicit: Any, given: bool, source: str, absent: str) -> Any:
    """The policy from the explicit source when ``given``, else from the environment, else
    ``"none"``; logs the source once, and names the variable when its policy is malformed."""
    env = os.environ.get(ENV_VAR, "")
    if given:
        if isinstance(explicit, str):  # anything else, ActivationCheckpointingConfig refuses
            wins = f" (it wins over the environment variable {ENV_VAR}={env!r})" if env.strip() else ""
            _log_once(source, explicit, f"from {source}{wins}")
        return explicit
    if env.strip():
        try:
            as_policy(env)
        except CheckpointConfigError as error:
            raise CheckpointConfigError(
                f"{error} (the policy comes from the environment variable {ENV_VAR}={env!r}, "
                f"since {absent}; fix or unset it)"
            ) from None
        _log_once("environment", env, f"from the environment variable {ENV_VAR} ({absent})")
        return env
    _log_once("default", "none", f"by default ({absent}, {ENV_VAR} unset)")
    return "none"


def _log_once(source: str, policy: str, how: str) -> None:
    if (source, policy) in _LOGGED:
        return
    _LOGGED.add((source, policy))
    _log.info("activation checkpointing policy %r %s", policy, how)
