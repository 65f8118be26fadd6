"""A checkpoint's files on an object store: :class:`StorePath`, the ``Location`` role for
a key under a store's URL, and :class:`ObjectJournal`, its append-only record.

An object store has no links, no sparse files and no folders of its own (a "folder" is a
key prefix), so the rules a local disk needs reduce to: a listed object is there, of its
recorded size. Objects under a step that its manifest does not list are no damage: they
are a crashed or losing save's uploads, which a later save removes (``store_medium.py``).

A store cannot append, so a journal (the tracked-metrics record) is a series of objects
of up to about :data:`CHUNK_BYTES` under ``PREFIX/<name>/``, named
``<wall-clock ns>-<writer id>-<seq>.jsonl`` when started: listing them in name order
gives the lines in the order they were appended, across every resume of the run (each
resume is a later process, so a later clock). Each append rewrites the object being
filled with the new lines at its end, so a long run with frequent appends still leaves
few objects to list and read.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..env import env_number
from ..errors import CheckpointError
from .interface import FileStat, Identity, TooLarge
from .names import MANIFEST
from .store import Store
from .store_io import UploadAborted, concurrency

INTERVAL_ENV = "UNBROKEN_STORE_METRICS_S"
CHUNK_BYTES = 1 << 20  # a journal's object is rewritten with new lines until it holds this much


class _ObjectChunks:
    """A :class:`~.interface.ChunkReader` of one object: parallel ranged reads."""

    def __init__(self, path: StorePath) -> None:
        self._path = path

    def read_into(self, offset: int, buf: memoryview) -> int:
        return self._path.store.read_into(self._path.key, offset, buf)

    def close(self) -> None:
        pass  # nothing stays open between requests


class _Segments:
    """A :class:`~.interface.FileSink` that keeps the segments for one upload."""

    def __init__(self) -> None:
        self.segments: list[memoryview] = []

    def write(self, data: memoryview | bytes) -> int:
        view = memoryview(data)
        self.segments.append(view)
        return view.nbytes


class StorePath:
    """A folder or object of a checkpoint on a store: ``str()`` is its URL, ``/`` joins.

    ``tag`` (a save's id) travels with a partial save's step folder: each rank names
    its shard object with it, so two saves of one step never write the same object.
    """

    __slots__ = ("key", "store", "tag")
    saves_in_place = True
    keeps_written_buffers = True

    def __init__(self, store: Store, key: str, tag: str | None = None) -> None:
        self.store = store
        self.key = key.rstrip("/")
        self.tag = tag

    @classmethod
    def parse(cls, url: str) -> StorePath:
        store, key = Store.for_url(url)
        if not key or ("/" not in key.strip("/") and store.is_s3):
            raise CheckpointError(
                f"{url}: name a folder inside a bucket (s3://BUCKET/FOLDER), not a bucket"
            )
        return cls(store, key)

    def __truediv__(self, name: str) -> StorePath:
        return StorePath(self.store, f"{self.key}/{name}")

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> StorePath:
        return StorePath(self.store, self.key.rsplit("/", 1)[0])

    def __str__(self) -> str:
        return self.store.url(self.key)

    def __repr__(self) -> str:
        return f"StorePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorePath) and (self.store, self.key) == (other.store, other.key)

    def __hash__(self) -> int:
        return hash(self.key)

    def exists(self) -> bool:
        return bool(self.store.listing(self.key)) or self.store.info(self.key) is not None

    def resolve(self) -> StorePath:
        return self  # a URL is absolute already

    def is_link(self) -> bool:
        return False  # object stores have no links

    def is_dir(self) -> bool:
        """Whether objects lie under this prefix."""
        return bool(self.store.listing(self.key))

    def has_file(self, name: str) -> bool:
        return self.store.info((self / name).key) is not None

    def identity(self) -> Identity | None:
        """The identity (ETag) of the folder's manifest object, which a re-save or a
        removal changes."""
        info = self.store.info((self / MANIFEST).key)
        return None if info is None else (0, 0, hash(info["etag"]))

    def objects(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every object under this prefix (recursively): (key relative to it, its size,
        identity and age), by key."""
        yield from sorted(self.store.listing(self.key).items())

    def plain_files(self) -> dict[str, FileStat]:
        return {
            rel: FileStat(info["size"], info["size"])
            for rel, info in self.objects()
            if "/" not in rel
        }

    def file_problem(self, size: int) -> str | None:
        info = self.store.info(self.key)
        if info is None:
            return f"{self} is missing"
        if info["size"] != size:
            return f"{self} is {info['size']} bytes, the manifest says {size}: it was truncated"
        return None

    def problems(self, listed: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
        present = self.plain_files()
        found = []
        for name, rec in sorted(listed.items()):
            if name not in present:
                found.append((name, f"{self / name} is missing"))
            elif present[name].size != rec["size"]:
                why = (
                    f"{self / name} is {present[name].size} bytes, the manifest says "
                    f"{rec['size']}: it was truncated or altered"
                )
                found.append((name, why))
        return found

    def read_capped(self, limit: int) -> bytes:
        # One ranged request: never more than limit + 1 bytes of a hostile object.
        data = self.store.read_upto(self.key, limit)
        if len(data) > limit:
            info = self.store.info(self.key)
            raise TooLarge(str(self), None if info is None else info["size"])
        return data

    # -- what callers need where media differ (``interface.Location``) --------------------

    def files_per_shard(self, wanted: int) -> int:
        return 1  # one object, uploaded in parallel parts

    @property
    def chunk_requests(self) -> int:
        return concurrency()

    def free_space(self) -> str:
        return "unknown"

    def is_empty(self) -> bool:
        return not self.exists()

    def make_dirs(self) -> None:
        pass  # a prefix exists once an object is under it

    def local_file(self, name: str) -> Path:
        return Path(name)  # a URL is not a local folder: the current one

    def journal(self, name: str) -> ObjectJournal:
        return ObjectJournal(self / name)

    # -- a committed checkpoint's folder as a whole (``store_medium.py``) ----------------

    def manifest_bytes(self) -> bytes | None:
        """The bytes of this folder's manifest, or None if it has none."""
        try:
            return self.store.read((self / MANIFEST).key)
        except FileNotFoundError:
            return None

    def listed_files(self, data: bytes | None = None) -> list[str]:
        """The names this folder's manifest (or ``data``) lists (none if unreadable)."""
        try:
            doc = json.loads(self.store.read((self / MANIFEST).key) if data is None else data)
            return [n for n in doc.get("files", {}) if isinstance(n, str) and "/" not in n]
        except (FileNotFoundError, ValueError, AttributeError, CheckpointError):
            return []

    def move_checkpoint(self, dst: StorePath) -> None:
        """Copy the committed checkpoint in this folder to ``dst`` (manifest last,
        create-only: committed there only once whole, never over another save's), unlist
        it here (manifest first), then delete its objects.

        Raises ``FileExistsError`` (this folder is left as it is) if ``dst`` is committed
        already, and ``FileNotFoundError`` if this folder is not (anymore)."""
        if self.store.info((dst / MANIFEST).key) is not None:
            raise FileExistsError(str(dst / MANIFEST))
        data = self.store.read((self / MANIFEST).key)
        names = self.listed_files(data)
        for name in names:
            self.store.copy((self / name).key, (dst / name).key)
        self.store.put((dst / MANIFEST).key, data, create=True)
        self.store.delete([(self / MANIFEST).key])
        self.store.delete([(self / name).key for name in names])

    def delete_all(self) -> None:
        """Delete every object under this prefix, the manifest first (unlisted at once)."""
        keys = [(self / rel).key for rel in self.store.listing(self.key)]
        manifest = (self / MANIFEST).key
        self.store.delete([k for k in keys if k == manifest])
        self.store.delete([k for k in keys if k != manifest])

    def open_chunks(self) -> _ObjectChunks:
        return _ObjectChunks(self)

    @contextlib.contextmanager
    def create(self) -> Iterator[_Segments]:
        """The segments are uploaded from their own memory once the block ends (in
        parallel parts where the store has them); nothing appears if it raises."""
        sink = _Segments()
        yield sink
        try:
            self.store.upload(self.key, sink.segments)
        except UploadAborted as exc:
            if not self.parent.has_file(MANIFEST):
                raise
            raise UploadAborted(
                f"{exc}. {self.parent} was committed meanwhile by another save: `unbroken "
                f"inspect {self.parent}` names its run"
            ) from exc


class ObjectJournal:
    """The ``Journal`` role on a store: lines go, in order, into objects under
    ``folder`` (see the module docstring). Appends to one journal are made one at a time
    (a lock); a failed one changes nothing and is retried under the same name, with what
    follows, by the next append."""

    def __init__(self, folder: StorePath) -> None:
        self._folder = folder
        self._writer = uuid.uuid4().hex[:12]
        self._name: str | None = None  # the object being filled
        self._body = ""  # its text, as uploaded
        self._seq = 0
        self._last_ns = 0
        self._lock = threading.Lock()

    def __str__(self) -> str:
        return f"{self._folder}/"

    @property
    def write_interval(self) -> float:
        """``UNBROKEN_STORE_METRICS_S`` (default 30): every append is a request."""
        return env_number(INTERVAL_ENV, 30.0, 0.0)

    def append(self, text: str) -> None:
        with self._lock:
            if self._name is None:
                self._name = self._next_name()
            body = self._body + text
            store = self._folder.store
            store.put((self._folder / self._name).key, body.encode("utf-8"))
            if len(body) >= CHUNK_BYTES:
                self._name, self._body = None, ""
            else:
                self._body = body

    def sync(self) -> None:
        pass  # an append is durable when it returns

    def close(self) -> None:
        pass  # nothing stays open between requests

    def lines(self) -> list[str] | None:
        store = self._folder.store
        names = sorted(n for n in store.listing(self._folder.key) if n.endswith(".jsonl"))
        if not names:
            return None
        with ThreadPoolExecutor(min(len(names), concurrency()), "unbroken-journal-read") as pool:
            texts = list(pool.map(lambda n: store.read((self._folder / n).key), names))
        found: list[str] = []
        for data in texts:
            found += data.decode("utf-8", errors="replace").splitlines()
        return found

    def _next_name(self) -> str:
        now = max(time.time_ns(), self._last_ns + 1)  # strictly increasing in this process
        self._last_ns = now
        self._seq += 1
        return f"{now:020d}-{self._writer}-{self._seq:06d}.jsonl"
