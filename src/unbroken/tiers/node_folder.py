"""This job's local-tier folder on one node: ``PATH/<job>/step_NNNNNNNN/``.

A step folder holds the manifest (the whole step's, the same bytes on every node) and the
shard files this node has of it: its own ranks', and the replicas it keeps. A step is
committed on a node once its folder has the manifest (written into a ``.partial-*``
folder, renamed into place); a replica file is written under ``.incoming-*`` and renamed
into the committed folder once whole, so a file that is there is whole. Only the node's
leader rank changes the folder.

``PATH`` itself is one job's at a time: its leader holds ``PATH/.in-use`` (an open file
description lock, dropped by the system when the process dies) from the Checkpointer's
start to its close.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import re
import shutil
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from ..format import manifest as manifest_file
from ..format.shards import checksum
from ..storage.locate import location
from ..storage.posix import RunLock, exchange

MANIFEST = "manifest.json"
_STEP = re.compile(r"step_(\d{8,})")
_LEFTOVER = (".partial-", ".trash-", ".incoming-", ".outgoing-", ".restore-")


def job_folder_name(persistent: str) -> str:
    """The subfolder of a job's local steps: its persistent folder's name and a digest of
    its whole path (readable, and distinct for distinct runs)."""
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", persistent.rstrip("/").rsplit("/", 1)[-1]) or "run"
    digest = hashlib.sha256(persistent.encode()).hexdigest()[:12]
    return f"{base[:40]}-{digest}"


class NodeFolder:
    """One node's folder of this job's local steps (``root``), under the tier's ``path``."""

    def __init__(self, path: str | os.PathLike, persistent: str) -> None:
        self.path = Path(os.path.abspath(os.fspath(path)))
        self.root = self.path / job_folder_name(persistent)
        self.persistent = persistent
        self._lock = RunLock(self.path, self.path / ".in-use")

    # -- the job's hold on the folder ---------------------------------------------------

    def hold(self) -> None:
        """Take the folder for this job, or raise naming the job that holds it."""
        if not self._lock.hold():
            owner = self.path / ".in-use.json"
            try:
                who = json.loads(owner.read_text())
                holder = f"the job saving into {who['persistent']} ({who['holder']})"
            except (OSError, ValueError, KeyError, TypeError):
                holder = f"another job ({self._lock.holder()})"
            raise CheckpointError(
                f"the local tier folder {self.path} is in use by {holder}: two jobs (or two "
                "Checkpointers) cannot share one. Give this one its own LocalTier(path=...), "
                "e.g. /dev/shm/unbroken-<job>"
            )
        with contextlib.suppress(OSError):
            record = {"persistent": self.persistent, "holder": self._lock.holder()}
            (self.path / ".in-use.json").write_text(json.dumps(record))

    def release(self) -> None:
        self._lock.release()

    # -- steps ---------------------------------------------------------------------------

    def step_path(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """Committed local steps on this node, ascending."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            m = _STEP.fullmatch(name)
            if m and (self.root / name / MANIFEST).is_file():
                found.append(int(m.group(1)))
        return sorted(found)

    def manifest(self, step: int) -> tuple[dict[str, Any], str]:
        """The step's manifest (checked) and the digest of its bytes (one save's copies
        share it)."""
        folder = self.step_path(step)
        data = (folder / MANIFEST).read_bytes()
        return manifest_file.read(location(folder)), checksum(data)

    def present(self, step: int, files: dict[str, Any]) -> list[str]:
        """The files of ``files`` (name -> record with ``size``) that this node holds
        whole for ``step``: plain files of the recorded size."""
        folder, held = self.step_path(step), []
        for name, record in files.items():
            try:
                st = os.lstat(folder / name)
            except OSError:
                continue
            if os.path.stat.S_ISREG(st.st_mode) and st.st_size == record["size"]:
                held.append(name)
        return sorted(held)

    # -- writing -------------------------------------------------------------------------

    def new_partial(self, step: int, token: str) -> Path:
        partial = self.root / f".partial-step_{step:08d}-{token}"
        try:
            partial.mkdir(parents=True)
        except OSError as exc:
            raise CheckpointError(
                f"cannot create {partial} in the local tier ({exc.strerror or exc}); check "
                f"that {self.path} is writable and has room"
            ) from None
        return partial

    def commit(self, partial: Path, step: int, data: bytes) -> Path:
        """``partial`` becomes the committed local step ``step``, its manifest last (a
        copy committed already is swapped out atomically, then removed)."""
        (partial / MANIFEST).write_bytes(data)
        final = self.step_path(step)
        if final.exists():
            if exchange(partial, final):
                shutil.rmtree(partial, ignore_errors=True)
                return final
            aside = self.root / f".trash-{final.name}-{partial.name}"
            os.rename(final, aside)
            os.rename(partial, final)
            shutil.rmtree(aside, ignore_errors=True)
            return final
        os.rename(partial, final)
        return final

    def discard(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def remove(self, step: int) -> None:
        """Unlist a local step (renamed aside first), then free its memory."""
        final = self.step_path(step)
        aside = self.root / f".trash-{final.name}-{os.getpid()}"
        try:
            os.rename(final, aside)
        except FileNotFoundError:
            return
        shutil.rmtree(aside, ignore_errors=True)

    def incoming(self, step: int, name: str) -> Path:
        """Where a replica file of ``step`` is received before it is whole."""
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / f".incoming-{step:08d}-{os.getpid()}-{name}"

    def outgoing(self, step: int, name: str) -> Path:
        """A link to this node's file ``name`` of ``step`` that stays until its replicas
        are sent, whatever retention does to the step meanwhile."""
        kept = self.root / f".outgoing-{step:08d}-{os.getpid()}-{name}"
        kept.unlink(missing_ok=True)
        os.link(self.step_path(step) / name, kept)
        return kept

    def settle(self, received: Path, step: int, name: str) -> bool:
        """Move a whole replica file into its committed step (False, and the file
        removed, when the step is no longer kept here)."""
        folder = self.step_path(step)
        if (folder / MANIFEST).is_file():
            with contextlib.suppress(OSError):
                os.rename(received, folder / name)
                return True
        received.unlink(missing_ok=True)
        return False

    def clean_leftovers(self) -> list[str]:
        """Remove what crashed saves, replications and restores of this job left (at the
        start only: later, another rank's replication may be using them)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        gone = [n for n in names if n.startswith(_LEFTOVER)]
        for name in gone:
            target = self.root / name
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
        return gone

    # -- restoring -----------------------------------------------------------------------

    def view(self, step: int, token: str, held: list[str]) -> Path:
        """A folder to restore from: the ``held`` files of ``step`` (its manifest among
        them, where this node has the step) linked (no copy), the files fetched from
        peers to be received into it."""
        folder = self.step_path(step)
        view = self.view_path(step, token)
        view.mkdir(parents=True)
        for name in held:
            os.link(folder / name, view / name)
        return view

    def view_path(self, step: int, token: str) -> Path:
        return self.root / f".restore-step_{step:08d}-{token}"


def unsound(path: Path, name: str, doc: dict[str, Any]) -> str | None:
    """Why the file ``name`` in ``path`` does not hold the bytes the manifest records
    (a chunk's checksum differs, or it is short), or None when it does."""
    chunks = [c for entry in doc["tensors"].values() for c in entry["chunks"] if c["file"] == name]
    try:
        with open(path / name, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != doc["files"][name]["size"]:
                return f"{name} is {size} bytes, not {doc['files'][name]['size']}"
            if size == 0:
                return None
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                view = memoryview(data)
                try:
                    for c in chunks:
                        if checksum(view[c["offset"] : c["offset"] + c["length"]]) != c["checksum"]:
                            return f"{name} fails the checksum of a chunk at byte {c['offset']}"
                finally:
                    view.release()
    except OSError as exc:
        return f"{name} cannot be read ({exc.strerror or exc})"
    return None
