"""The figures of a ``save_restore.py`` run: one row per measured path and size, the
2-rank FSDP2 cases, and their JSON (``--results`` writes it, ``--render`` reads it)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from common import Measurement

# The single-process row each 2-rank FSDP2 case is compared with.
FSDP_PEERS = {
    "ours save": "ours_save",
    "ours restore, fresh objects": "ours_restore_fresh",
    "ours restore, existing objects": "ours_restore",
    "raw DCP save (thread_count=1)": "dcp_save_1",
    "raw DCP load, existing objects": "dcp_load",
    "cold read into new tensors": "floor_read_new",
}
FSDP_FLOOR = "cold read into new tensors"  # each rank's shard files, read into new memory
OURS_FSDP = ["ours save", "ours restore, fresh objects", "ours restore, existing objects"]


@dataclasses.dataclass
class Row:
    """One measured path: its label and measurement, or why there is none."""

    label: str
    m: Measurement | None
    error: str | None = None
    na: bool = False  # not applicable (a feature not available), not a failure


@dataclasses.dataclass
class SizeResult:
    mb: float
    nbytes: int
    ntensors: int
    repeats: int
    rows: dict[str, Row]
    notes: list[str]
    fsdp: dict[str, Any] | None  # fsdp_worker.py's JSON, or {"error": ...}, or None
    load: dict[str, float]  # phase -> cores other processes kept busy meanwhile

    def median(self, key: str) -> float | None:
        """The median seconds of row ``key``, or None where it was not measured."""
        row = self.rows.get(key)
        return row.m.median if row is not None and row.m is not None else None

    def times(self, key: str) -> list[float] | None:
        row = self.rows.get(key)
        return row.m.times if row is not None and row.m is not None else None

    def over(self, key: str, ref: str) -> float | None:
        """Row ``key``'s median over row ``ref``'s."""
        a, b = self.median(key), self.median(ref)
        return a / b if a is not None and b else None

    def over_min(self, key: str, ref: str) -> float | None:
        """Row ``key``'s fastest run over row ``ref``'s."""
        a, b = self.rows.get(key), self.rows.get(ref)
        if a is None or b is None or a.m is None or b.m is None or not b.m.low:
            return None
        return a.m.low / b.m.low


def fsdp_times(f: dict[str, Any], name: str) -> list[float] | None:
    """The seconds of the 2-rank case ``name``, or None where it failed."""
    case = f.get("cases", {}).get(name)
    return case["times"] if case is not None and case["error"] is None else None


def fsdp_median(f: dict[str, Any], name: str) -> float | None:
    times = fsdp_times(f, name)
    return statistics.median(times) if times else None


def save_results(
    path: Path, results: list[SizeResult], info: dict[str, str], elapsed: float, command: str
) -> None:
    """Write a run's figures, so that ``load_results`` can render them again."""
    body = {
        "info": info,
        "elapsed": elapsed,
        "command": command,
        "results": [dataclasses.asdict(r) for r in results],
    }
    path.write_text(json.dumps(body, indent=1))


def load_results(path: Path) -> tuple[list[SizeResult], dict[str, str], float, str]:
    """What ``save_results`` wrote: (results, machine, seconds, command)."""
    body = json.loads(path.read_text())
    results = []
    for r in body["results"]:
        rows = {
            key: Row(
                row["label"],
                Measurement(**row["m"]) if row["m"] is not None else None,
                row["error"],
                row["na"],
            )
            for key, row in r.pop("rows").items()
        }
        results.append(SizeResult(rows=rows, **r))
    return results, body["info"], body["elapsed"], body["command"]
