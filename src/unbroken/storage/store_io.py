"""Bulk bytes on object stores: uploads in parallel parts straight from tensor memory,
and ranged reads in parallel straight into the restore's target tensors.

An upload is an S3 multipart upload: parts of ``UNBROKEN_STORE_PART_MB`` (larger when
an object would need more than 9,000 parts), ``UNBROKEN_STORE_CONCURRENCY`` in flight.
A part that lies inside one tensor is sent from the tensor's own memory; one that spans
tensors is joined into a buffer of one part, so the extra memory is at most one part per
request in flight, never a second copy of the state. Each part is retried on its own;
a failure that outlasts the retries aborts the upload, so nothing is left under the key.
Other fsspec back-ends get a buffered streaming write of the same segments.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from ..env import env_number
from ..errors import CheckpointError

logger = logging.getLogger(__name__)
PART_ENV = "UNBROKEN_STORE_PART_MB"
CONCURRENCY_ENV = "UNBROKEN_STORE_CONCURRENCY"
_MAX_PARTS = 9000  # S3 allows 10,000


class StoreClient(Protocol):
    """What the bulk transfers need of a ``store.Store`` (which calls them: this module
    never imports it)."""

    fs: Any

    @property
    def is_s3(self) -> bool: ...

    def call(self, doing: str, key: str, fn: Any, fix: str = "") -> Any: ...

    def put(self, key: str, data: bytes, *, create: bool = False) -> None: ...

    def url(self, key: str) -> str: ...


def part_size() -> int:
    """Bytes per upload part and per ranged read (``UNBROKEN_STORE_PART_MB``, default 32)."""
    return int(env_number(PART_ENV, 32, 5) * (1 << 20))  # S3 parts are >= 5 MiB


def concurrency() -> int:
    """Requests in flight per rank (``UNBROKEN_STORE_CONCURRENCY``, default 8)."""
    return int(env_number(CONCURRENCY_ENV, 8, 1))


class _View(io.RawIOBase):
    """A read-only, seekable file over a memoryview: the HTTP client takes file objects
    (not memoryviews) and reads them in small blocks, so the part is never copied whole,
    and seeks back to the start when it resends."""

    def __init__(self, data: memoryview) -> None:
        super().__init__()
        self._data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._data)}[whence]
        self._pos = min(max(0, base + offset), len(self._data))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self._data) - self._pos)
        buffer[:n] = self._data[self._pos : self._pos + n]
        self._pos += n
        return n

    def __len__(self) -> int:
        return len(self._data)


def _bytes(view: memoryview) -> memoryview:
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _parts(segments: list[memoryview], size: int) -> Iterator[memoryview]:
    """The concatenation of ``segments`` cut into parts of ``size`` bytes (the last may
    be shorter): a slice of a segment where a part lies inside one, else a joined copy
    of that one part."""
    pending: list[memoryview] = []
    held = 0
    for seg in map(_bytes, segments):
        pos = 0
        while pos < len(seg):
            take = min(size - held, len(seg) - pos)
            pending.append(seg[pos : pos + take])
            held += take
            pos += take
            if held == size:
                yield pending[0] if len(pending) == 1 else memoryview(b"".join(pending))
                pending, held = [], 0
    if held:
        yield pending[0] if len(pending) == 1 else memoryview(b"".join(pending))


def upload(store: StoreClient, key: str, segments: list[memoryview]) -> None:
    total = sum(len(_bytes(s)) for s in segments)
    size = max(part_size(), -(-total // _MAX_PARTS))
    if total <= size:
        data = b"".join(_bytes(s) for s in segments)  # at most one part
        store.put(key, data)
    elif store.is_s3:
        _multipart(store, key, segments, size)
    else:
        store.call("writing", key, lambda: _stream(store, key, segments, size))


def _stream(store: StoreClient, key: str, segments: list[memoryview], size: int) -> None:
    f = store.fs.open(key, "wb", block_size=size)
    try:
        for seg in segments:
            f.write(_bytes(seg))
    except BaseException:
        with contextlib.suppress(Exception):
            if hasattr(f, "discard"):
                f.discard()
            else:
                f.close()
                store.fs.rm_file(key)
        raise
    f.close()


def _multipart(store: StoreClient, key: str, segments: list[memoryview], size: int) -> None:
    fs = store.fs
    bucket, name, _ = fs.split_path(key)
    started = store.call(
        "starting the upload of",
        key,
        lambda: fs.call_s3("create_multipart_upload", Bucket=bucket, Key=name),
    )
    upload_id = started["UploadId"]

    def send(number: int, body: memoryview) -> dict[str, Any]:
        def once() -> dict[str, Any]:
            return _s3_once(
                fs,
                "upload_part",
                Bucket=bucket,
                Key=name,
                UploadId=upload_id,
                PartNumber=number,
                Body=_View(body),
            )

        out = store.call(f"uploading part {number} of", key, once)
        return {"PartNumber": number, "ETag": out["ETag"]}

    done: list[dict[str, Any]] = []
    try:
        with ThreadPoolExecutor(concurrency(), thread_name_prefix="unbroken-upload") as pool:
            running: set[Future] = set()
            for number, body in enumerate(_parts(segments, size), start=1):
                if len(running) >= concurrency():  # bounded memory: parts in flight
                    finished, running = wait(running, return_when=FIRST_COMPLETED)
                    done.extend(f.result() for f in finished)
                running.add(pool.submit(send, number, body))
            done.extend(f.result() for f in wait(running).done)
        parts = sorted(done, key=lambda p: p["PartNumber"])

        def complete() -> Any:
            return fs.call_s3(
                "complete_multipart_upload",
                Bucket=bucket,
                Key=name,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},
            )

        store.call("completing the upload of", key, complete)
    except BaseException as exc:
        gone = isinstance(exc, Exception) and _aborted(fs, bucket, name, upload_id)
        with contextlib.suppress(Exception):
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=name, UploadId=upload_id)
        if gone:
            raise UploadAborted(_aborted_text(store.url(key))) from exc
        raise
    with contextlib.suppress(AttributeError):
        fs.invalidate_cache(key)


class UploadAborted(CheckpointError):
    """A multipart upload was aborted by someone else while it was sent (S3 answers its
    parts 404 NoSuchUpload; moto 500): another job saving into or cleaning up the same
    prefix, or a bucket rule aborting young uploads. It names the conflict, never a
    failing store."""


def _aborted_text(url: str) -> str:
    return (
        f"the upload of {url} was aborted by another process while this save sent it: "
        "another job is saving into (or cleaning up) the same checkpoint prefix, or a "
        "lifecycle rule of the bucket aborts uploads this young; two jobs must not share "
        "a checkpoint prefix. Stop the other job or use another path, then save again; "
        "nothing committed was changed"
    )


def _aborted(fs: Any, bucket: str, name: str, upload_id: str) -> bool:
    """Whether the multipart upload ``upload_id`` is gone (aborted by another process);
    False if that cannot be told."""
    try:
        fs.call_s3("list_parts", Bucket=bucket, Key=name, UploadId=upload_id, MaxParts=1)
    except FileNotFoundError:
        return True
    except Exception as exc:  # a ClientError not translated: its code tells
        return "NoSuchUpload" in str(exc)
    return False


def _s3_once(fs: Any, method: str, **kwargs: Any) -> Any:
    """One S3 request with no retry inside the client library: s3fs's own retries would
    resend a body stream already read to its end (an empty or hanging request), so every
    attempt (``Store.call``) must bring a fresh body."""
    from botocore.exceptions import ClientError
    from fsspec.asyn import sync
    from s3fs.errors import translate_boto_error

    async def once() -> Any:
        await fs.set_session()
        client = await fs.get_s3(kwargs.get("Bucket"))
        call = getattr(client, method)
        # The file system's request options (encryption, requester pays) apply too.
        extra = getattr(fs, "_get_s3_method_kwargs", lambda c, **kw: kw)(call, **kwargs)
        try:
            return await call(**extra)
        except ClientError as exc:
            raise translate_boto_error(exc) from exc

    return sync(fs.loop, once)


def cat_range(fs: Any, key: str, start: int, end: int) -> bytes:
    """Bytes ``start..end`` of the object (fewer: it ends first; none: it ends before
    ``start``, where S3 answers that the range is not satisfiable)."""
    try:
        return bytes(fs.cat_file(key, start=start, end=end))
    except (FileNotFoundError, PermissionError):
        raise
    except OSError as exc:
        if "range" not in str(exc).lower():
            raise
        return b""


def read_ranges(store: StoreClient, key: str, offset: int, buf: memoryview) -> int:
    buf = _bytes(buf)
    size = part_size()
    starts = list(range(0, len(buf), size))

    def one(start: int) -> int:
        end = min(start + size, len(buf))
        data = store.call(
            "reading", key, lambda: cat_range(store.fs, key, offset + start, offset + end)
        )
        buf[start : start + len(data)] = data
        return len(data)

    if len(starts) <= 1:
        return one(0) if starts else 0
    with ThreadPoolExecutor(
        min(concurrency(), len(starts)), thread_name_prefix="unbroken-read"
    ) as pool:
        got = list(pool.map(one, starts))
    total = 0
    for start, n in zip(starts, got, strict=True):
        total = start + n
        if n < min(size, len(buf) - start):
            break
    return total
