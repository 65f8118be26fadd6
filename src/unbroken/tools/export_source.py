"""What an export reads: one committed checkpoint's model tensors, each verified.

Every export format (one ``.safetensors`` file, a Hugging Face folder, a PEFT adapter)
reads the same way: the step folder is located and its manifest read, tied weights are
found and confirmed on the bytes (``tying.py``), and each tensor is read whole
(assembled from shards of any world size), checked against its checksums and its
fingerprint, and handed to the writer one at a time, so memory stays bounded by the
largest tensor.

A checkpoint saved with ``frozen="verify"`` does not store its frozen parameters, only
their fingerprints (the manifest's ``frozen`` field). Those are read from a base the
caller names (``base_weights.py``), checked against the recorded fingerprint, or the
export is refused naming what is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..errors import IncompleteCheckpointError, StateMismatchError
from ..format import fingerprint, manifest
from ..format.manifest import DTYPES
from ..format.tensor_reader import TensorReader
from ..storage.interface import Location
from .base_weights import BaseWeights, unstored_frozen
from .contents import model_fqns
from .folders import locate
from .reporting import Progress, ProgressCount
from .safetensors_files import SAFETENSORS_DTYPES, Entry
from .tying import confirm, tied_weights

_CASTABLE = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class ExportSource:
    """A checkpoint opened for export (use in a ``with`` block: files stay open).

    Attributes:
        folder: the step folder.
        doc: its manifest.
        fqns: model FQN -> manifest tensor key, for every stored model tensor.
        frozen: model FQN -> the manifest's ``frozen`` entry, for each frozen parameter
            the checkpoint does not store (read from the base).
        ties: alias FQN -> the FQN it is tied to (confirmed on the bytes).
    """

    def __init__(
        self,
        path: str | os.PathLike | Location,
        step: int | None,
        *,
        base: str | os.PathLike | None = None,
        needs_frozen: bool = True,
    ) -> None:
        self.folder = locate(path, step)
        self.doc = manifest.read(self.folder)
        manifest.require_known_fingerprints(self.folder, self.doc)
        self.algorithm = manifest.fingerprint_algorithm(self.doc)
        if "model" not in self.doc["components"]:
            raise IncompleteCheckpointError("the checkpoint has no 'model' component to export")
        self.fqns = model_fqns(self.doc)
        self.frozen = unstored_frozen(self.doc) if needs_frozen else {}
        self._base: BaseWeights | None = None
        if self.frozen:
            if base is None:
                raise IncompleteCheckpointError(
                    f"{self.folder} was saved with frozen='verify': its {len(self.frozen)} "
                    f"frozen parameter(s) ({', '.join(sorted(self.frozen)[:3])}"
                    f"{', ...' if len(self.frozen) > 3 else ''}) are not stored, only their "
                    "fingerprints; pass --base (base= in Python) naming the base model they "
                    "came from (an HF folder, a .safetensors file, or a folder of them)"
                )
            self._base = BaseWeights(Path(base), self.algorithm)
        self._reader = TensorReader(self.folder, self.doc)
        self.ties: dict[str, str] = {}
        found = tied_weights(self.doc)
        if found:  # confirmed on the bytes: equal values alone do not make a tie
            try:
                self.ties = confirm(self.doc, found, self._reader.read)
            except BaseException:
                self._reader.close()
                raise

    def __enter__(self) -> ExportSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._reader.close()
        if self._base is not None:
            self._base.close()

    def entry(self, name: str, fqn: str, dtype: torch.dtype | None) -> Entry:
        """The file entry ``name`` for model tensor ``fqn``, cast to ``dtype`` if it is
        floating-point (integer and bool buffers keep theirs).

        Raises:
            StateMismatchError: the dtype cannot be stored in safetensors.
        """
        info = self.frozen[fqn] if fqn in self.frozen else self.doc["tensors"][self.fqns[fqn]]
        saved = DTYPES[info["dtype"]]
        target = dtype if dtype is not None and saved in _CASTABLE else saved
        if target not in SAFETENSORS_DTYPES:
            raise StateMismatchError(f"{fqn}: dtype {target} cannot be stored in safetensors")
        return Entry(name, tuple(info["shape"]), target)

    def model_tensors(self) -> list[str]:
        """Every model FQN an export writes, sorted: stored ones and frozen ones from the
        base, aliases of tied weights left out."""
        return sorted((self.fqns.keys() | self.frozen.keys()) - self.ties.keys())

    def count_progress(self, progress: Progress | None, fqns: list[str]) -> None:
        """Report progress in bytes as ``fqns`` are read (call before :meth:`read`)."""
        tensors = self.doc["tensors"]
        total = sum(
            c["length"] for f in fqns if f in self.fqns for c in tensors[self.fqns[f]]["chunks"]
        )
        self._reader.on_bytes = ProgressCount(progress, total)

    def read(self, fqn: str) -> torch.Tensor:
        """Model tensor ``fqn`` in its saved dtype, checked against its fingerprint.

        Raises:
            CorruptCheckpointError: a chunk fails its checksum, or a file is missing.
            StateMismatchError: the value does not match the recorded fingerprint (from
                the base: the base differs from the one the run was saved with).
        """
        if fqn in self.frozen:
            assert self._base is not None
            return self._base.read(fqn, self.frozen[fqn])
        key = self.fqns[fqn]
        t = self._reader.read(key)
        if fingerprint.fingerprint(t, self.algorithm) != self.doc["tensors"][key].get(
            "fingerprint"
        ):
            raise StateMismatchError(
                f"{key}: its stored value does not match the manifest's fingerprint; "
                f"run `unbroken verify {self.folder}`"
            )
        return t
