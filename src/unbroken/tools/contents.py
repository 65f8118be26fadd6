"""What a manifest's components hold, from the JSON alone: the tensors each component's
skeleton(s) reference (``format.state_compare.skeletons``), and the model's parameter and
buffer FQNs.

Shared by every offline tool (inspection, verification, comparison, export, coverage).
"""

from __future__ import annotations

from typing import Any

from ..format import tree
from ..format.state_compare import skeletons


def tensor_components(doc: dict[str, Any]) -> dict[str, str]:
    """Tensor key -> name of the component whose state references it."""
    owner: dict[str, str] = {}
    for name in doc["components"]:
        for skeleton in skeletons(doc, name):
            for key in tree.tensor_keys(skeleton):
                owner.setdefault(key, name)
    return owner


def unescape(segment: str) -> str:
    """A key segment as the name it escapes (``%2F`` stands for ``/``, ``%25`` for ``%``)."""
    return segment.replace("%2F", "/").replace("%25", "%")


def model_fqns(doc: dict[str, Any]) -> dict[str, str]:
    """Normalized model FQN -> tensor key (``<name>.<fqn>`` for a dict of models)."""
    if "model" not in doc["components"]:
        return {}
    keys = tree.tensor_keys(doc["components"]["model"].get("state"))
    # A reference to an unlisted tensor is damage that `unbroken verify` names.
    listed = [key for key in keys if key in doc["tensors"]]
    return {fqn_of_key(key): key for key in listed}


def fqn_of_key(key: str) -> str:
    """The model FQN a model tensor key stands for (``model/fc.weight`` -> ``fc.weight``;
    ``<name>.<fqn>`` for a dict of models)."""
    return ".".join(unescape(s) for s in key.split("/")[1:])
