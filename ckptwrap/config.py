"""Entry points for training scripts: a command-line flag, an environment variable, a config dict.

All of them end in the same :func:`ckptwrap.wrap_model` call::

    parser = argparse.ArgumentParser()
    ckptwrap.config.add_argparse_args(parser)
    args = parser.parse_args()
    model = ckptwrap.config.apply_from_args(model, args)

or, from a YAML/JSON config section::

    model = ckptwrap.config.from_config({"policy": "every:2", "use_reentrant": False}).apply(model)

or, where options live in dataclasses (``transformers.HfArgumentParser``, a YAML file of
flat keys), :class:`CheckpointingArguments`, whose fields are the flags' attribute names::

    parser = HfArgumentParser((TrainingArguments, ckptwrap.config.CheckpointingArguments))
    training_args, ac_args = parser.parse_args_into_dataclasses()  # or parse_yaml_file(path)
    model = ac_args.apply(model)

Where the policy comes from, first match wins: the explicit source (the ``policy`` key of
the config, the ``--activation-checkpointing`` flag, or the dataclass's
``activation_checkpointing`` field), then the ``CKPTWRAP_POLICY``
environment variable, then ``"none"``. The source is logged once, at INFO, on the
``ckptwrap.config`` logger.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any, Dict, Literal, Mapping, Optional, Set, Tuple

from torch import nn

from ._errors import CheckpointConfigError
from .engine import CheckpointOptions
from .policy import as_policy
from .wrap import wrap_model

__all__ = [
    "ENV_VAR",
    "ActivationCheckpointingConfig",
    "CheckpointingArguments",
    "add_argparse_args",
    "from_args",
    "apply_from_args",
    "from_config",
]

ENV_VAR = "CKPTWRAP_POLICY"
"""Environment variable that supplies the policy when neither the flag nor the config key does."""

_OPTION_KEYS = ("use_reentrant", "preserve_rng_state", "early_stop", "determinism_check", "debug")
_FLAG = "--activation-checkpointing"
_GROUP = "activation checkpointing (ckptwrap)"

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

    def apply(
        self,
        model: nn.Module,
        *,
        example_inputs: Any = None,
        example_kwargs: Optional[Dict[str, Any]] = None,
        optimizer: Any = None,
    ) -> nn.Module:
        """Wrap ``model`` in place as configured and return it.

        ``example_inputs`` and ``example_kwargs`` (the model's keyword inputs, as a Hugging
        Face model takes them) are passed to :func:`ckptwrap.wrap_model`, so that a
        ``budget:`` policy is planned now instead of on the first training forward;
        ``optimizer`` (the optimizer or a name such as ``"adamw"``) too, for a budget in a
        device's terms (``budget:total=80GiB``, ``budget:device``).
        """
        return wrap_model(
            model,
            self.policy,
            nested=self.nested,
            example_inputs=example_inputs,
            example_kwargs=example_kwargs,
            optimizer=optimizer,
            **self.options.as_kwargs(),
        )


def _flag_field(default: Any, text: str) -> Any:
    """A field with its flag's help text where HfArgumentParser looks for it."""
    return dataclasses.field(default=default, metadata={"help": text})


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointingArguments:
    """The ``--activation-checkpointing`` flag and its options, as a dataclass.

    Its fields are the attributes :func:`add_argparse_args` puts on the namespace, with the
    same defaults and help texts (in each field's ``metadata["help"]``), so it is the flag
    wherever options are dataclasses: ``transformers.HfArgumentParser`` (whose flags are
    the field names, ``--activation_checkpointing`` or ``--activation-checkpointing``,
    ``--ac_use_reentrant`` and so on), a YAML file of flat keys read by its
    ``parse_yaml_file``, or a config section, ``CheckpointingArguments(**section)``.
    Values are checked when it is made; the policy, when ``activation_checkpointing`` is
    left ``None``, comes from the ``CKPTWRAP_POLICY`` environment variable when
    :meth:`apply` runs, else ``"none"``.

    Raises:
        CheckpointConfigError: A field's value is not allowed; the message names the
            fields given, the value refused and the values allowed.

    Example:
        >>> parser = HfArgumentParser((TrainingArguments, CheckpointingArguments))
        >>> training_args, ac_args = parser.parse_args_into_dataclasses()
        >>> model = ac_args.apply(model)
    """

    # HfArgumentParser puts the fields of a dataclass with this attribute in a group of this name.
    _argument_group_name = _GROUP

    activation_checkpointing: Optional[str] = _flag_field(
        None,
        "which modules to checkpoint: none, blocks, all, type:NAME, name:GLOB, every:N, "
        "first:K, last:K, fraction:P, budget:NN%% or budget:SIZE (measured on the first "
        "training step), plus selective[:OPS] or offload, joined by ';'; "
        f"left out: ${ENV_VAR}, else none",  # argparse %-formats help: %% is a percent sign
    )
    ac_use_reentrant: bool = _flag_field(False, "use the re-entrant engine")
    ac_preserve_rng_state: bool = _flag_field(True, "replay RNG state so dropout matches")
    ac_early_stop: Optional[bool] = _flag_field(
        None, "stop recomputation once every needed tensor exists (left out: yes)"
    )
    ac_determinism_check: Literal["default", "none"] = _flag_field(
        "default", "check recomputed shapes, dtypes and devices"
    )
    ac_nested: bool = _flag_field(
        False, "keep selected modules inside selected modules as nested checkpoints"
    )

    def __post_init__(self) -> None:
        # The checks of ActivationCheckpointingConfig and CheckpointOptions, with the fields named.
        try:
            policy = "none" if self.activation_checkpointing is None else self.activation_checkpointing
            ActivationCheckpointingConfig(policy=policy, nested=self.ac_nested, options=_options_of(self))
        except CheckpointConfigError as error:
            given = ", ".join(
                f"{field.name}={getattr(self, field.name)!r}"
                for field in dataclasses.fields(self)
                if not _is_default(getattr(self, field.name), field.default)
            )
            raise CheckpointConfigError(f"CheckpointingArguments({given}): {error}") from None

    def to_config(self) -> ActivationCheckpointingConfig:
        """The configuration these arguments give, the policy resolved as :func:`from_args` does."""
        return _config_of(
            self,
            "CheckpointingArguments.activation_checkpointing",
            "activation_checkpointing is None",
        )

    def apply(
        self,
        model: nn.Module,
        *,
        example_inputs: Any = None,
        example_kwargs: Optional[Dict[str, Any]] = None,
        optimizer: Any = None,
    ) -> nn.Module:
        """Wrap ``model`` in place as configured and return it (see
        :meth:`ActivationCheckpointingConfig.apply`): the same ``wrap_model`` call as the flag."""
        return self.to_config().apply(
            model, example_inputs=example_inputs, example_kwargs=example_kwargs, optimizer=optimizer
        )


def _is_default(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default  # 1 == True, yet 1 is not allowed


# The attributes add_argparse_args puts on the namespace, in the order it adds them.
_ARGUMENTS = {field.name: field for field in dataclasses.fields(CheckpointingArguments)}


def add_argparse_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--activation-checkpointing SPEC`` and the engine-option flags to ``parser``.

    Left out, the flag parses to ``None``; :func:`from_args` then takes the policy from
    the ``CKPTWRAP_POLICY`` environment variable, read at that moment, else ``none``.

    Args:
        parser: The script's parser (or an argument group's parser).

    Returns:
        ``parser``, for chaining.
    """
    group = parser.add_argument_group(_GROUP)

    # Defaults and help texts are CheckpointingArguments'; HfArgumentParser adds the
    # "(default: ...)" that a plain parser lacks, so it is added here.
    def add(flag: str, name: str, shown_default: str = "", **kwargs: Any) -> None:
        field = _ARGUMENTS[name]
        shown = f" (default: {shown_default})" if shown_default else ""
        group.add_argument(flag, default=field.default, help=field.metadata["help"] + shown, **kwargs)

    add(_FLAG, "activation_checkpointing", metavar="SPEC")
    add("--ac-use-reentrant", "ac_use_reentrant", "no", action=argparse.BooleanOptionalAction)
    add("--ac-preserve-rng-state", "ac_preserve_rng_state", "yes", action=argparse.BooleanOptionalAction)
    add("--ac-early-stop", "ac_early_stop", action=argparse.BooleanOptionalAction)
    add("--ac-determinism-check", "ac_determinism_check", "default", choices=("default", "none"))
    add("--ac-nested", "ac_nested", action="store_true")
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
    missing = [name for name in _ARGUMENTS if not hasattr(args, name)]
    if missing:
        raise CheckpointConfigError(
            f"the parsed arguments ({type(args).__name__}) lack {', '.join(missing)}, which "
            f"ckptwrap's flags set; allowed is the namespace of a parser that has them: call "
            f"ckptwrap.config.add_argparse_args(parser) before parsing."
        )
    return _config_of(args, f"the {_FLAG} flag", f"no {_FLAG} flag")


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


def _options_of(args: Any) -> CheckpointOptions:
    """The engine options of a namespace from :func:`add_argparse_args` or a CheckpointingArguments."""
    return CheckpointOptions(
        use_reentrant=args.ac_use_reentrant,
        preserve_rng_state=args.ac_preserve_rng_state,
        early_stop=args.ac_early_stop,
        determinism_check=args.ac_determinism_check,
    )


def _config_of(args: Any, source: str, absent: str) -> ActivationCheckpointingConfig:
    """The configuration of the flags' attributes on ``args``; ``source`` names where the
    policy comes from when given, ``absent`` says that it is not."""
    policy = _resolve_policy(
        args.activation_checkpointing, args.activation_checkpointing is not None, source, absent
    )
    return ActivationCheckpointingConfig(policy=policy, nested=args.ac_nested, options=_options_of(args))


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
