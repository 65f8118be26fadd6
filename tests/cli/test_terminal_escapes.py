"""Names holding terminal escape sequences are shown escaped by every command's human
output, and exact in ``--json``.

A checkpoint's names come from the training script (model names, parameter FQNs, state
keys), and a checkpoint may come from anyone: printed raw, ``"\\x1b[2J"`` clears the
reader's screen and an unterminated ``"\\x1b]0;pwned"`` retitles the window and swallows
what follows."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import unbroken as ub

from .conftest import run_cli

CLEAR = "\x1b[2J"  # clear screen
TITLE = "\x1b]0;pwned"  # an OSC window title, never terminated
MODEL = f"enc{CLEAR}"  # a model's name in a dict of models: it leads its FQNs
KEY = f"w{TITLE}"  # a tensor in an extra component's state
NOTE = f"n{CLEAR}{TITLE}"  # a non-tensor entry of that state
TIED = f"tied{TITLE}"  # a second name of a module: export and inspect name the alias


class _State:
    def __init__(self, value: float) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {KEY: torch.full((2,), self.value), NOTE: self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state[NOTE]


def _save(root, value: float) -> None:
    torch.manual_seed(0)
    dec = nn.Module()
    dec.add_module("lin", nn.Linear(2, 1))
    dec.add_module(TIED, dec.lin)  # one module under two names: tied tensors
    models = {MODEL: nn.Linear(2, 2), "dec": dec}
    with torch.no_grad():
        models[MODEL].bias.fill_(value)
    params = [p for m in models.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    ck = ub.Checkpointer(root, model=models, optimizer=opt, extra={"x": _State(value)})
    ck.save(1)
    ck.close()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("escapes")
    _save(base / "a", 1.0)
    _save(base / "b", 2.0)
    return base / "a", base / "b"


def _assert_safe(text: str, *names: str) -> None:
    assert "\x1b" not in text and "\x9b" not in text, text
    for name in names:  # still recognizable, its escape spelled out
        assert name.replace("\x1b", "\\x1b") in text, (name, text)


def test_inspect_step_shows_names_escaped(runs):
    """Failure guarded: ``inspect --step`` printed tensor keys and parameter FQNs raw,
    escape sequences and all (the tensor table and the optimizer coverage)."""
    result = run_cli("inspect", runs[0], "--step", 1)
    assert result.exit_code == 0, result.stderr
    _assert_safe(result.stdout, f"model/{MODEL}/weight", f"x/{KEY}", f"{MODEL}.weight")
    _assert_safe(result.stderr)


def test_inspect_json_keeps_names_exact(runs):
    """Guarantee: ``--json`` holds the names exactly (JSON escapes control characters
    itself: the bytes on stdout carry no raw escape either)."""
    result = run_cli("inspect", runs[0], "--step", 1, "--json")
    assert result.exit_code == 0, result.stderr
    assert "\x1b" not in result.stdout
    info = json.loads(result.stdout)
    keys = {t["key"] for t in info["tensors"]}
    assert {f"model/{MODEL}/weight", f"x/{KEY}"} <= keys
    assert f"{MODEL}.weight" in {p["fqn"] for p in info["optimizer"]["params"]}


def test_diff_shows_names_escaped(runs):
    """Failure guarded: ``diff`` printed the keys of differing tensors and the non-tensor
    state differences raw."""
    result = run_cli("diff", *runs)
    assert result.exit_code == 1, result.stderr
    _assert_safe(result.stdout, f"model/{MODEL}/bias", f"x/{KEY}")
    _assert_safe(result.stderr)
    as_json = run_cli("diff", *runs, "--json")
    differing = {t["key"] for t in json.loads(as_json.stdout)["tensors"] if t["status"] != "equal"}
    assert {f"model/{MODEL}/bias", f"x/{KEY}"} <= differing


def test_verify_and_listing_show_names_escaped(runs):
    """Failure guarded: ``verify``'s notes and failures, and the run listing, wrote names
    raw."""
    for args in (("verify", runs[0]), ("inspect", runs[0])):
        result = run_cli(*args)
        assert result.exit_code == 0, result.stderr
        _assert_safe(result.stdout + result.stderr)
    assert "\\x1b" in run_cli("verify", runs[0]).stdout  # the notes name the parameter


def test_export_shows_names_escaped(runs, tmp_path):
    """Failure guarded: ``export``'s summary (the tied tensors it wrote once) wrote names
    raw."""
    result = run_cli("export", runs[0], "--to", tmp_path / "m.safetensors")
    assert result.exit_code == 0, result.stderr
    _assert_safe(result.stdout + result.stderr, f"dec.{TIED}.weight")


def test_errors_show_names_escaped(runs):
    """Failure guarded: an error message naming a path or tensor was printed raw to
    stderr (``TypeName: message``)."""
    result = run_cli("inspect", runs[0].parent / f"missing{TITLE}")
    assert result.exit_code == 2
    _assert_safe(result.stderr, f"missing{TITLE}")
    result = run_cli("inspect", runs[0], "--step", f"7{CLEAR}")  # click's usage errors too
    assert result.exit_code == 2
    _assert_safe(result.stderr)


def test_safe_console_escapes_every_control_character():
    """Guarantee: the console every command prints with escapes C0 and C1 controls (CSI
    ``\\x9b`` included) and bidirectional overrides, and keeps rich's own styling."""
    import io

    from unbroken.cli._safe import SafeConsole, safe, shown

    out = io.StringIO()
    console = SafeConsole(file=out, force_terminal=True, highlight=False, width=200)
    console.print(f"[red]{shown('a' + CLEAR + chr(0x9B) + chr(0x202E) + chr(13) + '[b]')}[/red]")
    text = out.getvalue()
    assert "a\\x1b[2J\\x9b\\u202e\\x0d[b]" in text
    assert "\x1b[31m" in text  # rich's own colour is still written
    assert safe("one\ntwo", lines=True) == "one\ntwo" and safe("one\ntwo") == "one\\x0atwo"
