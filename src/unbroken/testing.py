"""Prove that stopping and resuming changes nothing: the resume-determinism harness.

Runs a training command (or an importable function) three times in fresh processes:
straight through, then stopped at step K through ``UNBROKEN_STOP_AT``, then resumed in
the same checkpoint folder. Every tracked metric after K and the final state's
fingerprints must be bit-identical. Usable from pytest::

    from unbroken.testing import assert_resumes_exactly

    def test_my_training_resumes(tmp_path):
        assert_resumes_exactly(["python", "train.py", "--ckpt", "{dir}"], stop_at=20,
                               workdir=tmp_path)
"""

from __future__ import annotations

import dataclasses
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .live.stopping import STOP_AT_ENV
from .proof.metrics import read_series
from .proof.plotting import plot_resume_test
from .proof.replay import ResumeTestResult, compare
from .proof.runs import Command, RunFailed, run
from .storage.locate import checkpoint_dir, location


def resume_test(
    command: Command,
    *,
    stop_at: int,
    workdir: str | os.PathLike,
    resume_command: Command | None = None,
    tolerance: float = 0.05,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    plot: bool = True,
    parallel: bool = False,
    store: str | None = None,
) -> ResumeTestResult:
    """Run ``command`` straight and stopped-at-``stop_at``-then-resumed; compare.

    ``command`` is an argv list or shell-style string containing ``{dir}`` (replaced by a
    fresh checkpoint folder per run), or a function ``fn(dir)`` importable by module path
    (run in a spawned process). With ``resume_command`` (e.g. another world size) the
    resumed run may differ within ``tolerance`` (relative); the restore itself is still
    verified exactly by the library. ``plot`` draws ``resume-test.png`` (it needs
    matplotlib; without it the result says so in a note and the verdict is unchanged).
    ``parallel`` runs the straight and the stopped run at the same time (they share
    nothing): faster where the machine has room for both, wrong for commands that need a
    whole GPU or bind a fixed port (torchrun without ``--standalone`` or distinct
    ``--master_port``s). ``store``: a URL (``s3://bucket/prefix``) under which the two
    runs keep their checkpoints (``straight`` and ``resumed``) instead of ``workdir``,
    which still gets the logs, report and plot.
    """
    if stop_at < 1:
        raise ValueError(f"stop_at must be >= 1, got {stop_at}")
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    base = location(work if store is None else store)
    straight, resumed = base / "straight", base / "resumed"
    for d in (straight, resumed):
        if d.exists() and (d.remote or any(d.iterdir())):
            what = "store prefix" if d.remote else "workdir"
            raise ValueError(f"{d} is not empty: give resume_test a fresh {what}")
    base_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != STOP_AT_ENV}
    first_runs = [
        (straight, base_env, work / "straight.log"),
        (resumed, {**base_env, STOP_AT_ENV: str(stop_at)}, work / "stopped.log"),
    ]
    if parallel:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="unbroken-run") as pool:
            runs = [pool.submit(run, command, *args, timeout) for args in first_runs]
        for finished in runs:
            finished.result()  # the straight run's error first, as when sequential
    else:
        for args in first_runs:
            run(command, *args, timeout)
    if checkpoint_dir(resumed).steps()[-1:] != [stop_at]:
        raise RunFailed(
            f"the stopped run did not commit a checkpoint at step {stop_at} (see "
            f"{work / 'stopped.log'}); does the script call ckpt.should_stop(step) and save?"
        )
    run(resume_command or command, resumed, base_env, work / "resumed.log", timeout)
    result = compare(straight, resumed, stop_at=stop_at, exact=resume_command is None,
                     tolerance=tolerance)  # fmt: skip
    result.report_path = str(work / "resume-test-report.txt")
    if plot:
        try:
            result.plot_path = plot_resume_test(
                read_series(straight),
                read_series(resumed),
                work / "resume-test.png",
                stop_at=stop_at,
                title=f"resume test: {'passed' if result.passed else 'FAILED'}",
                first_difference=result.first_difference_step,
            )
        except ImportError as exc:  # matplotlib is an optional extra: the verdict stands
            result.notes.append(f"no plot: {exc}")
    Path(result.report_path).write_text(str(result) + "\n", encoding="utf-8")
    (work / "resume-test.json").write_text(json.dumps(dataclasses.asdict(result), indent=1))
    return result


def assert_resumes_exactly(
    command: Command, *, stop_at: int, workdir, **kwargs
) -> ResumeTestResult:
    """:func:`resume_test`, raising ``AssertionError`` with the report unless identical."""
    result = resume_test(command, stop_at=stop_at, workdir=workdir, **kwargs)
    if not result.passed:
        raise AssertionError(str(result))
    return result


__all__ = ["ResumeTestResult", "RunFailed", "assert_resumes_exactly", "compare", "resume_test"]
