"""Names of a PEFT LoRA adapter's tensors: in a PeftModel's state dict, and in its file.

A ``PeftModel`` holds each adapter's tensors under FQNs carrying the adapter's name
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``); the
``adapter_model.safetensors`` that ``PeftModel.save_pretrained`` writes names them
without it (``...q_proj.lora_A.weight``), so that an adapter can be loaded under any name.
This module reproduces peft 0.21's rules (``get_peft_model_state_dict``, LoRA) from
the FQNs and the adapter config alone, with no live model:

- the LoRA tensors: those under ``lora_A``, ``lora_B``, ``lora_embedding_A``,
  ``lora_embedding_B``, ``lora_magnitude_vector`` followed by the adapter's name (DoRA's
  ``lora_magnitude_vector.<adapter>.weight`` is written as ``lora_magnitude_vector``);
- ``modules_to_save``: ``<module>.modules_to_save.<adapter>.<rest>`` as ``<module>.<rest>``;
- biases: every ``*.bias`` with ``bias="all"``, the wrapped layer's
  ``<module>.base_layer.bias`` of each LoRA layer with ``bias="lora_only"``;
- tensors of other adapters are left out; the adapter's name is then removed as peft
  removes it (the segment before the last, or the last).

Loading goes the other way through the same mapping (as peft's own load does): each
live FQN's file name is computed, and the file's tensors are found by it.

Adapters that peft saves with more than this (embedding layers among the targets,
trainable tokens) and other PEFT methods are refused with a clear error.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ..errors import StateMismatchError

LORA_LAYERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
EMBEDDING_LAYERS = ("embed_tokens", "lm_head")  # peft.utils.other.EMBEDDING_LAYER_NAMES
PREFIX = "base_model.model."


def adapters_in(fqns: Iterable[str]) -> set[str]:
    """The adapter names found in a PeftModel's FQNs."""
    found = set()
    for fqn in fqns:
        segments = fqn.split(".")
        for i, s in enumerate(segments[:-1]):
            if s in LORA_LAYERS or s == "modules_to_save":
                found.add(segments[i + 1])
    return found


def file_names(fqns: Iterable[str], adapter: str, config: dict[str, Any]) -> dict[str, str]:
    """FQN -> name in ``adapter_model.safetensors``, for the tensors of ``adapter``.

    Raises:
        StateMismatchError: the config is not a LoRA adapter this module can map (its
            message says what to do instead).
    """
    _check_supported(config, adapter)
    fqns = list(fqns)
    others = adapters_in(fqns) - {adapter}
    kept = [f for f in fqns if not any(f".{o}." in f or f.endswith(f".{o}") for o in others)]
    lora_layers = {m for f in kept if (m := _lora_module(f, adapter)) is not None}
    bias = config.get("bias", "none")
    out = {}
    for fqn in kept:
        segments = fqn.split(".")
        if _lora_module(fqn, adapter) is not None:
            key = fqn
            if key.endswith(f"lora_magnitude_vector.{adapter}.weight"):
                key = key.removesuffix(".weight")  # DoRA's layer, saved as its old parameter
        elif "modules_to_save" in segments[:-2] and _after(segments, "modules_to_save") == adapter:
            i = segments.index("modules_to_save")
            key = ".".join(segments[:i] + segments[i + 2 :])
        elif bias == "all" and fqn.endswith(".bias"):
            key = fqn
        elif bias == "lora_only" and fqn.endswith(".base_layer.bias"):
            if fqn.removesuffix(".base_layer.bias") not in lora_layers:
                continue
            key = fqn
        else:
            continue
        out[fqn] = remove_adapter_name(key, adapter)
    return out


def remove_adapter_name(key: str, adapter: str) -> str:
    """peft's ``_remove_adapter_name_from_state_dict_key``: ``a.lora_A.default.weight``
    -> ``a.lora_A.weight``; ``a.x.default`` -> ``a.x``."""
    if "." not in key:
        return key
    if key.endswith(f".{adapter}"):
        return key.removesuffix(f".{adapter}")
    key, _, suffix = key.rpartition(".")
    key = re.sub(re.escape(f".{adapter}") + r"$", "", key)
    return f"{key}.{suffix}"


def _lora_module(fqn: str, adapter: str) -> str | None:
    """The LoRA layer's module FQN if ``fqn`` is one of its tensors for ``adapter``."""
    segments = fqn.split(".")
    for i, s in enumerate(segments[:-1]):
        if s in LORA_LAYERS and segments[i + 1] == adapter and i > 0:
            return ".".join(segments[:i])
    return None


def _after(segments: list[str], name: str) -> str:
    return segments[segments.index(name) + 1]


def _check_supported(config: dict[str, Any], adapter: str) -> None:
    kind = config.get("peft_type")
    if kind != "LORA":
        raise StateMismatchError(
            f"adapter {adapter!r} is a {kind} adapter; only LoRA adapters (peft_type "
            "'LORA') are exported and imported: use peft's save_pretrained for others"
        )
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targeted = any(re.search(rf"(^|\.){e}($|\W)", targets) for e in EMBEDDING_LAYERS)
    else:
        targeted = any(t in EMBEDDING_LAYERS for t in targets)
    if targeted or config.get("trainable_token_indices") is not None:
        raise StateMismatchError(
            f"adapter {adapter!r} targets embedding layers or trainable tokens, which peft "
            "saves with whole embedding weights taken from the live model; export this "
            "adapter with peft's save_pretrained"
        )
