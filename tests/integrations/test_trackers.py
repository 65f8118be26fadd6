"""Experiment trackers after a real crash and recompute (issue 30, item 8).

docs/integrations/trackers.md's script runs as printed, in fresh processes: once straight
to step 20, and once killed with SIGKILL right after tracking step 17 (last save: step
10), then launched again, so it restores step 10 and recomputes steps 11 to 20. Every
fifth step also tracks ``eval_loss`` in a second ``track()`` call (issue 36, item 3). What
TensorBoard's event files and W&B's offline run files hold is read back with their own
readers (TensorBoard's ``EventAccumulator``; wandb 0.31 ships no Python reader of ``.wandb`` files, so
a small one of its LevelDB-style log is below). Bug class: a resume that logs the
recomputed steps twice (a dashboard with two values per step, or W&B rows moved to wrong
steps), a new tracker run per resume, a replay verdict that never reaches the dashboard.

The killed job runs with a detached wandb-core (``wandb beta core start``), as the page
recommends: wandb-core otherwise dies with the job and its unwritten rows with it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import struct
import subprocess
import sys
import time
import weakref
import zlib
from pathlib import Path

import pytest
import torch

from conftest import Problem
from unbroken.format import manifest
from unbroken.format.series import read_series

from .recipes import write_recipe

pytestmark = pytest.mark.e2e
TOTAL, SAVED, KILLED_AFTER = 20, 10, 17
METRICS = ("loss", "grad_norm")
EVALUATED = [5, 10, 15, 20]  # steps that also track eval_loss, in a second call

# Runs the recipe unchanged, SIGKILLing itself right after ``track`` of step N (0: never):
# no close(), no flush, no atexit; what reached the trackers' files is all there is.
RUNNER = """
import os, runpy, signal, sys
import unbroken as ub
recipe, kill_after = sys.argv[1], int(sys.argv[2])
track = ub.Checkpointer.track
def track_then_die(self, step, **metrics):
    track(self, step, **metrics)
    if step == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
ub.Checkpointer.track = track_then_die
sys.argv = [recipe, *sys.argv[3:]]
runpy.run_path(recipe, run_name="__main__")
"""


@dataclasses.dataclass
class Runs:
    straight: Path  # checkpoint, tb and wandb folders of the straight run
    crashed: Path  # ... of the killed-and-relaunched run
    printed: list[str]  # the "run ID from step S" lines of the killed job and the relaunch


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp / "wandb-home"),
        "WANDB_CONFIG_DIR": str(tmp / "wandb-config"), "WANDB_CACHE_DIR": str(tmp / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp / "wandb-data"), **extra,
    }  # fmt: skip


def _launch(tmp: Path, recipe: Path, kill_after: int, out: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(tmp / "runner.py"), str(recipe), str(kill_after),
         str(out / "ckpts"), str(out / "tb"), str(out / "wandb")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp, **env),
    )  # fmt: skip


def _finished(proc: subprocess.Popen, code: int) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}\n{out}\n{err}"
    return out


def _wandb(tmp: Path, *args: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-m", "wandb", *args], capture_output=True,
                          text=True, timeout=120, env=_env(tmp, **env))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    """The straight run (beside the killed job: independent), the killed job, then its
    relaunch once the detached wandb-core has written the killed job's rows out."""
    tmp = tmp_path_factory.mktemp("trackers")
    recipe = write_recipe("trackers.md", "trackers", tmp)
    (tmp / "runner.py").write_text(RUNNER, encoding="utf-8")
    straight, crashed = tmp / "straight", tmp / "crashed"
    token = _wandb(tmp, "beta", "core", "start", "--idle-timeout", "300s").splitlines()[0]
    try:
        first = _launch(tmp, recipe, 0, straight)
        killed = _launch(tmp, recipe, KILLED_AFTER, crashed, WANDB_SERVICE=token)
        printed = [_finished(killed, -9)]
        _finished(first, 0)
    finally:
        _wandb(tmp, "beta", "core", "stop", WANDB_SERVICE=token)
    _wait_for_exit_record(crashed)
    printed.append(_finished(_launch(tmp, recipe, 0, crashed), 0))
    return Runs(straight, crashed, [line for out in printed for line in out.splitlines()])


def _truth(runs: Runs) -> dict[str, list[tuple[int, float]]]:
    """The straight run's tracked values, as unbroken recorded them (exact floats)."""
    values = read_series(runs.straight / "ckpts").values
    assert [s for s, _ in values["loss"]] == list(range(1, TOTAL + 1))
    assert [s for s, _ in values["eval_loss"]] == EVALUATED
    return {name: values[name] for name in (*METRICS, "eval_loss")}


# TensorBoard -------------------------------------------------------------------------------


def _tensorboard(folder: Path):
    """The folder as the TensorBoard server reads it (``plugin_event_accumulator``, which
    applies ``purge_step`` to every summary; the older ``event_accumulator`` keeps purged
    tensor summaries, float64 scalars among them)."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as pea

    acc = pea.EventAccumulator(str(folder), size_guidance={pea.TENSORS: 0})
    acc.Reload()
    return acc


def _tb_values(acc, tag: str) -> list[tuple[int, float]]:
    from tensorboard.util import tensor_util

    return [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]


def _tb_texts(acc, tag: str) -> list[tuple[int, str]]:
    from tensorboard.util import tensor_util

    return [(e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode())
            for e in acc.Tensors(tag)]  # fmt: skip


def _raw_steps(event_file: Path, tag: str) -> list[int]:
    """Steps of ``tag`` in one event file as written, before TensorBoard purges anything."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    return [e.step for e in EventFileLoader(str(event_file)).Load()
            if any(v.tag == tag for v in e.summary.value)]  # fmt: skip


def test_tensorboard_shows_every_step_once_with_the_straight_runs_values(runs):
    """Steps 1..20 once each, every value the straight run's bit for bit (float64), and
    ``eval_loss`` (tracked in a second call) at every fifth step. The killed job's file
    does hold steps 11..16, and the relaunch's holds them again: only the relaunch's
    ``purge_step=11`` makes TensorBoard show each once (a writer opened without it shows
    11..16 twice). Step 17 was still open when the job was killed (a second call could
    have come), so only the relaunch forwarded it."""
    truth = _truth(runs)
    acc = _tensorboard(runs.crashed / "tb")
    for name in (*METRICS, "eval_loss"):
        got = _tb_values(acc, name)
        assert [s for s, _ in got] == [s for s, _ in truth[name]], name
        assert [v.hex() for _, v in got] == [v.hex() for _, v in truth[name]], name
    killed, relaunched = sorted((runs.crashed / "tb").iterdir())
    assert _raw_steps(killed, "loss") == list(range(1, KILLED_AFTER))
    assert _raw_steps(killed, "eval_loss") == [5, 10, 15]
    assert _raw_steps(relaunched, "loss") == list(range(SAVED + 1, TOTAL + 1))


def test_tensorboard_shows_the_verdict_and_the_run_id(runs):
    """The replay verdict of the relaunch (identical, decided at step 17, the last step the
    killed job had tracked) as a text and a 1.0; the run id at the start of each job.
    The texts read back under the tags documented, ``unbroken/run`` and
    ``unbroken/replay`` (issue 36, item 12: ``add_text`` made them
    ``unbroken/run/text_summary``)."""
    acc = _tensorboard(runs.crashed / "tb")
    tags = acc.Tags()["tensors"]
    assert {"unbroken/run", "unbroken/replay"} <= set(tags)
    assert not [t for t in tags if t.endswith("text_summary")], tags
    [(step, text)] = _tb_texts(acc, "unbroken/replay")
    assert step == KILLED_AFTER and "identical" in text and f"from step {SAVED}" in text
    assert _tb_values(acc, "unbroken/replay_identical") == [(KILLED_AFTER, 1.0)]
    run_id = _run_id(runs)
    assert _tb_texts(acc, "unbroken/run") == [
        (1, f"run {run_id} started"),
        (SAVED + 1, f"run {run_id} resumed from step {SAVED}"),
    ]


# W&B (offline) -----------------------------------------------------------------------------


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file (a LevelDB log: 7-byte header, 32 KiB
    blocks of chunks ``crc32 (IEEE) | length | type``), checksums checked."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", f"{path} is not a .wandb file"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # block trailer or padding
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: damaged at byte {pos}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL, LAST
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _offline_runs(out: Path) -> list[Path]:
    """Every offline run's ``.wandb`` file of a run's jobs (``wandb.init(dir=out/wandb)``),
    oldest first."""
    return sorted((out / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))


def _wait_for_exit_record(folder: Path, timeout: float = 60) -> None:
    """The stopped detached wandb-core writes the killed job's rows out, then its exit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = _offline_runs(folder)
        if files and any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(files[0])):
            return
        time.sleep(0.2)
    raise AssertionError(f"no W&B exit record in {folder} after {timeout}s")


def _item(item) -> tuple[str, object]:
    return item.key or "/".join(item.nested_key), json.loads(item.value_json)


def _history(path: Path) -> list[tuple[int, dict[str, object]]]:
    rows = []
    for r in _wandb_records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append((r.history.step.num, dict(_item(i) for i in r.history.item)))
    return rows


def _summary(path: Path) -> dict[str, object]:
    found: dict[str, object] = {}
    for r in _wandb_records(path):
        if r.WhichOneof("record_type") == "summary":
            found.update(_item(i) for i in r.summary.update)
    return found


def test_wandb_run_files_hold_every_step_once_with_the_straight_runs_values(runs):
    """What ``wandb sync`` would upload: the killed job's rows (1..16, kept by the
    detached wandb-core; step 17 was still open) and the relaunch's (17..20 only: it
    recomputed 11..16 and did not send them again: doubled, or moved to later steps on
    upload), every value the straight run's bit for bit. Every fifth step's row holds
    ``eval_loss`` beside ``loss``, though tracked in a second call (issue 36, item 3:
    logged per call with ``commit=True``, W&B dropped the second call's metrics)."""
    truth = _truth(runs)
    killed, relaunched = _offline_runs(runs.crashed)
    assert [s for s, _ in _history(killed)] == list(range(1, KILLED_AFTER))
    assert [s for s, _ in _history(relaunched)] == list(range(KILLED_AFTER, TOTAL + 1))
    rows = _history(killed) + _history(relaunched)
    for name in (*METRICS, "eval_loss"):
        got = [(s, row[name]) for s, row in rows if name in row]
        assert [(s, float(v).hex()) for s, v in got] == [(s, v.hex()) for s, v in truth[name]]
    [straight] = _offline_runs(runs.straight)
    assert [s for s, _ in _history(straight)] == list(range(1, TOTAL + 1))
    assert [s for s, row in _history(straight) if "eval_loss" in row] == EVALUATED


def test_wandb_continues_one_run_and_keeps_the_verdict_in_its_summary(runs):
    """Both jobs write W&B run ``ckpt.run_id`` (the relaunch resumes it); the relaunch's
    summary holds the replay verdict."""
    run_id = _run_id(runs)
    for path in _offline_runs(runs.crashed):
        [run] = [r.run for r in _wandb_records(path) if r.WhichOneof("record_type") == "run"]
        assert run.run_id == run_id and path.name == f"run-{run_id}.wandb"
    summary = _summary(_offline_runs(runs.crashed)[1])
    assert summary["unbroken/replay"] == "identical"
    assert summary["unbroken/replay_from_step"] == SAVED
    assert "identical" in summary["unbroken/replay_detail"]


def _run_id(runs: Runs) -> str:
    """The run id both jobs printed, which is the one in the last checkpoint's manifest."""
    doc = manifest.read(runs.crashed / "ckpts" / f"step_{TOTAL:08d}")
    run_id = doc["lineage"][0]["run"]
    assert runs.printed == [f"run {run_id} from step 0", f"run {run_id} from step {SAVED}"]
    assert doc["lineage"][-1]["replay"]["status"] == "identical"
    return run_id


# No import of a tracker's package ---------------------------------------------------------

IMPORTS = """
import sys, torch
import unbroken as ub
from unbroken.integrations.trackers import TensorBoardTracker, WandbTracker
TensorBoardTracker(sys.argv[1] + "/tb"), WandbTracker(project="p")  # made, never started
model = torch.nn.Linear(2, 1)
with ub.Checkpointer(sys.argv[1] + "/ckpts", model=model) as ckpt:
    ckpt.restore()
    ckpt.track(1, loss=torch.tensor(0.5))
    ckpt.save(1)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("tensorboard", "wandb")
             or m.startswith("torch.utils.tensorboard")))
"""


def test_unbroken_never_imports_tensorboard_or_wandb(tmp_path):
    """``import unbroken``, a Checkpointer's whole life, ``unbroken.integrations.trackers``
    and making its trackers load neither package (they are imported when a tracker
    starts)."""
    done = subprocess.run([sys.executable, "-c", IMPORTS, str(tmp_path)], capture_output=True,
                          text=True, timeout=120, env=_env(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# The protocol, in this process -------------------------------------------------------------


class Recording:
    """A tracker that records every call."""

    def __init__(self, fail_in: str | None = None) -> None:
        self.calls: list[tuple] = []
        self.fail_in = fail_in

    def _note(self, *call) -> None:
        self.calls.append(call)
        if call[0] == self.fail_in:
            raise ConnectionError("dashboard unreachable")

    def start(self, run_id, resume_step, tracked_upto):
        self._note("start", run_id, resume_step, tracked_upto)

    def log(self, step, metrics):
        self._note("log", step, dict(metrics))

    def verdict(self, step, verdict):
        self._note("verdict", step, verdict.status)

    def close(self):
        self._note("close")


def _train(p: Problem, ckpt, first: int, last: int, save_at=(), tensor=False) -> None:
    for step in range(first, last + 1):
        loss = p.step()
        ckpt.track(step, loss=torch.tensor(loss, dtype=torch.float64) if tensor else loss)
        if step in save_at:
            ckpt.save(step)


def test_a_resume_tells_trackers_where_it_goes_on_and_what_was_forwarded(tmp_path):
    """A run tracked 1..17 with its last save at 10; the resume starts its trackers with
    ``resume_step=10, tracked_upto=17`` (from the metrics record), forwards the
    recomputed steps as floats (tracked here as 0-d tensors), and the verdict once
    decided, at step 17."""
    first, again = Recording(), Recording()
    p = Problem()
    with p.checkpointer(tmp_path, trackers=[first]) as ckpt:
        ckpt.restore()
        _train(p, ckpt, 1, KILLED_AFTER, save_at=(SAVED,))
        run_id = ckpt.run_id
    assert first.calls[0] == ("start", run_id, 0, 0) and first.calls[-1] == ("close",)
    assert [c[1] for c in first.calls if c[0] == "log"] == list(range(1, KILLED_AFTER + 1))
    q = Problem(seed=1)
    with q.checkpointer(tmp_path, trackers=[again]) as ckpt:
        ckpt.restore()
        _train(q, ckpt, SAVED + 1, TOTAL, tensor=True)
    assert again.calls[0] == ("start", run_id, SAVED, KILLED_AFTER)
    logged = [c for c in again.calls if c[0] == "log"]
    assert [c[1] for c in logged] == list(range(SAVED + 1, TOTAL + 1))
    assert all(type(c[2]["loss"]) is float for c in logged)
    recomputed = {c[1]: c[2] for c in first.calls if c[0] == "log" and c[1] > SAVED}
    assert {c[1]: c[2] for c in logged if c[1] <= KILLED_AFTER} == recomputed
    verdict_at = again.calls.index(("verdict", KILLED_AFTER, "identical"))
    assert again.calls[verdict_at - 1][:2] == ("log", KILLED_AFTER)  # right after step 17
    assert again.calls[-1] == ("close",)


def test_a_failing_tracker_is_left_out_and_training_goes_on(tmp_path, caplog):
    """A tracker raising in ``log`` is named in one warning and gets nothing more; the
    other tracker gets every step, and the save commits."""
    broken, fine = Recording(fail_in="log"), Recording()
    p = Problem()
    caplog.set_level(logging.WARNING, logger="unbroken.run.trackers")
    with p.checkpointer(tmp_path, trackers=[broken, fine]) as ckpt:
        _train(p, ckpt, 1, 3, save_at=(3,))  # no restore(): started by the first track
        assert ckpt.steps() == [3]
    assert [c[0] for c in broken.calls] == ["start", "log"]
    assert [c[1] for c in fine.calls if c[0] == "log"] == [1, 2, 3]
    [warning] = [r.getMessage() for r in caplog.records if "tracker" in r.getMessage()]
    assert "Recording failed in log()" in warning and "dashboard unreachable" in warning


def test_a_checkpointer_with_trackers_dropped_without_close_is_freed_at_once(tmp_path):
    """As without trackers (a crash in a test, an exception): nothing keeps it alive, so
    its run lock goes and a relaunch in the same process records its steps."""
    p, tracker = Problem(), Recording()
    ckpt = p.checkpointer(tmp_path, trackers=[tracker])
    ckpt.restore()
    _train(p, ckpt, 1, 2, save_at=(2,))
    gone = weakref.ref(ckpt)
    del ckpt
    assert gone() is None and [c[0] for c in tracker.calls] == ["start", "log", "log"]


def test_trackers_that_are_not_trackers_are_refused(tmp_path):
    p = Problem()
    with pytest.raises(TypeError, match=r"trackers\[1\] \(object\) has no method start, log"):
        p.checkpointer(tmp_path, trackers=[Recording(), object()])
    with pytest.raises(TypeError, match="a list of trackers"):
        p.checkpointer(tmp_path, trackers=Recording())


def test_a_wandb_run_of_the_callers_own_is_not_taken_for_the_run(tmp_path, monkeypatch, caplog):
    """``wandb.init`` called by the script first: wandb 0.31 hands the tracker that run
    (``reinit="return_previous"``), which would log this run under another id. The
    tracker refuses it (one warning naming both ids) and the training goes on."""
    import wandb

    from unbroken.integrations.trackers import WandbTracker

    for name, value in _env(tmp_path, WANDB_CONSOLE="off").items():  # stdout left alone
        if name.startswith("WANDB_"):
            monkeypatch.setenv(name, value)
    mine = wandb.init(project="p", dir=str(tmp_path))
    try:
        caplog.set_level(logging.WARNING, logger="unbroken.run.trackers")
        p = Problem()
        with p.checkpointer(tmp_path / "ckpts", trackers=[WandbTracker(project="p")]) as ckpt:
            ckpt.restore()
            _train(p, ckpt, 1, 2, save_at=(2,))
            run_id = ckpt.run_id
        [warning] = [r.getMessage() for r in caplog.records if "tracker" in r.getMessage()]
        assert f"active run {mine.id} instead of run {run_id}" in warning
        assert "loss" not in dict(mine.summary)  # nothing of this run went into it
    finally:
        mine.finish()


def test_tracker_arguments_set_from_the_run_are_refused(tmp_path):
    from unbroken.integrations.trackers import TensorBoardTracker, WandbTracker

    with pytest.raises(ValueError, match="WandbTracker sets id, resume from the run"):
        WandbTracker(project="p", id="mine", resume="must")
    with pytest.raises(ValueError, match="sets purge_step"):
        TensorBoardTracker(tmp_path, purge_step=3)


# A step tracked in two calls (issue 36, item 3) -------------------------------------------


def _train_with_eval(p: Problem, ckpt, first: int, last: int, save_at=(), cut=None) -> None:
    """``track(step, loss=)`` every step, then ``track(step, eval_loss=)`` on even steps
    (a second call for the same step); ``cut``: stop right after that step's first call."""
    for step in range(first, last + 1):
        ckpt.track(step, loss=p.step())
        if step == cut:
            return
        if step % 2 == 0:
            with torch.no_grad():
                ckpt.track(step, eval_loss=p.model(torch.ones(2, 4)).pow(2).mean())
        if step in save_at:
            ckpt.save(step)


def _logged(tracker: Recording) -> dict[int, set[str]]:
    logs = [c for c in tracker.calls if c[0] == "log"]
    assert len({c[1] for c in logs}) == len(logs), "a step logged twice"
    return {c[1]: set(c[2]) for c in logs}


def test_trackers_get_each_step_once_with_both_calls_merged(tmp_path):
    """Each step reaches the trackers once, when complete, holding ``loss`` and (even
    steps) ``eval_loss``. A job dropped right after step 8's first call had forwarded
    steps 1..7 only (8 was still open), so the resume's ``tracked_upto`` is 7, not 8:
    an appending tracker (W&B) then logs step 8 from the recompute instead of never."""
    first, again = Recording(), Recording()
    p = Problem()
    ckpt = p.checkpointer(tmp_path, trackers=[first])
    ckpt.restore()
    _train_with_eval(p, ckpt, 1, 8, save_at=(5,), cut=8)
    run_id = ckpt.run_id
    del ckpt  # a crash: no save, no close
    both, loss = {"loss", "eval_loss"}, {"loss"}
    assert _logged(first) == {s: both if s % 2 == 0 else loss for s in range(1, 8)}
    q = Problem(seed=1)
    with q.checkpointer(tmp_path, trackers=[again]) as ckpt:
        ckpt.restore()
        _train_with_eval(q, ckpt, 6, 10)
        assert ckpt.replay.status == "identical" and ckpt.warnings == []
    assert again.calls[0] == ("start", run_id, 5, 7)
    assert _logged(again) == {s: both if s % 2 == 0 else loss for s in range(6, 11)}
    assert ("verdict", 8, "identical") in again.calls  # step 8 compared (its loss only)


def test_wandb_gets_one_row_per_step_holding_both_calls(tmp_path, monkeypatch):
    """A real (offline) W&B run: every step is one history row, and the even steps' rows
    hold ``eval_loss`` beside ``loss``. Logged per call with ``commit=True``, wandb 0.31
    dropped the second call of a step ("ignoring partial history record")."""
    from unbroken.integrations.trackers import WandbTracker

    for name, value in _env(tmp_path, WANDB_CONSOLE="off").items():
        if name.startswith("WANDB_"):
            monkeypatch.setenv(name, value)
    p = Problem()
    tracker = WandbTracker(project="p", dir=str(tmp_path / "wandb"))
    with p.checkpointer(tmp_path / "ckpts", trackers=[tracker]) as ckpt:
        ckpt.restore()
        _train_with_eval(p, ckpt, 1, 4, save_at=(4,))
    _wait_for_exit_record(tmp_path)  # wandb-core may still be writing the file out
    [path] = _offline_runs(tmp_path)
    rows = _history(path)
    truth = read_series(tmp_path / "ckpts").values
    assert [s for s, _ in rows] == [1, 2, 3, 4]
    assert [s for s, row in rows if "eval_loss" in row] == [2, 4]
    for name in ("loss", "eval_loss"):
        got = [(s, float(row[name]).hex()) for s, row in rows if name in row]
        assert got == [(s, v.hex()) for s, v in truth[name]], name


def test_tensorboard_gets_both_calls_and_its_texts_under_their_tags(tmp_path):
    """TensorBoard holds ``loss`` at every step and ``eval_loss`` at the even ones, bit
    for bit the recorded values; the run id's text reads back under ``unbroken/run``
    (issue 36, item 12: it was ``unbroken/run/text_summary``)."""
    from unbroken.integrations.trackers import TensorBoardTracker

    p = Problem()
    tracker = TensorBoardTracker(tmp_path / "tb")
    with p.checkpointer(tmp_path / "ckpts", trackers=[tracker]) as ckpt:
        ckpt.restore()
        _train_with_eval(p, ckpt, 1, 4, save_at=(4,))
        run_id = ckpt.run_id
    truth = read_series(tmp_path / "ckpts").values
    acc = _tensorboard(tmp_path / "tb")
    for name in ("loss", "eval_loss"):
        got = [(s, v.hex()) for s, v in _tb_values(acc, name)]
        assert got == [(s, v.hex()) for s, v in truth[name]], name
    assert _tb_texts(acc, "unbroken/run") == [(1, f"run {run_id} started")]
    assert "unbroken/run/text_summary" not in acc.Tags()["tensors"]


@pytest.mark.parametrize(
    ("header", "tail", "upto"),
    [
        ({"marks_complete": True}, [], 16),  # killed while step 17 was open
        ({"marks_complete": True}, [{"complete": 17}], 17),  # a save or close() after it
        ({}, [], 17),  # an older version forwarded every call at once
    ],
)
def test_tracked_upto_counts_the_steps_forwarded(tmp_path, header, tail, upto):
    """Issue 36, item 3: a step is forwarded once complete, so the record's last step
    counts only if another step followed it or a ``complete`` line marked it; records
    of older versions (no ``marks_complete`` in the header) count every step."""
    from unbroken.run.trackers import tracked_upto
    from unbroken.storage.locate import location

    lines = [{"segment": "a", "resumed_from": None, "parent": None, "world_size": 1, **header}]
    lines += [{"segment": "a", "step": s, "metrics": {"loss": 1.0}} for s in range(1, 18)]
    lines += [{"segment": "a", **extra} for extra in tail]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert tracked_upto(location(tmp_path), 10) == upto


def test_a_step_tracked_again_after_the_next_one_is_named(tmp_path, caplog):
    """Issue 36, item 3: a step's metrics reach the trackers once the next step is
    tracked, so a metric tracked for step 1 after step 2 comes late (W&B would drop its
    row): one warning names the step and the metric, and the record still keeps it."""
    p, tracker = Problem(), Recording()
    caplog.set_level(logging.WARNING, logger="unbroken.run.record")
    with p.checkpointer(tmp_path, trackers=[tracker]) as ckpt:
        ckpt.restore()
        ckpt.track(1, loss=1.0)
        ckpt.track(2, loss=2.0)
        ckpt.track(1, eval_loss=3.0)
        ckpt.track(1, eval_acc=4.0)
    [warning] = [r.getMessage() for r in caplog.records]
    assert "step 1 was tracked again (eval_loss) after it was complete" in warning
    assert read_series(tmp_path).values["eval_loss"] == [(1, 3.0)]
