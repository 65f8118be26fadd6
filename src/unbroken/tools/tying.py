"""Tied weights in a committed checkpoint: one parameter under two names.

A GPT's output head often *is* its token embedding (``lm_head.weight = wte.weight``).
The model's state dict then holds the same tensor under both names, and the checkpoint
stores both. The manifest does not record storage sharing, but it records what is
needed to find ties:

- the model's trainable parameters by FQN (``components.model.parameters``), as
  ``named_parameters()`` lists them: each parameter once, under the first name module
  traversal meets (``wte.weight``, registered before ``lm_head``);
- every model tensor's shape, dtype and fingerprint.

A model tensor that is not in that list, with the shape, dtype and fingerprint of exactly
one trainable parameter, is taken to be that parameter under another name. Equal values
are not proof of shared storage, so :func:`confirm` also compares the bytes and refuses
constant tensors (a buffer of ones equal to an untrained norm weight is a coincidence,
not a tie). Ties among frozen parameters only, and checkpoints whose manifest has no
``parameters`` list, are not detected (the tensors are then simply all kept).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..format import bitwise
from .contents import model_fqns


def tied_weights(doc: dict[str, Any]) -> dict[str, str]:
    """Alias FQN -> the trainable parameter's FQN it is tied to, from the manifest alone.

    Args:
        doc: a manifest read with ``unbroken.format.manifest.read``.
    Returns:
        ``{"lm_head.weight": "wte.weight"}`` for a GPT with a tied head; ``{}`` when the
        manifest cannot tell (no ``parameters`` list) or nothing is tied.
    """
    model = doc["components"].get("model") or {}
    params = model.get("parameters")
    if params is None:
        return {}
    fqns = model_fqns(doc)
    trainable = set(params)
    owners: dict[tuple, list[str]] = {}
    for fqn in sorted(trainable & fqns.keys()):
        owners.setdefault(_identity(doc["tensors"][fqns[fqn]]), []).append(fqn)
    out = {}
    for fqn, key in sorted(fqns.items()):
        entry = doc["tensors"][key]
        if fqn in trainable or _numel(entry["shape"]) <= 1:
            continue
        candidates = owners.get(_identity(entry), [])
        if len(candidates) == 1:
            out[fqn] = candidates[0]
    return out


def confirm(
    doc: dict[str, Any], ties: dict[str, str], read: Callable[[str], torch.Tensor]
) -> dict[str, str]:
    """The ties whose two tensors have the same bytes and are not constant.

    Reads two tensors at a time (``read`` takes a manifest key).
    """
    fqns = model_fqns(doc)
    out = {}
    for alias, target in ties.items():
        a = read(fqns[alias]).reshape(-1)
        b = read(fqns[target]).reshape(-1)
        same = a.dtype == b.dtype and a.shape == b.shape and bitwise.equal(a, b)
        if same and not _constant(b):
            out[alias] = target
        del a, b
    return out


def _identity(entry: dict[str, Any]) -> tuple:
    return entry.get("fingerprint"), tuple(entry["shape"]), entry["dtype"]


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _constant(t: torch.Tensor) -> bool:
    flat = t.view(torch.uint8).reshape(t.numel(), -1)
    return bool((flat == flat[:1]).all())
