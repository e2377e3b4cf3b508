"""Models built from a transformers configuration, and keyword inputs, for ``python -m
ckptwrap plan``: ``hf:LlamaConfig`` (a configuration class, with ``--set key=value``
overrides) or ``hf:path/config.json`` (a local file: nothing is downloaded), and
``--input input_ids=1,8192`` for each keyword input of the forward.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._cli_common import UsageError, parse_dtype

__all__ = ["CONFIG_PREFIX", "build_from_config", "keyword_inputs"]

CONFIG_PREFIX = "hf:"
"""How the model argument names a transformers configuration rather than a factory."""


def build_from_config(
    spec: str, sets: Sequence[str], model_class: Optional[str], dtype: Optional[torch.dtype]
) -> nn.Module:
    """The model ``spec`` (``hf:ConfigClass`` or ``hf:path/config.json``) describes, with
    ``sets`` (``key=value``, the value read as JSON where it parses) applied to its
    configuration, as ``model_class`` (by default the configuration's first architecture,
    else ``AutoModelForCausalLM``), in ``dtype``. Built under whatever device context is
    in force (the meta device allocates nothing)."""
    try:
        import transformers
    except ImportError:
        raise UsageError(f"{spec} needs transformers: pip install transformers") from None
    overrides = {}
    for item in sets:
        key, equals, text = item.partition("=")
        key = key.strip()
        if not equals or not key:
            raise UsageError(f"bad --set {item!r}: expected KEY=VALUE, such as hidden_size=2048")
        overrides[key] = _value(text)
    # Given to the constructor, not set afterwards: fields derived there (head_dim from
    # hidden_size) follow.
    config = _config(transformers, spec[len(CONFIG_PREFIX):], overrides)
    named = model_class or ((getattr(config, "architectures", None) or [None])[0])
    names = [named] if named else list(_AUTO_CLASSES)
    failures = []
    for name in names:
        cls = getattr(transformers, name, None)
        if not isinstance(cls, type):
            raise UsageError(f"--model-class {name}: transformers has no such class (e.g. LlamaForCausalLM)")
        try:
            model = cls.from_config(config) if name.startswith("Auto") else cls(config)
        except (ValueError, TypeError, AttributeError) as error:
            failures.append(f"{name}: {str(error).splitlines()[0][:200]}")
            continue
        return model.to(dtype) if dtype is not None else model
    tried = "; ".join(failures)
    raise UsageError(
        f"cannot build a model from {type(config).__name__} ({tried}); name one with --model-class "
        f"(e.g. {type(config).__name__.replace('Config', '')}ForConditionalGeneration)"
    )


_AUTO_CLASSES = (
    "AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq", "AutoModelForMaskedLM",
    "AutoModelForImageClassification", "AutoModel",
)
"""Tried in order where the configuration names no architecture and no --model-class is
given: the first that takes the configuration builds the model."""


def _config(transformers: Any, target: str, overrides: Dict[str, Any]) -> Any:
    path = Path(target)
    if target.endswith(".json") or path.is_file():
        if not path.is_file():
            raise UsageError(f"no such configuration file: {target!r}")
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot read {target!r} as JSON: {error}") from None
        kind = data.get("model_type") if isinstance(data, dict) else None
        mapping = transformers.CONFIG_MAPPING
        if kind not in mapping:
            raise UsageError(f"{target!r} names no model_type transformers knows (got {kind!r})")
        cls = mapping[kind]
        _known(cls, data, overrides)
        return cls.from_dict({**data, **overrides})
    cls = getattr(transformers, target, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
        near = difflib.get_close_matches(target, [n for n in dir(transformers) if n.endswith("Config")], n=3)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        raise UsageError(
            f"hf:{target}: not a transformers configuration class or a local .json file{hint}"
        )
    _known(cls, {}, overrides)
    return cls(**overrides)


def _known(cls: Any, data: Dict[str, Any], overrides: Dict[str, Any]) -> None:
    """Refuse a key the configuration's constructor does not take (a typo would be kept
    silently, as an attribute): its fields, the parameters of its and its bases'
    constructors, its properties (``num_labels``), its attribute aliases (``hidden_size``
    on T5) and the generation settings every configuration takes
    (``decoder_start_token_id``)."""
    fields = _taken(cls) | set(data)
    for key in overrides:
        if key not in fields:
            near = difflib.get_close_matches(key, sorted(fields), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise UsageError(f"--set {key}: {cls.__name__} has no such field{hint}")


def _taken(cls: Any) -> set:
    import inspect

    taken = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
    for base in cls.__mro__:
        init = vars(base).get("__init__")
        if init is not None:
            try:
                taken |= {n for n, p in inspect.signature(init).parameters.items() if p.kind is not p.VAR_KEYWORD}
            except (TypeError, ValueError):
                pass
        taken |= {name for name, value in vars(base).items() if isinstance(value, property)}
    try:
        from transformers import GenerationConfig

        taken |= set(GenerationConfig().to_dict())
    except Exception:  # noqa: BLE001 - without it, the other sources stand
        pass
    taken.discard("self")
    return taken


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text  # a bare word: a string field (hidden_act=silu)


def keyword_inputs(
    specs: Sequence[str], model: nn.Module, vocab: Optional[int], labels: bool, seed: int, device: torch.device
) -> Dict[str, torch.Tensor]:
    """The forward's keyword inputs ``--input NAME=N,N,...`` describe: masks of ones, token
    type ids of zeros, position ids counting along the last axis, other ids and labels
    drawn below ``vocab`` (by default the model's ``config.vocab_size``), anything else
    drawn from a normal distribution in the model's floating-point dtype; with ``labels``,
    ``labels`` a copy of ``input_ids``. Drawn on the CPU from a generator of its own (the
    same on every device) and put on ``device``."""
    generator = torch.Generator().manual_seed(seed)
    made: Dict[str, torch.Tensor] = {}
    for name, shape, dtype in _parsed(specs):
        if name in made:
            raise UsageError(f"--input {name} is given twice")
        made[name] = _tensor(name, shape, model, vocab, generator, dtype)
    if labels:
        if "input_ids" not in made:
            raise UsageError("--labels copies input_ids: give --input input_ids=N,N")
        made.setdefault("labels", made["input_ids"].clone())
    return {name: tensor.to(device) for name, tensor in made.items()}


def _parsed(specs: Sequence[str]) -> List[Tuple[str, Tuple[int, ...], Optional[torch.dtype]]]:
    parsed = []
    for spec in specs:
        name, equals, rest = spec.partition("=")
        shape, colon, dtype = rest.partition(":")
        parts = [part.strip() for part in shape.split(",")]
        if not equals or not name.strip().isidentifier() or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise UsageError(
                f"bad --input {spec!r}: expected NAME=N,N,..., a keyword of the forward and a "
                f"shape of positive integers, such as input_ids=1,8192 (and, for a dtype of its "
                f"own, :DTYPE after them, such as edge_index=2,300:long)"
            )
        own = parse_dtype(dtype, f"--input {spec!r}") if colon else None
        parsed.append((name.strip(), tuple(int(part) for part in parts), own))
    return parsed


def _tensor(
    name: str,
    shape: Tuple[int, ...],
    model: nn.Module,
    vocab: Optional[int],
    generator: torch.Generator,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    if dtype is not None:  # named on the command line: drawn as that dtype is
        if dtype.is_floating_point:
            return torch.randn(shape, generator=generator).to(dtype)
        return torch.randint(_vocabulary(name, model, vocab), shape, generator=generator, dtype=dtype)
    if name.endswith("mask"):
        return torch.ones(shape, dtype=torch.long)
    if name == "token_type_ids":
        return torch.zeros(shape, dtype=torch.long)
    if name == "position_ids":
        return torch.arange(shape[-1]).expand(shape).contiguous()
    if name.endswith("ids") or name == "labels":
        return torch.randint(_vocabulary(name, model, vocab), shape, generator=generator)
    floating = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return torch.randn(shape, generator=generator).to(floating)


def _vocabulary(name: str, model: nn.Module, vocab: Optional[int]) -> int:
    """The bound integer inputs are drawn below: ``--vocab``, else the model's vocab_size."""
    high = vocab or getattr(getattr(model, "config", None), "vocab_size", None)
    if not high:
        raise UsageError(f"--input {name}: ids need --vocab N (the model has no config.vocab_size)")
    return int(high)
