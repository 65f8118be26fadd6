"""Object stores (S3 and any fsspec URL): one client per file system, and every request.

The paths of a checkpoint on a store are ``StorePath``s (``store_path.py``); each of
their operations is a request made here. The store is an fsspec file system, imported
only when a URL is used (``import unbroken`` never needs fsspec). Its options come from
fsspec's own configuration, so no new argument is needed: botocore's ``AWS_ENDPOINT_URL``, ``AWS_PROFILE`` and
credentials chain for S3; ``FSSPEC_S3_<OPTION>`` environment variables or an fsspec
config file (``FSSPEC_CONFIG_DIR``) for anything else.

Every request is retried with bounded exponential back-off on transient failures
(dropped connection, 5xx, throttling) on top of the client's own retries, then raised as
a :class:`~unbroken.errors.CheckpointError` naming the object. Missing objects
(``FileNotFoundError``), refused permissions and lost conditional writes
(``FileExistsError``) are answers, not failures, and are never retried.

Tunables (environment): ``UNBROKEN_STORE_RETRIES`` (attempts, default 4),
``UNBROKEN_STORE_BACKOFF_S`` (first wait, default 0.5 s, doubling),
``UNBROKEN_STORE_PART_MB`` (upload/read part size, default 32),
``UNBROKEN_STORE_CONCURRENCY`` (parts in flight per rank, default 8).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..env import env_number
from ..errors import CheckpointError
from . import store_io

logger = logging.getLogger(__name__)
T = TypeVar("T")

RETRIES_ENV = "UNBROKEN_STORE_RETRIES"
BACKOFF_ENV = "UNBROKEN_STORE_BACKOFF_S"
_NOT_RETRIED = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)
_stores: dict[str, Store] = {}
_stores_lock = threading.Lock()


class Store:
    """One fsspec file system (one protocol, one set of options), shared per process.

    Thread-safe: fsspec's async back-ends run every call on their own event loop thread.
    """

    def __init__(self, protocol: str, fs: Any) -> None:
        self.protocol = protocol
        self.fs = fs

    @classmethod
    def for_url(cls, url: str) -> tuple[Store, str]:
        """(the store of ``url``, the key ``url`` names in it)."""
        try:
            import fsspec  # optional: only URLs need it
        except ImportError:
            raise CheckpointError(
                f"{url}: checkpoints on object stores need fsspec (and s3fs for s3://): "
                "pip install 'unbroken[s3]'"
            ) from None
        protocol = url.split("://", 1)[0]
        try:
            fs, key = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise CheckpointError(
                f"{url}: no file system for {protocol}:// ({exc}); install its fsspec "
                "back-end (s3fs for s3://, gcsfs for gs://, adlfs for az://)"
            ) from None
        with _stores_lock:
            ident = f"{protocol}:{id(fs)}"
            store = _stores.get(ident)
            if store is None:
                store = _stores[ident] = cls(protocol, fs)
        return store, key.rstrip("/")

    @property
    def is_s3(self) -> bool:
        return hasattr(self.fs, "call_s3")

    def url(self, key: str) -> str:
        try:
            return str(self.fs.unstrip_protocol(key))
        except AttributeError:
            return f"{self.protocol}://{key}"

    def call(self, doing: str, key: str, fn: Callable[[], T], fix: str = "") -> T:
        """``fn()``, retried on transient failures, else a ``CheckpointError`` naming
        the object (``doing`` says what was being done to it)."""
        attempts = int(env_number(RETRIES_ENV, 4, 1))
        wait = env_number(BACKOFF_ENV, 0.5, 0)
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except _NOT_RETRIED:
                raise
            except Exception as exc:  # the client's errors are of many types
                if attempt == attempts:
                    raise CheckpointError(
                        f"{doing} {self.url(key)} failed after {attempts} attempt(s): "
                        f"{type(exc).__name__}: {exc}"
                        + (f"; {fix}" if fix else "; check the store and try again")
                    ) from exc
                logger.warning(
                    "%s %s failed (%s: %s), attempt %d of %d; retrying in %.1fs",
                    doing,
                    self.url(key),
                    type(exc).__name__,
                    exc,
                    attempt,
                    attempts,
                    wait,
                )
                time.sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")

    # -- whole objects ---------------------------------------------------------------

    def read(self, key: str) -> bytes:
        return self.call("reading", key, lambda: self.fs.cat_file(key))

    def read_upto(self, key: str, limit: int) -> bytes:
        """The object's bytes, or its first ``limit + 1`` when it is larger: one ranged
        request, so that a hostile object larger than ``limit`` is never downloaded.
        ``FileNotFoundError`` if there is none."""
        return self.call("reading", key, lambda: store_io.cat_range(self.fs, key, 0, limit + 1))

    def info(self, key: str) -> dict[str, Any] | None:
        """The object's size and identity (``etag``), or None if there is none."""

        def ask() -> dict[str, Any] | None:
            with contextlib.suppress(AttributeError):
                self.fs.invalidate_cache(key)
            try:
                got = self.fs.info(key)
            except FileNotFoundError:
                return None
            if got.get("type") == "directory":
                return None
            return {"size": int(got["size"]), "etag": _etag(got)}

        return self.call("looking up", key, ask)

    def put(self, key: str, data: bytes, *, create: bool = False) -> None:
        """Write a whole object. ``create``: only if none exists (``If-None-Match: *`` on
        S3), else ``FileExistsError``; stores without conditional writes check first."""
        mode = "create" if create else "overwrite"
        self.call("writing", key, lambda: self.fs.pipe_file(key, data, mode=mode))

    def copy(self, src: str, dst: str) -> None:
        """Server-side copy where the store has one (S3 CopyObject)."""
        self.call("copying", src, lambda: self.fs.copy(src, dst))

    def delete(self, keys: list[str]) -> None:
        """Delete objects; those already gone are no error."""
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self.call("deleting", key, lambda k=key: self.fs.rm_file(k))

    def listing(self, prefix: str) -> dict[str, dict[str, Any]]:
        """Every object under ``prefix/`` (recursively): key relative to it -> size,
        identity and age in seconds. Nothing is cached between calls."""

        def ls() -> dict[str, dict[str, Any]]:
            with contextlib.suppress(AttributeError):
                self.fs.invalidate_cache(prefix)
            try:
                found = self.fs.find(prefix, detail=True)
            except FileNotFoundError:
                return {}
            out = {}
            now = time.time()
            for path, info in found.items():
                rel = path[len(prefix) :].lstrip("/") if path.startswith(prefix) else None
                if rel and info.get("type", "file") == "file":
                    out[rel] = {
                        "size": int(info["size"]),
                        "etag": _etag(info),
                        "age": now - _mtime(info, now),
                    }
            return out

        return self.call("listing", prefix, ls)

    def abort_stale_uploads(self, prefix: str, limit: float) -> list[str]:
        """S3 keeps the parts of an upload that never completed (and bills them) until
        aborted: abort those under ``prefix/`` older than ``limit`` seconds. Returns
        their keys.

        An upload is as old as its newest part, not only as its start: some stores
        (moto) report every upload as started years ago, and aborting another job's
        upload in flight turns a clear conflict at its commit into a failed part."""
        if not self.is_s3:
            return []
        fs = self.fs
        bucket, key, _ = fs.split_path(prefix)
        try:
            answer = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key + "/")
        except Exception:  # a store without the listing: the bucket's lifecycle rule cleans
            return []
        aborted = []
        for up in answer.get("Uploads", []):
            if _age(up.get("Initiated")) >= limit and self._parts_age(bucket, up) >= limit:
                with contextlib.suppress(Exception):
                    fs.call_s3(
                        "abort_multipart_upload",
                        Bucket=bucket,
                        Key=up["Key"],
                        UploadId=up["UploadId"],
                    )
                    aborted.append(up["Key"])
        return aborted

    def _parts_age(self, bucket: str, upload: dict[str, Any]) -> float:
        """Seconds since the newest part of ``upload`` (an entry of a multipart-upload
        listing) arrived; infinite without parts, 0 if they cannot be listed."""
        try:
            parts = self.fs.call_s3(
                "list_parts", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            ).get("Parts", [])
        except FileNotFoundError:
            return float("inf")  # aborted or completed meanwhile: nothing to spare
        except Exception:
            return 0.0  # unknown: treated as new, so never aborted early
        return min((_age(p.get("LastModified")) for p in parts), default=float("inf"))

    # -- parts ----------------------------------------------------------------------

    def read_into(self, key: str, offset: int, buf: memoryview) -> int:
        """Fill ``buf`` from bytes ``offset..`` of the object, in parallel ranged reads of
        one part each; returns the bytes read (fewer: the object ends first)."""
        return store_io.read_ranges(self, key, offset, buf)

    def upload(self, key: str, segments: list[memoryview]) -> None:
        """Write ``segments`` one after another as the object ``key``: parts in parallel
        (S3 multipart), straight from the segments' memory; nothing appears under
        ``key`` unless every part arrived."""
        store_io.upload(self, key, segments)


def _etag(info: dict[str, Any]) -> str:
    for field in ("ETag", "etag", "md5", "LastModified", "created", "mtime"):
        if info.get(field) is not None:
            return str(info[field])
    return str(info.get("size"))


def _age(when: Any) -> float:
    """Seconds since the datetime ``when``; 0 (new) if it is not one."""
    return time.time() - when.timestamp() if hasattr(when, "timestamp") else 0.0


def _mtime(info: dict[str, Any], now: float) -> float:
    for field in ("LastModified", "last_modified", "created", "mtime"):
        value = info.get(field)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        with contextlib.suppress(TypeError, ValueError):
            return float(value)
    return now  # unknown age: treated as new, so never cleaned up early
