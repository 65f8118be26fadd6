"""Names made safe to show on a terminal: the one place the commands' human output goes
through (``--json`` is left exact: JSON escapes control characters itself).

A checkpoint's names (tensor keys, parameter FQNs, model names, state keys) are whatever
the training script used, and a checkpoint may come from anyone: printed raw, an escape
sequence in one (``"\\x1b[2J"`` clears the screen, ``"\\x1b]0;..."`` retitles the
window, ``"\\r"`` overwrites the line) acts on the reader's terminal. Every control
character, and the invisible reordering ones of bidirectional text, is shown as its
Python escape (``\\x1b``, ``\\u202e``) instead: the name stays recognizable and acts
on nothing.
"""

from __future__ import annotations

import re
from typing import Any

from rich.console import Console
from rich.markup import escape

# C0 and C1 controls and DEL, the bidirectional embeddings, overrides and isolates, and
# the line and paragraph separators.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029]")
_UNSAFE_BUT_LINES = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u2028\u2029]"
)


def _escaped(match: re.Match[str]) -> str:
    c = ord(match.group(0))
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def safe(text: object, *, lines: bool = False) -> str:
    """``text`` with every control character escaped (``"\\x1b[2J"`` -> ``\\x1b[2J``).

    ``lines``: keep newlines and tabs (a message of several lines); a name keeps none.
    """
    return (_UNSAFE_BUT_LINES if lines else _UNSAFE).sub(_escaped, str(text))


def shown(name: object) -> str:
    """A name for rich markup: control characters escaped, then markup (``[red]``)."""
    return escape(safe(name))


class SafeConsole(Console):
    """A rich console that never writes a control character it was given as text.

    Every string printed, table cell, title and caption goes through
    :meth:`render_str`, which escapes control characters (newlines and tabs kept) before
    rich parses markup: what rich itself adds (colours) is untouched.
    """

    def render_str(self, text: str, *args: Any, **kwargs: Any) -> Any:
        return super().render_str(safe(text, lines=True), *args, **kwargs)
