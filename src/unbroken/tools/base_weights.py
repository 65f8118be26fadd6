"""The frozen part of a ``frozen="verify"`` checkpoint, taken from its base model.

Such a checkpoint stores its trainable tensors only; for each frozen parameter the
manifest's ``frozen`` field records ``{"shape", "dtype", "fingerprint", "stored"}``
(keyed like ``doc["tensors"]``), and those with ``"stored": false`` are in no file. An
export that needs them reads them from the base the run started from, each checked for
shape, dtype and fingerprint before it is written: a base that differs is refused,
naming the tensor. A name is looked up as the FQN, then (PEFT's wrapping) without a
leading ``base_model.model.`` and with ``.base_layer`` removed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import IncompleteCheckpointError, StateMismatchError
from ..format import fingerprint
from ..format.manifest import DTYPES
from .contents import fqn_of_key
from .hf_folders import open_base
from .peft_names import PREFIX


def unstored_frozen(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Model FQN -> the manifest's ``frozen`` entry, for each frozen tensor not stored."""
    frozen = doc.get("frozen") or {}
    return {
        fqn_of_key(key): entry
        for key, entry in frozen.items()
        if not entry.get("stored", True) and key.split("/")[0] == "model"
    }


def base_names(fqn: str) -> list[str]:
    """The names ``fqn`` may have in the base, in the order they are tried."""
    plain = fqn.removeprefix(PREFIX).replace(".base_layer.", ".")
    return [fqn] if plain == fqn else [fqn, plain]


class BaseWeights:
    """A base model opened to supply a checkpoint's unstored frozen tensors."""

    def __init__(self, path: Path, algorithm: str) -> None:
        self.path = path
        self.algorithm = algorithm
        self.files = open_base(path)

    def close(self) -> None:
        """Nothing stays open (each read opens its file); kept for symmetry."""

    def read(self, fqn: str, entry: dict[str, Any]) -> torch.Tensor:
        """Frozen tensor ``fqn`` from the base, checked against its manifest ``entry``.

        Raises:
            IncompleteCheckpointError: the base has no tensor by any of its names.
            StateMismatchError: shape, dtype or fingerprint differ.
        """
        names = base_names(fqn)
        name = next((n for n in names if n in self.files.headers), None)
        if name is None:
            raise IncompleteCheckpointError(
                f"the base {self.path} has no tensor {' or '.join(map(repr, names))} for the "
                f"frozen parameter {fqn}; pass the base model this run was started from"
            )
        dtype, shape = self.files.headers[name].tensors[name]
        want_dtype, want_shape = DTYPES[entry["dtype"]], tuple(entry["shape"])
        if (dtype, shape) != (want_dtype, want_shape):
            raise StateMismatchError(
                f"{fqn}: the base {self.path} holds {name!r} as {list(shape)} {dtype}, the "
                f"run saved it as {list(want_shape)} {want_dtype}: the base differs from the "
                "one this run was saved with"
            )
        t = self.files.read(name)
        if fingerprint.fingerprint(t, self.algorithm) != entry["fingerprint"]:
            raise StateMismatchError(
                f"{fqn}: {name!r} in the base {self.path} does not match the fingerprint "
                "recorded at save: the base differs from the one this run was saved with; "
                "pass that base"
            )
        return t
