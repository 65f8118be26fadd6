"""Prove that stopping and resuming changes nothing: the resume-determinism harness.

Runs a training command (or an importable function) in fresh processes: straight
through, then stopped at step K through ``UNBROKEN_STOP_AT``, then resumed in the same
checkpoint folder (with several stops K1 < K2 < ...: resumed and stopped again at each,
the last resume running to the end). The resumed run must have restored each stop step
(its checkpoints' lineage), and every tracked metric after the first stop and the whole
final state (tensors and non-tensor values) must be bit-identical. Usable from pytest::

    from unbroken.testing import assert_resumes_exactly

    def test_my_training_resumes(tmp_path):
        assert_resumes_exactly(["python", "train.py", "--ckpt", "{dir}"], stop_at=20,
                               workdir=tmp_path)
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .format import manifest
from .format.series import read_series
from .live.stopping import STOP_AT_ENV, STOP_TIER_ENV
from .proof.plotting import plot_resume_test
from .proof.replay import ResumeTestResult, compare, stop_steps
from .proof.resume_lineage import ordinal
from .proof.runs import Command, RunFailed, run
from .storage.interface import Location
from .storage.locate import checkpoint_dir, location


def resume_test(
    command: Command,
    *,
    stop_at: int | Sequence[int],
    workdir: str | os.PathLike,
    resume_command: Command | None = None,
    tolerance: float = 0.05,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    plot: bool = True,
    parallel: bool = False,
    store: str | None = None,
    tier: str = "persistent",
) -> ResumeTestResult:
    """Run ``command`` straight and stopped-at-``stop_at``-then-resumed; compare.

    ``stop_at`` is a step K, or increasing steps [K1, K2, ...]: the second run stops at
    K1, is resumed and stopped at K2, ..., and the last resume runs to the end (a bug
    that shows only on a second resume needs two stops). The resumed run must restore
    each stop step in turn, as its checkpoints' lineage records, or the verdict is NOT
    RESUMED whatever the metrics say. ``command`` is an argv list or shell-style string
    containing ``{dir}`` (replaced by a fresh checkpoint folder per run), or a function
    ``fn(dir)`` importable by module path (run in a spawned process). With
    ``resume_command`` (e.g. another world size; used for every resume) the resumed run
    may differ within ``tolerance`` (relative); the restore itself is still verified
    exactly by the library. ``plot`` draws ``resume-test.png`` (it needs matplotlib;
    without it the result says so in a note and the verdict is unchanged). ``parallel``
    runs the straight and the stopped run at the same time (they share nothing): faster
    where the machine has room for both, wrong for commands that need a whole GPU or
    bind a fixed port (torchrun without ``--standalone`` or distinct
    ``--master_port``s). ``store``: a URL (``s3://bucket/prefix``) under which the two
    runs keep their checkpoints (``straight`` and ``resumed``) instead of ``workdir``,
    which still gets the logs, report and plot. ``timeout``: seconds allowed per run; a
    run past it is killed with every process it started (torchrun's workers included).
    ``tier="local"``: each stop's save goes to the script's local tier
    (``UNBROKEN_STOP_TIER=local``; the script passes ``local=ub.LocalTier(...)``), and
    each resume must restore it from there (its lineage's resume event says ``local`` or
    ``peer``), else NOT RESUMED.

    Raises:
        ValueError: a bad ``stop_at``, or a used workdir or store prefix.
        RunFailed: a run failed, or a stopped run committed no checkpoint at its stop, or
            a run timed out (one line: "the straight run timed out after 5s and was
            killed with every process it started: CMD; log: PATH").
    """
    stops = stop_steps(stop_at)
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    base = location(work if store is None else store)
    straight, resumed = base / "straight", base / "resumed"
    for d in (straight, resumed):
        if not d.is_empty():
            what = "workdir" if store is None else "store prefix"
            raise ValueError(f"{d} is not empty: give resume_test a fresh {what}")
    if tier not in ("persistent", "local"):
        raise ValueError(f'tier must be "persistent" or "local", got {tier!r}')
    hidden = (STOP_AT_ENV, STOP_TIER_ENV)
    base_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in hidden}
    stop_env = {**base_env, STOP_TIER_ENV: tier}
    first_runs = [
        (straight, base_env, work / "straight.log"),
        (resumed, {**stop_env, STOP_AT_ENV: str(stops[0])}, work / "stopped.log"),
    ]
    if parallel:
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="unbroken-run") as pool:
            runs = [pool.submit(run, command, *args, timeout) for args in first_runs]
        for finished in runs:
            finished.result()  # the straight run's error first, as when sequential
    else:
        for args in first_runs:
            run(command, *args, timeout)
    local = tier == "local"
    seen = _stopped_at(resumed, stops[0], work / "stopped.log", "the stopped run", local)
    for i, stop in enumerate(stops[1:], start=1):  # each resume but the last stops again
        log = work / f"resumed-{i}.log"
        run(resume_command or command, resumed, {**stop_env, STOP_AT_ENV: str(stop)}, log, timeout)
        who = f"the {ordinal(i)} resume"
        for step, doc in _stopped_at(resumed, stop, log, who, local).items():
            seen.setdefault(step, doc)
    run(resume_command or command, resumed, base_env, work / "resumed.log", timeout)
    result = compare(
        straight,
        resumed,
        stop_at=stops,
        exact=resume_command is None,
        tolerance=tolerance,
        checkpoints=seen,
        tier=tier,
    )
    result.report_path = str(work / "resume-test-report.txt")
    if plot:
        try:
            result.plot_path = plot_resume_test(
                read_series(straight),
                read_series(resumed),
                work / "resume-test.png",
                stop_at=stops,
                title=f"resume test: {'passed' if result.passed else 'FAILED'}",
                first_difference=result.first_difference_step,
            )
        except ImportError as exc:  # matplotlib is an optional extra: the verdict stands
            result.notes.append(f"no plot: {exc}")
    Path(result.report_path).write_text(str(result) + "\n", encoding="utf-8")
    (work / "resume-test.json").write_text(json.dumps(dataclasses.asdict(result), indent=1))
    return result


def _stopped_at(
    folder: Location, stop: int, log: Path, who: str, local: bool = False
) -> dict[int, dict]:
    """The manifests of ``folder``'s checkpoints once a run stopped at ``stop`` (the
    evidence of what it restored and held, before a later run prunes them). ``local``:
    the stop's checkpoint is in the script's local tier, not in ``folder``.

    Raises:
        RunFailed: its newest checkpoint is not of step ``stop``.
    """
    ckdir = checkpoint_dir(folder)
    steps = ckdir.steps()
    if not local and steps[-1:] != [stop]:
        raise RunFailed(
            f"{who} did not commit a checkpoint at step {stop} (see {log}); does the "
            "script call ckpt.should_stop(step) and save?"
        )
    return {step: manifest.read(ckdir.step_path(step)) for step in steps}


def assert_resumes_exactly(
    command: Command, *, stop_at: int | Sequence[int], workdir, **kwargs
) -> ResumeTestResult:
    """:func:`resume_test`, raising ``AssertionError`` with the report unless it passed
    (IDENTICAL; CLOSE with a ``resume_command``).

    Example::

        assert_resumes_exactly(["python", "train.py", "{dir}"], stop_at=[10, 20],
                               workdir=tmp_path)
    """
    result = resume_test(command, stop_at=stop_at, workdir=workdir, **kwargs)
    if not result.passed:
        raise AssertionError(str(result))
    return result


__all__ = ["ResumeTestResult", "RunFailed", "assert_resumes_exactly", "compare", "resume_test"]
