"""The files of a step folder, judged on disk before any of their bytes is read.

A committed checkpoint's folder holds ``manifest.json`` and the shard files it lists,
nothing else. Each is a plain file, never a symbolic link (a hostile checkpoint must not
make a reader read outside its folder), of exactly its recorded size, and allocated on
disk: a sparse file (mostly holes) claims bytes it does not hold, and reading it would
spend memory on data that is not there, so memory stays bounded by what the checkpoint
really takes on disk. ``restore()``, ``unbroken verify`` and the offline readers apply
these same rules.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError
from .remote import RemotePath

MANIFEST = "manifest.json"
ALLOW_SPARSE = "UNBROKEN_ALLOW_SPARSE"  # set to 1 where allocation is not reported
_HOLES_ALLOWED = 1 << 20  # unallocated bytes a file may have (block rounding, tiny files)


def refuse_links(folder: Path) -> None:
    """Raise if the step folder itself is a symbolic link (checkpoints never are)."""
    if not isinstance(folder, RemotePath) and folder.is_symlink():
        raise CorruptCheckpointError(f"{folder} is a symbolic link; checkpoints never are")


def allocated(st: os.stat_result) -> int:
    """Bytes a file takes on disk (its size where the platform does not say)."""
    blocks = getattr(st, "st_blocks", None)
    return st.st_size if blocks is None else blocks * 512


def _sparse(path: Path, st: os.stat_result) -> str | None:
    held = allocated(st)
    if st.st_size - held <= _HOLES_ALLOWED or held * 2 >= st.st_size:
        return None
    if os.environ.get(ALLOW_SPARSE) == "1":
        return None
    return (
        f"{path} is sparse: {st.st_size} bytes long but only {held} allocated on disk. A "
        "save writes every byte, so the file was made to look larger than it is; reading "
        "it would spend memory on data that is not there. (Where the file system does not "
        f"report allocated blocks, or compresses files, set {ALLOW_SPARSE}=1)"
    )


def file_problem(path: Path, size: int) -> str | None:
    """Why the listed file ``path`` of recorded ``size`` must not be read, or None."""
    if isinstance(path, RemotePath):
        info = path.store.info(path.key)
        if info is None:
            return f"{path} is missing"
        if info["size"] != size:
            return f"{path} is {info['size']} bytes, the manifest says {size}: it was truncated"
        return None
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return f"{path} is missing"
    except OSError as exc:  # no permission on the folder, an I/O error
        return f"{path} cannot be read ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link; checkpoints never hold one"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_size != size:
        return (
            f"{path} is {st.st_size} bytes, the manifest says {size}: it was truncated or altered"
        )
    return _sparse(path, st)


def problems(folder: Path, listed: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(file name, message) for every listed file that must not be read and every file
    in ``folder`` that the manifest does not list, by name.

    On an object store, objects the manifest does not list are not damage: they are a
    crashed or losing save's uploads (remote_dir.py), which a later save removes."""
    if isinstance(folder, RemotePath):
        return _remote_problems(folder, listed)
    found = []
    for name, rec in sorted(listed.items()):
        why = file_problem(folder / name, rec["size"])
        if why is not None:
            found.append((name, why))
    try:
        present = set(os.listdir(folder))
    except OSError as exc:  # gone meanwhile (pruned: the caller re-lists) or unreadable
        return [*found, (folder.name, f"{folder} cannot be listed ({exc.strerror or exc})")]
    for name in sorted(present - set(listed) - {MANIFEST}):
        found.append((name, f"{folder / name} is not listed in the manifest: something other "
                            "than the save wrote there"))  # fmt: skip
    return found


def _remote_problems(
    folder: RemotePath, listed: Mapping[str, Mapping[str, Any]]
) -> list[tuple[str, str]]:
    present = {rel: info for rel, info in folder.iter_files() if "/" not in rel}
    found = []
    for name, rec in sorted(listed.items()):
        if name not in present:
            found.append((name, f"{folder / name} is missing"))
        elif present[name]["size"] != rec["size"]:
            found.append((name, f"{folder / name} is {present[name]['size']} bytes, the "
                                f"manifest says {rec['size']}: it was truncated or altered"))  # fmt: skip
    return found


def shard_budget(folder: Path) -> tuple[int, int]:
    """(plain files other than the manifest, bytes they take on disk) in ``folder``: what a
    manifest's size is judged against before it is parsed."""
    if isinstance(folder, RemotePath):
        sizes = [i["size"] for rel, i in folder.iter_files() if rel != MANIFEST and "/" not in rel]
        return len(sizes), sum(sizes)
    count = held = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name == MANIFEST or not entry.is_file(follow_symlinks=False):
                continue
            st = entry.stat(follow_symlinks=False)
            count += 1
            held += min(st.st_size, allocated(st))
    return count, held
