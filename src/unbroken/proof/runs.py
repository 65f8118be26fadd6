"""Run one training command (argv, shell string or importable function) in a fresh
process for the resume harness, its output kept in a log file.

When a run fails, the error shows the exception that stopped it, found in the log: the
first Python traceback's final line(s), of the failing rank under torchrun, rather than
torchrun's own ``ChildFailedError`` report.

A run past its timeout is killed with every process it started: torchrun starts its
workers in sessions of their own, so killing torchrun (or its process group) alone would
leave them running. The run's tree is frozen (SIGSTOP, so nothing forks while it is
walked), found through ``/proc`` (Linux; elsewhere only the run's process group), then
killed (SIGKILL).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import shlex
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import CheckpointError
from ..storage.interface import Location

Command = str | Sequence[str] | Callable[[str], object]


class RunFailed(CheckpointError):
    """A training run of the harness exited with an error."""


def run(command: Command, folder: Location, env: dict[str, str], log: Path, timeout) -> None:
    """Run one training run with ``{dir}`` = ``folder`` (a local folder, or a URL)."""
    folder.make_dirs()
    if callable(command):
        _run_callable(command, str(folder), env, log, timeout)
        return
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    argv = [arg.replace("{dir}", str(folder)) for arg in argv]
    if not any(str(folder) in arg for arg in argv):
        raise ValueError("the command must contain {dir}: where its checkpoints go")
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"$ {shlex.join(argv)}\n")
        out.flush()
        # A process group of its own: killed as a whole (with its descendants) on timeout.
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, process_group=0
        )
        try:
            returncode = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid, group=True)
            proc.wait()
            raise RunFailed(_timed_out(shlex.join(argv), timeout, log)) from None
        except BaseException:  # Ctrl-C (its SIGINT reaches only this group): end the run too
            _kill_tree(proc.pid, group=True)
            proc.wait()
            raise
    if returncode != 0:
        raise RunFailed(_failure(f"{shlex.join(argv)} exited with {returncode}", log))


def _call_in_child(fn: Callable[[str], object], folder: str, env: dict[str, str], log: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    fn(folder)


def _run_callable(fn, folder: str, env: dict[str, str], log: Path, timeout) -> None:
    proc = multiprocessing.get_context("spawn").Process(
        target=_call_in_child, args=(fn, folder, env, str(log))
    )
    proc.start()
    try:
        proc.join(timeout)
    except BaseException:
        _kill_tree(proc.pid, group=False)
        raise
    if proc.is_alive():
        _kill_tree(proc.pid, group=False)  # it shares this process's group: not killpg
        proc.join()
        raise RunFailed(_timed_out(f"{fn.__qualname__}({folder!r})", timeout, log))
    if proc.exitcode != 0:
        raise RunFailed(_failure(f"{fn.__qualname__}({folder!r}) exited with {proc.exitcode}", log))


def _timed_out(what: str, timeout: float, log: Path) -> str:
    """The one-line error of a run killed at its timeout (also noted in its log)."""
    with open(log, "a", encoding="utf-8") as out:
        out.write(
            f"\n[unbroken] timed out after {timeout:g}s: killed with every process it started\n"
        )
    return (
        f"the {log.stem} run timed out after {timeout:g}s and was killed with every process "
        f"it started: {what}; log: {log}"
    )


def _kill_tree(pid: int, *, group: bool) -> None:
    """SIGKILL ``pid``, its process group if ``group`` (it leads one), and every
    descendant, however it was started (torchrun's workers lead sessions of their own).

    The tree is frozen first, SIGSTOP to each process found, and walked again until no
    new one appears: a stopped process cannot fork, and no descendant is orphaned (so
    lost from the tree) before all are found. Then everything found is killed.
    """
    found: list[int] = []
    fresh = [pid]
    while fresh:
        for p in fresh:
            _signal(p, signal.SIGSTOP)
        found += fresh
        fresh = [p for p in _descendants(pid) if p not in found]
    if group:
        with contextlib.suppress(OSError):  # gone already
            os.killpg(pid, signal.SIGKILL)
    for p in found:
        _signal(p, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):  # gone already
        os.kill(pid, sig)


def _descendants(root: int) -> list[int]:
    """The pids of ``root``'s descendants now, from ``/proc`` ([] without it)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    children: dict[int, list[int]] = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(name))
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


# torchrun --tee / --log-dir (or TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE) prefixes each
# line of a worker with its role and rank: "[default1]:", "[trainer0]:", "[rank1]:", "[1]:".
_PREFIX = re.compile(r"^\[([A-Za-z_]*)(\d+)\]:")
# torchrun's "Root Cause (first observed failure)" section names the failing rank.
_ROOT_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
# glog/c10 log lines ("E1122 12:16:03.44 ...", "[W1122 12:16:03 ...]") end a message.
_LOG_LINE = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d")
_MAX_MESSAGE_LINES = 12


def _failure(what: str, log: Path) -> str:
    """``what`` and the failing rank's exception from ``log`` (or the log's tail)."""
    text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    rank, exception, own = failing_exception(text)
    if exception:
        if rank is None:
            who = "it raised"
        elif own:
            who = f"rank {rank} raised"
        else:  # unprefixed output of several ranks: the first traceback is the best guess
            who = f"rank {rank} failed first; the log's first exception"
        shown = "\n".join(f"  {line}" for line in exception)
        return f"{what}; {who}:\n{shown}\nfull log: {log}"
    tail = "".join(text.splitlines(True)[-15:])
    return f"{what}; log {log}:\n{tail}"


def failing_exception(text: str) -> tuple[int | None, list[str], bool]:
    """(rank, exception lines, whether the lines are surely that rank's) of a failed run,
    from its combined output.

    The exception is the final line(s) of the first Python traceback (``ValueError: ...``
    and the rest of a multi-line message). Under torchrun the failing rank comes from the
    "Root Cause" section; with prefixed lines (``[default1]:``) only that rank's lines are
    read; without, the child's traceback precedes torchrun's own, which is skipped.
    Returns (None, [], False) if no traceback is found.
    """
    lines = text.splitlines()
    rank = local = None
    for line in lines:
        m = _ROOT_RANK.match(line)
        if m:
            rank, local = int(m.group(1)), int(m.group(2))
            break
    by_rank: dict[int, list[str]] = {}
    plain: list[str] = []
    for line in lines:
        m = _PREFIX.match(line)
        if m:
            by_rank.setdefault(int(m.group(2)), []).append(line[m.end() :])
        else:
            plain.append(line)
    # The failing rank's own lines first (prefixes carry the local rank by default, the
    # global one with a "[rank${rank}]:" template), then any rank's, then the rest.
    order = [n for n in dict.fromkeys((local, rank)) if n is not None and n in by_rank]
    order += [n for n in sorted(by_rank) if n not in order]
    for n in order:
        found = _first_exception(by_rank[n])
        if found:
            return n, found, True
    return rank, _first_exception(plain), False


def _first_exception(lines: list[str]) -> list[str]:
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last):"):
            continue
        j = i + 1
        while j < len(lines) and lines[j][:1].isspace():  # the frames are indented
            j += 1
        if j == len(lines) or "ChildFailedError" in lines[j]:
            continue  # torchrun's own traceback: not the cause
        out = [lines[j]]
        for more in lines[j + 1 : j + _MAX_MESSAGE_LINES]:
            if (
                not more.strip()
                or _LOG_LINE.match(more)
                or more.startswith(
                    ("Traceback (most recent call last):", "During handling", "The above exception")
                )
            ):
                break
            out.append(more)
        return out
    return []
