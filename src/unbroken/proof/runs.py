"""Run one training command (argv, shell string or importable function) in a fresh
process for the resume harness, its output kept in a log file.
"""

from __future__ import annotations

import multiprocessing
import os
import shlex
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import CheckpointError

Command = str | Sequence[str] | Callable[[str], object]


class RunFailed(CheckpointError):
    """A training run of the harness exited with an error."""


def run(command: Command, folder: Path, env: dict[str, str], log: Path, timeout) -> None:
    folder.mkdir(parents=True, exist_ok=True)
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
        proc = subprocess.run(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False
        )
    if proc.returncode != 0:
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(True)[-15:])
        raise RunFailed(f"{shlex.join(argv)} exited with {proc.returncode}; log {log}:\n{tail}")


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
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        raise RunFailed(f"{fn.__qualname__}({folder!r}) timed out after {timeout}s")
    if proc.exitcode != 0:
        tail = (
            "".join(log.read_text(errors="replace").splitlines(True)[-15:]) if log.exists() else ""
        )
        raise RunFailed(
            f"{fn.__qualname__}({folder!r}) exited with {proc.exitcode}; log {log}:\n{tail}"
        )
