"""What a restore did, for people and for code."""

from __future__ import annotations

import dataclasses
from typing import Literal

ComponentStatus = Literal["restored", "reset", "absent"]


@dataclasses.dataclass(frozen=True)
class RestoreReport:
    """The outcome of :meth:`Checkpointer.restore`.

    Attributes:
        step: the step to continue from (0 on a fresh start).
        restored: whether a checkpoint was loaded.
        path: the checkpoint folder loaded, or None.
        components: name -> ``"restored"`` (loaded and verified), ``"reset"`` (started
            fresh on request, recorded in the lineage) or ``"absent"`` (not loaded:
            no checkpoint yet, or not passed to the Checkpointer).
        verified: every restored tensor matched its saved fingerprint (and the probe).
        saved_world_size: world size at save time (None on a fresh start).
        world_size: world size now.
        resharded: the state was redistributed: another world size, or tensors cut
            otherwise than at save (another mesh or sharding on the same world size).
        warnings: things worth a look that did not stop the restore.
        searched: the folder the restore looked in.
        found: on a fresh start, what it found there (does not exist, empty, another
            tool's files).
        source: where the restored state came from: ``"local"`` (the local tier, each
            node's own memory), ``"peer"`` (the local tier, some files fetched from
            another node's copy), ``"persistent"`` (the checkpoint folder); None on a
            fresh start.
        frozen_verified: frozen parameters the checkpoint does not store (saved with
            ``frozen="verify"``) whose live values were checked against its fingerprints.
    """

    step: int = 0
    restored: bool = False
    path: str | None = None
    components: dict[str, ComponentStatus] = dataclasses.field(default_factory=dict)
    verified: bool = False
    saved_world_size: int | None = None
    world_size: int = 1
    resharded: bool = False
    warnings: list[str] = dataclasses.field(default_factory=list)
    searched: str | None = None
    found: str | None = None
    source: str | None = None
    frozen_verified: int = 0

    @property
    def headline(self) -> str:
        """One line that tells a resume from a fresh start (what framework integrations
        log): ``resumed from step 120, verified bit for bit, from PATH``."""
        if not self.restored:
            where = f" in {self.searched}" if self.searched else ""
            return f"started fresh: no checkpoint restored{where}"
        check = "verified bit for bit" if self.verified else "NOT verified"
        again = (
            f", resharded {self.saved_world_size} -> {self.world_size}" if self.resharded else ""
        )
        return (
            f"resumed from step {self.step}, {check}{again}, from {self.path}"
            f"{_TIERS.get(self.source or '', '')}"
        )

    def __str__(self) -> str:
        if not self.restored:
            lines = [f"fresh start (no checkpoint restored), world size {self.world_size}"]
            if self.found:
                lines.append(f"  looked in: {self.found}")
        else:
            ws = f"world size {self.saved_world_size} -> {self.world_size}"
            lines = [
                f"restored step {self.step} from {self.path}{_TIERS.get(self.source or '', '')}",
                f"  {ws}{' (resharded)' if self.resharded else ''}",
                f"  verified: {'yes, bit-exact' if self.verified else 'NO'}",
            ]
            if self.frozen_verified:
                lines.append(
                    f"  frozen base: {self.frozen_verified} parameter(s) not stored, the live "
                    "ones verified by fingerprint"
                )
        for name, status in self.components.items():
            lines.append(f"  {name:<12} {status}")
        lines.extend(f"  warning: {w}" for w in self.warnings)
        return "\n".join(lines)


_TIERS = {"local": " (local tier)", "peer": " (local tier, with files from a peer's copy)"}
