"""How the offline tools report: result dataclasses with one JSON form, and progress.

Every result the public tool functions return (``ub.inspect_checkpoint`` and the rest,
see docs/api.md) is a dataclass deriving from :class:`JsonResult`. Its
:meth:`~JsonResult.to_dict` is exactly what the matching command prints with ``--json``:
the computed verdicts the class names in ``JSON_PROPERTIES`` (``ok``, ``identical``)
first, then every field, recursively. JSON has no NaN and no paths: non-finite floats
become strings (``"nan"``), anything else that is not JSON its ``str()``.

Long operations take ``progress(done, total)``; :class:`ProgressCount` turns the counts
the readers report (bytes, tensors) into those calls.

Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar

Progress = Callable[[int, int], None]
"""``progress(done, total)``: called as a long operation advances (units: its docstring)."""


def jsonable(obj: Any) -> Any:
    """``obj`` as JSON-safe values: results by :meth:`JsonResult.to_dict`, other
    dataclasses by their fields, containers item by item, NaN and infinities as
    ``"nan"``, ``"inf"``, ``"-inf"``, anything else not JSON as its ``str()``."""
    if isinstance(obj, JsonResult):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    return str(obj)


class JsonResult:
    """Base of the tools' result dataclasses: :meth:`to_dict` is their ``--json``."""

    JSON_PROPERTIES: ClassVar[tuple[str, ...]] = ()
    """Computed attributes (properties) serialized before the fields."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (plain dicts, lists, strings, numbers, booleans, None): what the
        command prints with ``--json``."""
        out = {name: jsonable(getattr(self, name)) for name in self.JSON_PROPERTIES}
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            out[field.name] = jsonable(getattr(self, field.name))
        return out


class ProgressCount:
    """Adds up what a reader reports and calls ``progress(done, total)`` (once at the
    start with ``done = 0``, so that a bar knows its total).

    Example::

        count = ProgressCount(progress, total=sum(sizes))
        reader = TensorReader(folder, doc, on_bytes=count)
    """

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0
        if progress is not None:
            progress(0, total)

    def __call__(self, n: int = 1) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)
