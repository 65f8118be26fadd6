"""The docs pages the benchmarks write, and which part of them each script owns.

docs/benchmarks.md is written by several scripts: ``save_restore.py --write-docs``
rewrites everything above the ``OTHERS`` marker line and keeps everything below it
(:class:`Top`); each other script owns one section below the marker, between
``<!-- NAME:start -->`` and ``<!-- NAME:end -->``, and replaces only that
(:class:`Section`). ``health_check.py`` owns all of docs/health-check.md (:class:`Page`).
``report.Report`` puts a script's markdown into its part.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
# Why targets are missed, by hand: one heading per topic, spliced into DOCS by
# save_restore.py; every script's report names the heading that explains a miss.
ANALYSIS = Path(__file__).with_name("analysis.md")
OTHERS = "<!-- Sections below belong to other benchmarks"
OTHERS_LINE = (
    f"{OTHERS} (object_store.py, async_overhead.py, peers.py); "
    "save_restore.py --write-docs keeps them. -->"
)


class DocsPart(Protocol):
    """The part of a docs page one script owns."""

    @property
    def path(self) -> Path:
        """The page it is in, unless the script is told another one."""

    def put(self, markdown: str, page: Path) -> None:
        """Replace this part of ``page`` with ``markdown``, keeping the rest."""

    def describe(self, page: Path) -> str:
        """This part of ``page``, in words."""


@dataclasses.dataclass(frozen=True)
class Top:
    """Everything above the ``OTHERS`` marker line (save_restore.py)."""

    path: Path = DOCS

    def put(self, markdown: str, page: Path) -> None:
        page.write_text(markdown.rstrip("\n") + "\n\n" + below_marker(page))

    def describe(self, page: Path) -> str:
        return f"{page} (above the other benchmarks' sections)"


@dataclasses.dataclass(frozen=True)
class Section:
    """One section below the ``OTHERS`` marker line, between its own markers."""

    name: str
    path: Path = DOCS

    def put(self, markdown: str, page: Path) -> None:
        replace_section(self.name, markdown, page)

    def describe(self, page: Path) -> str:
        return f"the {self.name} section of {page}"


@dataclasses.dataclass(frozen=True)
class Page:
    """A whole page."""

    path: Path

    def put(self, markdown: str, page: Path) -> None:
        page.write_text(markdown, encoding="utf-8")

    def describe(self, page: Path) -> str:
        return str(page)


# Who owns what.
SAVE_RESTORE = Top()
OBJECT_STORE = Section("object-store")
ASYNC = Section("async")
PEERS = Section("peers")
HEALTH = Page(ROOT / "docs" / "health-check.md")


def below_marker(path: Path = DOCS) -> str:
    """The part of ``path`` the other scripts own (from the marker on), as it is."""
    text = path.read_text() if path.exists() else ""
    return text[text.index(OTHERS) :] if OTHERS in text else ""


def replace_section(name: str, section: str, path: Path = DOCS) -> None:
    """Put ``section`` between its markers in ``path``: in place of the old one, else
    at the end (below the marker line, added if missing)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{section.strip()}\n{end}"
    text = path.read_text() if path.exists() else ""
    if OTHERS in text:  # the marker line names every script that owns a part
        i = text.index(OTHERS)
        text = (
            text[:i] + OTHERS_LINE + text[text.index("\n", i) if "\n" in text[i:] else len(text) :]
        )
    else:
        text = text.rstrip("\n") + "\n\n" + OTHERS_LINE + "\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def analysis_headings(path: Path = ANALYSIS) -> set[str]:
    """The headings of the hand-written analysis (without their ``#``), or none."""
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    return {line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")}


def why_missed(topic: str, headings: set[str]) -> str:
    """Where the analysis explains ``topic``, or that it does not yet."""
    if topic in headings:
        return f"Why: *{topic}* in the analysis (benchmarks/analysis.md)."
    return "Why: not analysed yet."
