"""How every benchmark shows its figures: one table renderer, the cells it is given, and
one report path.

Every script prints its report through :class:`Report`: the plain text to stdout, its
markdown to stdout as well with ``--markdown``, and with ``--write-docs [PATH]`` into the
part of a docs page it owns (``docs_sections``: above the marker of docs/benchmarks.md,
one section below it, or all of docs/health-check.md). Every table is :func:`table`.

    parser = argparse.ArgumentParser()
    Report.add_options(parser, ASYNC)
    args = parser.parse_args()
    out = Report.from_args(args, ASYNC)
    ...
    out.publish(text, lambda: markdown_of(text))  # markdown rendered only when wanted
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from docs_sections import DocsPart


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A markdown table, every column padded to its widest cell (readable as plain text)."""
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
        for r in rows
    ]
    return "\n".join([line, sep, *body])


# Cells ---------------------------------------------------------------------------------


def median_span(times: list[float], digits: int = 3) -> tuple[str, str]:
    """The median of ``times`` and their ``min-max``, to ``digits`` decimals."""
    lo, hi = min(times), max(times)
    return f"{statistics.median(times):.{digits}f}", f"{lo:.{digits}f}-{hi:.{digits}f}"


def factor(value: float | None, suffix: str = "x") -> str:
    """``1.23x``, or ``-`` where there is nothing to show."""
    return "-" if value is None else f"{value:.2f}{suffix}"


def ratio(value: float | None, ref: float | None) -> str:
    """``value / ref`` as a factor, or ``-`` where either is missing (or ``ref`` is 0)."""
    return factor(value / ref) if value is not None and ref else "-"


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


# The report path -----------------------------------------------------------------------


class Report:
    """Where one run's report goes: always stdout; its markdown also to stdout
    (``markdown``) and into ``part`` of the page at ``write_docs``.

    Args:
        part: the part of a docs page this script owns (None: it prints only).
        markdown: also print the markdown.
        write_docs: the page to put the markdown into (None: no page is written).

    Raises:
        ValueError: ``write_docs`` without a ``part`` to put there.
    """

    def __init__(
        self,
        part: DocsPart | None = None,
        *,
        markdown: bool = False,
        write_docs: Path | None = None,
    ) -> None:
        if write_docs is not None and part is None:
            raise ValueError(f"write_docs needs the part of the page to write, got {part}")
        self.part = part
        self.markdown = markdown
        self.write_docs = write_docs

    @staticmethod
    def add_options(
        parser: argparse.ArgumentParser, part: DocsPart, *, markdown: bool = True
    ) -> None:
        """``--write-docs [PATH]`` and, where the printed report is not the markdown
        itself, ``--markdown``."""
        if markdown:
            parser.add_argument("--markdown", action="store_true",
                                help="also print the markdown")  # fmt: skip
        parser.add_argument("--write-docs", nargs="?", const=str(part.path), default=None,
                            metavar="PATH",
                            help=f"put the markdown in {part.describe(part.path)} (or in "
                            "PATH)")  # fmt: skip

    @classmethod
    def from_args(cls, args: argparse.Namespace, part: DocsPart) -> Report:
        docs = Path(args.write_docs) if args.write_docs else None
        return cls(part, markdown=getattr(args, "markdown", False), write_docs=docs)

    @property
    def wants_markdown(self) -> bool:
        return self.markdown or self.write_docs is not None

    def publish(self, text: str, markdown: Callable[[], str] | None = None) -> None:
        """Print ``text``; render ``markdown`` if it is wanted, print it and/or put it in
        this script's part of the page, saying where."""
        print("\n" + text)
        if markdown is None or not self.wants_markdown:
            return
        md = markdown()
        if self.markdown:
            print("\n" + md)
        if self.write_docs is not None and self.part is not None:
            self.part.put(md, self.write_docs)
            print(f"\nwrote {self.part.describe(self.write_docs)}")
