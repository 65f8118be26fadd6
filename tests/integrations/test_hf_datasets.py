"""Hugging Face datasets through torchdata's StatefulDataLoader resume bit for bit, twice in
a row (issue 30, item 7; datasets 5.2.0, torchdata 0.11.0).

The two recipes of ``docs/integrations/datasets.md`` (a stream shuffled through a saved
buffer; a map-style ``Dataset`` shuffled by the loader) run as printed under
``resume-test``, stopped at steps 17 and 41 (the second stop in the second epoch).

The rest runs in this process: each "run" builds its dataset, loader and Checkpointer
anew, as a fresh process would, and the batches drawn by a run stopped and resumed twice
are compared with a straight run's (no, one and two workers). Each repair of the
``dataloader`` component is switched off once to show the failure it prevents;
``.shuffle(buffer_size=...)``, a stream whose reported state stops advancing after a
resume (datasets#8308, simulated: 5.2.0 has the fix) and persistent workers without
``set_epoch()`` are shown to resume wrong, and to be warned about at save.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import pytest
import torch
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

import unbroken as ub
from unbroken.live import loader_state
from unbroken.testing import resume_test

from .recipes import recipes, write_recipe

pytestmark = pytest.mark.e2e
PAGE = "datasets.md"
STOPS, STEPS = [17, 41], 60  # 24 batches an epoch: the second stop is in epoch 1
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """4 JSON-lines files of 48 rows: 9 consecutive letters each (learnable: the next
    letter follows from the last)."""
    folder = tmp_path_factory.mktemp("letters")
    for f in range(4):
        rows = []
        for i in range(48):
            start = (f * 48 + i) * 7 % 26
            text = "".join(LETTERS[(start + k) % 26] for k in range(9))
            rows.append(json.dumps({"text": text}))
        (folder / f"part{f}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """datasets' caches in a fresh folder, offline (nothing may be downloaded)."""
    home = tmp_path_factory.mktemp("hf_home")
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"HF_HOME": str(home), "HF_DATASETS_OFFLINE": "1",
                            "HF_HUB_OFFLINE": "1"}.items():  # fmt: skip
            env.setenv(name, value)
        yield home


@pytest.fixture(scope="module")
def recipe() -> dict:
    """The stream recipe's names (ShuffleBuffer, collate, batches), as the page prints it."""
    namespace = {"__name__": "datasets_stream_recipe"}
    exec(compile(recipes(PAGE)["stream"], "datasets.md:stream", "exec"), namespace)
    return namespace


# -- the recipes, in fresh processes ------------------------------------------------------


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory, data_dir, hf_home) -> dict:
    """Each recipe under resume-test, both at once (each run is one process: together they
    keep two cores busy); name -> (result, runs folder)."""
    root = tmp_path_factory.mktemp("recipes")
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

    def run(name: str):
        script = write_recipe(PAGE, name, root)
        command = [sys.executable, str(script), "{dir}", str(data_dir)]
        workdir = root / f"{name}-runs"
        result = resume_test(command, stop_at=STOPS, workdir=workdir, env=env, plot=False,
                             timeout=240)  # fmt: skip
        return result, workdir

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, name) for name in ("stream", "table")}
    return {name: future.result() for name, future in futures.items()}


@pytest.mark.parametrize("name", ["stream", "table"])
def test_the_recipe_resumes_exactly_twice(recipe_runs, name):
    """Stopped at 17, resumed, stopped at 41 (epoch 1), resumed to 60, each in a fresh
    process: every loss and grad norm after step 17 and the final state equal the straight
    run's, and each resume restored its stop. Catches any lost data position, shuffle
    state or epoch; the model learns (the loss falls tenfold), so a reset would show."""
    result, workdir = recipe_runs[name]
    assert result.passed and result.compared_steps == STEPS - STOPS[0], str(result)
    losses = [r["metrics"]["loss"] for r in _series(workdir / "straight")]
    assert losses[-1] < losses[0] / 10, "the model did not learn the letters"


def _series(folder: Path) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if '"metrics"' in line]


# -- in this process -----------------------------------------------------------------------


def _passes(loader, data):
    """A loop that never calls set_epoch(): every pass in the same epoch."""
    while True:
        yield from loader


class Runs:
    """Runs in this process, each built anew; the batches they draw."""

    def __init__(self, root: Path, data_dir: Path, cache: Path, recipe: dict) -> None:
        self.root, self.data_dir, self.recipe = root, data_dir, recipe
        self.cache = str(cache)  # datasets read HF_HOME when imported: named here instead
        self.count = 0

    def make(self, kind: str, workers: int = 0, persistent: bool = False):
        """(loader, dataset) of ``kind``: the stream as datasets gives it, shuffled by
        datasets' own buffer, shuffled by the recipe's ShuffleBuffer, or map-style."""
        files = str(self.data_dir / "*.jsonl")
        data = datasets.load_dataset("json", data_files=files, split="train",
                                     streaming=kind != "table", cache_dir=self.cache)  # fmt: skip
        if kind == "hf-shuffle":
            data = data.shuffle(seed=0, buffer_size=16)
        elif kind == "shuffle-buffer":
            data = self.recipe["ShuffleBuffer"](data, buffer_size=16, seed=0)
        loader = StatefulDataLoader(data, batch_size=8, shuffle=True if kind == "table" else None,
                                    num_workers=workers, persistent_workers=persistent,
                                    collate_fn=self.recipe["collate"])  # fmt: skip
        return loader, data

    def draw(self, make, loop, stops=(), resave=None):
        """Batches of a run to ``STEPS``, stopped (a save) at each of ``stops`` and resumed
        in fresh objects; with ``resave=n`` each resume draws n batches, saves, stops and
        is resumed again. Returns (batches as lists of ids, every Checkpointer's warnings)."""
        self.count += 1
        folder = self.root / f"run{self.count}"
        drawn, warnings = [], []
        for stop in [*stops, STEPS]:
            loader, data, ckpt, step = self._start(folder, make)
            if resave is not None and step:
                for x, _ in itertools.islice(loop(loader, data), resave):
                    drawn.append(x.tolist())
                    step += 1
                ckpt.save(step)
                ckpt.close()
                loader, data, ckpt, step = self._start(folder, make)
            for x, _ in loop(loader, data):
                drawn.append(x.tolist())
                step += 1
                if step == stop:
                    if stop != STEPS:
                        ckpt.save(step)
                    break
            warnings += ckpt.warnings
            ckpt.close()
        return drawn, warnings

    @staticmethod
    def _start(folder: Path, make):
        torch.manual_seed(0)  # as a fresh process of the recipe's
        loader, data = make()
        ckpt = ub.Checkpointer(folder, model=nn.Linear(1, 1), dataloader=loader)
        return loader, data, ckpt, ckpt.restore().step

    def compared(self, make, loop, resave=None, stops=STOPS):
        """(straight batches, resumed batches, the resumed run's warnings)."""
        straight, _ = self.draw(make, loop)
        resumed, warnings = self.draw(make, loop, stops, resave=resave)
        assert len(straight) == STEPS
        return straight, resumed, warnings


@pytest.fixture
def runs(tmp_path, data_dir, hf_home, recipe) -> Runs:
    return Runs(tmp_path, data_dir, hf_home / "datasets", recipe)


def _epochs(runs: Runs):
    return runs.recipe["batches"]  # the recipe's loop: set_epoch(), a new number each pass


@pytest.mark.parametrize(
    "kind, workers, loop, resave",
    [
        pytest.param("stream", 0, "epochs", None, id="stream"),
        pytest.param("stream", 0, "passes", None, id="stream-no-set_epoch"),
        pytest.param("stream", 0, "epochs", 0, id="stream-resaved"),
        pytest.param("stream", 2, "epochs", 1, id="stream-2-workers-resaved-after-1"),
        pytest.param("shuffle-buffer", 0, "epochs", None, id="shuffle-buffer"),
        pytest.param("shuffle-buffer", 1, "epochs", 0, id="shuffle-buffer-worker-resaved"),
        pytest.param("table", 1, "passes", None, id="table-worker"),
    ],
)
def test_two_resumes_draw_the_straight_runs_batches(runs, kind, workers, loop, resave):
    """With no, one or two workers, with the recipe's loop or one that never calls
    set_epoch(), with a save right after each restore (or after its first batch: the
    second worker has not read yet): the batches of a run stopped at 17 and 41 are the
    straight run's, and no save warns."""
    loop_fn = _epochs(runs) if loop == "epochs" else _passes
    straight, resumed, warnings = runs.compared(lambda: runs.make(kind, workers), loop_fn,
                                                resave=resave)  # fmt: skip
    assert resumed == straight
    assert warnings == []


@pytest.mark.parametrize(
    "repair, workers, loop, resave",
    [
        pytest.param("epoch", 0, "epochs", None, id="epoch-not-restored"),
        pytest.param("forget", 0, "passes", None, id="loaded-state-kept"),
        pytest.param("settle", 0, "epochs", 0, id="start-reported-after-restore"),
        pytest.param("settle", 2, "epochs", 1, id="start-reported-by-an-idle-worker"),
    ],
)
def test_each_repair_is_needed(runs, monkeypatch, repair, workers, loop, resave):
    """Each repair switched off, the double resume of a plain stream goes wrong:
    the epoch not restored (the loop reads epoch 0 and datasets ignores the epoch-1
    state: epoch 0 is read again), the loaded state kept for every pass (a later pass
    starts where the resume did), the loader's report of the stream's start before the
    resumed pass draws, or by a worker that has not read since the restore (a save then
    records the start)."""
    if repair == "epoch":
        monkeypatch.setattr(loader_state, "dataset_epoch", lambda loader: None)
    elif repair == "forget":
        monkeypatch.setattr(loader_state, "forget_start_once_begun", lambda it, ds: None)
    else:
        monkeypatch.setattr(loader_state.ResumedPass, "settle", lambda self, state: state)
    loop_fn = _epochs(runs) if loop == "epochs" else _passes
    straight, resumed, _ = runs.compared(lambda: runs.make("stream", workers), loop_fn,
                                         resave=resave)  # fmt: skip
    assert resumed != straight


def test_datasets_own_shuffle_buffer_is_not_exact_and_is_warned(runs, caplog):
    """``.shuffle(buffer_size=16)``: datasets' state leaves the buffer out, so the resumed
    run draws other batches (examples dropped, order changed); every save says so, once
    in the log, naming the component and the dataset's type."""
    caplog.set_level(logging.WARNING, logger="unbroken")
    straight, resumed, warnings = runs.compared(lambda: runs.make("hf-shuffle"), _epochs(runs))
    assert resumed != straight
    notes = [w for w in warnings if "shuffled through a buffer" in w]
    assert len(notes) == 2  # the Checkpointers that saved: the stopped run, the first resume
    assert notes[0].startswith(
        "dataloader: its dataset (datasets.iterable_dataset.IterableDataset)"
    )
    assert "ShuffleBuffer" in notes[0]
    logged = [r for r in caplog.records if "shuffled through a buffer" in r.getMessage()]
    assert len(logged) == 2


def _pre_fix_state(monkeypatch):
    """datasets from 5.0 until the fix of datasets#8308: after a resume, the stream's
    reported state stays the one made before the load (its start) while iteration goes on."""
    prepare = datasets.IterableDataset._prepare_ex_iterable_for_iteration

    def stale(self, *args, **kwargs):
        start = self._starting_state_dict
        resuming = bool(start) and self.epoch == start["epoch"]
        before = copy.deepcopy(self._state_dict) if resuming else None
        ex_iterable = prepare(self, *args, **kwargs)
        if resuming:
            self._state_dict = {"examples_iterable": before["examples_iterable"],
                                "epoch": self.epoch}  # fmt: skip
        return ex_iterable

    monkeypatch.setattr(datasets.IterableDataset, "_prepare_ex_iterable_for_iteration", stale)


def _naive_double_resume(runs: Runs) -> tuple[list, list]:
    """Batches of a stream read straight, and stopped at 5, resumed, stopped at 10,
    resumed, passing the loader's own state_dict() (no unbroken)."""

    def take(loader, n):
        return [x.tolist() for _, (x, _) in zip(range(n), loader, strict=False)]

    straight = take(runs.make("stream")[0], 15)
    loader = runs.make("stream")[0]
    drawn, state = take(loader, 5), loader.state_dict()
    for n in (5, 5):
        loader = runs.make("stream")[0]
        loader.load_state_dict(state)
        drawn += take(loader, n)
        state = loader.state_dict()
    return straight, drawn


def test_a_stream_state_frozen_after_a_resume_is_warned(runs, monkeypatch):
    """The naive double resume (the loader's own state passed on) is exact with datasets
    5.2.0, and not with the state frozen as datasets#8308 left it: the second resume reads
    the stream from its start. Through unbroken the save after the first resume names it."""
    straight, drawn = _naive_double_resume(runs)
    assert drawn == straight  # the installed datasets has the fix
    _pre_fix_state(monkeypatch)
    straight, drawn = _naive_double_resume(runs)
    assert drawn[:10] == straight[:10] and drawn[10:] == straight[:5]
    straight, resumed, warnings = runs.compared(lambda: runs.make("stream"), _epochs(runs),
                                                stops=[5, 12])  # fmt: skip
    assert resumed != straight
    (note,) = [w for w in warnings if "stopped advancing" in w]
    assert note.startswith("dataloader: ") and "datasets#8308" in note


def test_persistent_workers_without_set_epoch_are_warned(runs):
    """With persistent_workers=True the workers keep the restored state for every pass of
    its epoch (datasets applies it, out of unbroken's reach): a loop without set_epoch()
    starts each later pass where the resume did. The save after such a pass says so."""
    straight, resumed, warnings = runs.compared(
        lambda: runs.make("stream", workers=1, persistent=True), _passes
    )
    assert resumed != straight
    notes = [w for w in warnings if "persistent_workers=True" in w]
    assert notes and notes[0].startswith("dataloader: ")


def test_the_page_names_what_the_code_warns_about():
    """The page's warning table names each warning the component gives."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations" / PAGE).read_text()
    for phrase in ("without `state_dict()`/`load_state_dict()`", ".shuffle(buffer_size=...)",
                   "persistent_workers=True", "datasets#8308"):  # fmt: skip
        assert phrase in text
