"""docs/benchmarks.md is written by several scripts: each owns its part.

``save_restore.py --write-docs`` rewrites everything above the ``OTHERS`` marker line and
keeps everything below it; each other script owns one section below the marker, between
``<!-- NAME:start -->`` and ``<!-- NAME:end -->``, and replaces only that.
"""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
# Why targets are missed, by hand: one heading per topic, spliced into DOCS by
# save_restore.py; every script's report names the heading that explains a miss.
ANALYSIS = Path(__file__).with_name("analysis.md")
OTHERS = "<!-- Sections below belong to other benchmarks"
OTHERS_LINE = (
    f"{OTHERS} (object_store.py, async_overhead.py, peers.py); "
    "save_restore.py --write-docs keeps them. -->"
)


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
