"""How every benchmark shows its figures: one table renderer, the cells it is given, the
docs pages and the part of them each report owns, and one way to publish.

Every report goes through :func:`publish`: the plain text to stdout, its markdown to
stdout as well with ``--markdown``, and with ``--write-docs [PATH]`` into the part of a
page it owns (a :class:`DocsPart`). docs/benchmarks.md is shared: the save/restore
suite's one-process report owns everything above the ``OTHERS`` marker line
(:class:`Top`); every other report on it owns one section below the marker, between
``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` (:class:`Section`). Other pages are
owned whole (:class:`Page`). Prose is written by hand in the pages (:func:`kept`).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Protocol

from common import ROOT

DOCS = ROOT / "docs" / "benchmarks.md"
OTHERS = "<!-- Sections below belong to other benchmarks"
OTHERS_LINE = (
    f"{OTHERS} (save_restore.py's parts store, async and peers); its part single keeps them. -->"
)


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table, every column padded to its widest cell (readable as plain text)."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Iterable[object]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


# Cells ---------------------------------------------------------------------------------


def median_span(times: list[float], digits: int = 3) -> tuple[str, str]:
    """The median of ``times`` and their ``min-max``, to ``digits`` decimals."""
    lo, hi = min(times), max(times)
    return f"{statistics.median(times):.{digits}f}", f"{lo:.{digits}f}-{hi:.{digits}f}"


def median(times: list[float] | None) -> float | None:
    return statistics.median(times) if times else None


def runs(figures: Mapping[str, list | str], key: str) -> list:
    """The runs of figure ``key``: its list, or [] where it holds why there is none."""
    v = figures.get(key)
    return v if isinstance(v, list) else []


def factor(value: float | None, suffix: str = "x") -> str:
    """``1.23x``, or ``-`` where there is nothing to show."""
    return "-" if value is None else f"{value:.2f}{suffix}"


def over(value: float | None, ref: float | None) -> float | None:
    """``value / ref``, or None where either is missing (or ``ref`` is 0)."""
    return value / ref if value is not None and ref else None


def ratio(value: float | None, ref: float | None) -> str:
    """``value / ref`` as a factor, or ``-``."""
    return factor(over(value, ref))


def size_text(n: int) -> str:
    """A state's size: GB from 0.1 GB on, else MB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def bullets(info: Mapping[str, str]) -> list[str]:
    """``- key: value`` lines (the machine of a report)."""
    return [f"- {k}: {v}" for k, v in info.items()]


def inline(info: Mapping[str, str]) -> str:
    """``key value; key value`` on one line."""
    return "; ".join(f"{k} {v}" for k, v in info.items())


def shown_command(script: str, argv: Iterable[str]) -> str:
    """The command line as a page shows it: ``--results`` (``--results PATH`` or
    ``--results=PATH``) only says where the figures went, so it is left out."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--results":
            skip = True
        elif not a.startswith("--results="):
            out.append(a)
    return " ".join([f"python benchmarks/{script}", *out])


# Hand-written prose in the pages: the analysis, the method, the notes ----------------------


def kept(name: str, page: Path = DOCS) -> str:
    """The hand-written block ``name`` of the committed ``page``, its two marker lines
    included ("" where there is none), for a report to put back as it is: prose is
    edited in the page, and rendering the figures again leaves it alone."""
    start, end = f"<!-- hand-written {name}:start -->", f"<!-- hand-written {name}:end -->"
    text = page.read_text(encoding="utf-8") if page.is_file() else ""
    if start not in text or end not in text:
        return ""
    return start + text.split(start, 1)[1].split(end, 1)[0] + end


def why_missed(topic: str) -> str:
    """Where the analysis (the block ``analysis`` of DOCS, one heading per topic)
    explains ``topic``, or that it does not yet."""
    headings = {x.lstrip("#").strip() for x in kept("analysis").splitlines() if x[:1] == "#"}
    if topic in headings:
        return f"Why: *{topic}* in the analysis (docs/benchmarks.md)."
    return "Why: not analysed yet."


# Pages and the parts of them each report owns -------------------------------------------


class DocsPart(Protocol):
    """The part of a docs page one report owns."""

    @property
    def path(self) -> Path:
        """The page it is in, unless the script is told another one."""

    def put(self, markdown: str, page: Path) -> None:
        """Replace this part of ``page`` with ``markdown``, keeping the rest."""

    def describe(self, page: Path) -> str:
        """This part of ``page``, in words."""


@dataclasses.dataclass(frozen=True)
class Top:
    """Everything above the ``OTHERS`` marker line."""

    path: Path = DOCS

    def put(self, markdown: str, page: Path) -> None:
        text = page.read_text() if page.exists() else ""
        below = text[text.index(OTHERS) :] if OTHERS in text else ""
        page.write_text(markdown.rstrip("\n") + "\n\n" + below)

    def describe(self, page: Path) -> str:
        return f"{page} (above the other benchmarks' sections)"


@dataclasses.dataclass(frozen=True)
class Section:
    """One section below the ``OTHERS`` marker line, between its own markers: in place of
    the old one, else at the end (below the marker line, added if missing)."""

    name: str
    path: Path = DOCS

    def put(self, markdown: str, page: Path) -> None:
        text = page.read_text() if page.exists() else ""
        if OTHERS in text:  # the marker line names every script that owns a part
            i = text.index(OTHERS)
            nl = text.find("\n", i)
            text = text[:i] + OTHERS_LINE + (text[nl:] if nl >= 0 else "")
        else:
            text = text.rstrip("\n") + "\n\n" + OTHERS_LINE + "\n"
        page.write_text(with_block(text, self.name, markdown))

    def describe(self, page: Path) -> str:
        return f"the {self.name} section of {page}"


def with_block(text: str, name: str, markdown: str) -> str:
    """``text`` with the block between ``name``'s markers replaced by ``markdown``, or the
    block added at the end where there is none."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{markdown.strip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        return head + block + rest.split(end, 1)[1]
    return text.rstrip("\n") + "\n\n" + block + "\n"


@dataclasses.dataclass(frozen=True)
class Page:
    """A whole page."""

    path: Path

    def put(self, markdown: str, page: Path) -> None:
        page.write_text(markdown, encoding="utf-8")

    def describe(self, page: Path) -> str:
        return str(page)


@dataclasses.dataclass(frozen=True)
class PageSection:
    """The generated section of a page of its own, between ``<!-- NAME:start -->`` and
    ``<!-- NAME:end -->`` (in place of the old one, else at the end), the rest of the
    page (hand-written) kept as it is; a missing page starts with ``title``."""

    name: str
    path: Path
    title: str

    def put(self, markdown: str, page: Path) -> None:
        text = page.read_text() if page.exists() else self.title + "\n"
        page.write_text(with_block(text, self.name, markdown))

    def describe(self, page: Path) -> str:
        return f"the {self.name} section of {page}"


HEALTH = Page(ROOT / "docs" / "health-check.md")


def add_options(parser: argparse.ArgumentParser, part: DocsPart) -> None:
    """``--markdown`` (also print it) and ``--write-docs [PATH]`` (put it in ``part`` of
    its page, or of PATH)."""
    parser.add_argument("--markdown", action="store_true", help="also print the markdown")
    parser.add_argument(
        "--write-docs",
        nargs="?",
        const=str(part.path),
        metavar="PATH",
        help=f"put the markdown in {part.describe(part.path)} (or in PATH)",
    )


def publish(
    text: str,
    markdown: Callable[[], str],
    part: DocsPart,
    *,
    show: bool = False,
    page: Path | None = None,
) -> None:
    """Print ``text``; where the markdown is wanted, render it: print it (``show``) and
    put it in ``part`` of ``page``, saying so."""
    print("\n" + text)
    md = markdown() if show or page is not None else ""
    if show:
        print("\n" + md)
    if page is not None:
        part.put(md, page)
        print(f"\nwrote {part.describe(page)}")


@dataclasses.dataclass
class Target:
    """A target a run is judged against: ``value`` (None: not measured) within ``limit``."""

    name: str
    value: float | None
    limit: float
    shown: str  # the measured value as read by a person
    wanted: str
    higher_is_better: bool = False
    why_none: str = "not measured"
    topic: str = ""  # the heading of the analysis that says why it is missed
    evidence: str = ""  # the two measurements behind the ratio, with their spreads

    def status(self) -> str:
        if self.value is None:
            return f"n/a ({self.why_none})"
        if self.higher_is_better:
            return (
                "met"
                if self.value >= self.limit
                else f"missed by {self.limit / self.value - 1:.0%}"
            )
        return "met" if self.value <= self.limit else f"missed by {self.value / self.limit - 1:.0%}"
