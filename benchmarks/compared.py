"""Each framework's own resume against ours, on the same training script: a run stopped
and resumed, compared bit for bit with one that never stopped.

    python benchmarks/compared.py                      # every framework: print the table
    python benchmarks/compared.py --write-docs         # and rewrite docs/integrations/compared.md
    python benchmarks/compared.py --only accelerate    # some frameworks only
    python benchmarks/compared.py --only megatron --write-docs
                                                       # its rows anew, the page's others kept
    python benchmarks/compared.py --quick --no-variants    # a smoke test: tiny data, few steps
    python benchmarks/compared.py --render docs/integrations/compared.md --write-docs
                                                       # the page again from its results

One training script per framework (``compared/{accelerate,lightning,trainer,deepspeed,
megatron}_run.py``), resumed by the framework's documented recipe (``--resume own``) or by
unbroken's integration (``--resume unbroken``); per case three fresh processes: straight,
stopped at step K, resumed; straight and resumed compared bit for bit (the page says how).
Megatron-Core's script runs itself on two processes (torchrun) and on the CPU through the
test-only shim ``tests/megatron_cpu.py``. Never asserts: it prints tables (a run that
fails, or does not stop at K, is an error).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file

from common import ROOT, git_revision, machine_info
from report import Page, add_options, bullets, kept, publish, shown_command, table
from unbroken.proof.runs import RunFailed, run
from unbroken.storage.locate import location

SCRIPTS = Path(__file__).with_name("compared")
sys.path.insert(0, str(SCRIPTS))  # their shared.py: the files and settings read back here
from shared import ACCUMULATE, BATCH_SIZE, FINAL, STEPS, STOP_AT_ENV  # noqa: E402

PAGE = Page(ROOT / "docs" / "integrations" / "compared.md")
MARKER = (
    "<!-- written by benchmarks/compared.py --write-docs: rerun it; edit by hand only its "
    "hand-written blocks -->"
)
RESULTS = "<!-- compared.py results (--render reads them): "


@dataclasses.dataclass(frozen=True)
class Framework:
    title: str
    script: str
    dist: str  # the distribution whose version the page shows


FRAMEWORKS = {  # the recipes themselves are described in the page, by hand
    "accelerate": Framework("Accelerate", "accelerate_run.py", "accelerate"),
    "lightning": Framework("Lightning", "lightning_run.py", "lightning"),
    "transformers": Framework("HF Trainer", "trainer_run.py", "transformers"),
    "deepspeed": Framework("DeepSpeed", "deepspeed_run.py", "deepspeed"),
    "megatron": Framework("Megatron-Core", "megatron_run.py", "megatron-core"),
}


@dataclasses.dataclass(frozen=True)
class Size:
    """How long every run trains, and where it stops."""

    steps: int
    every: int  # a save every this many steps
    stop_at: int
    rows: int  # 16 rows a batch, 2 batches a step
    logging: int  # the logging variant's logging_steps: the stop falls inside a window

    def args(self) -> list[str]:
        return ["--steps", str(self.steps), "--every", str(self.every), "--rows",
                str(self.rows)]  # fmt: skip


FULL = Size(steps=40, every=10, stop_at=20, rows=512, logging=3)
QUICK = Size(steps=10, every=3, stop_at=6, rows=128, logging=4)


@dataclasses.dataclass(frozen=True)
class Case:
    """One (framework, resume) pair; a variant runs it with another documented setting."""

    framework: str
    kind: str  # "own" | "unbroken"
    variant: str = ""  # a key of WHY; "" for the plain recipe
    setting: str = ""  # the variant's setting, as the table shows it
    args: tuple[str, ...] = ()

    @property
    def slug(self) -> str:
        return "-".join(x for x in (self.framework, self.kind, self.variant) if x)


def cases(frameworks: list[str], size: Size, *, variants: bool) -> list[Case]:
    """Per framework (in ``FRAMEWORKS``' order): its own resume, ours, then (with
    ``variants``) the recipes again with other documented settings."""
    logging = ("--logging-steps", str(size.logging))
    more = [
        Case("accelerate", "own", "seedable", "`use_seedable_sampler=True`",
             ("--loader", "seedable")),
        Case("accelerate", "own", "stateful", "`use_stateful_dataloader=True`, no skip",
             ("--loader", "stateful")),
        Case("transformers", "own", "logging", f"`logging_steps={size.logging}`", logging),
        Case("transformers", "unbroken", "logging", f"`logging_steps={size.logging}`",
             logging),
        Case("megatron", "own", "no_rng", "`--no-save-rng`", ("--no-save-rng",)),
    ]  # fmt: skip
    out = []
    for name in (f for f in FRAMEWORKS if f in frameworks):
        out += [Case(name, "own"), Case(name, "unbroken")]
        out += [c for c in more if c.framework == name] if variants else []
    return out


@dataclasses.dataclass
class Row:
    """One case's straight run against its resumed run."""

    framework: str
    kind: str
    variant: str
    setting: str
    tensors: int
    tensors_differing: int
    steps: int  # steps with a logged loss, straight or resumed
    steps_differing: int  # of those, steps whose logged losses differ
    first_loss: int | None  # the first step whose logged loss differs
    first_batch: int | None  # the first step whose inputs differ

    @property
    def identical(self) -> bool:
        return not (self.tensors_differing or self.steps_differing or self.first_batch is not None)


@dataclasses.dataclass
class Results:
    """One measurement: what the page shows, kept in it to render it again."""

    command: str
    seconds: float
    size: dict
    machine: dict
    versions: dict
    refs: dict  # name -> "package/file.py:line" in the installed sources
    rows: list[Row]
    # Later ``--only`` runs merged in (``merge``): per run its command, seconds,
    # frameworks, date, and the versions that differ from ``versions``.
    reruns: list[dict] = dataclasses.field(default_factory=list)

    @classmethod
    def read(cls, path: Path) -> Results:
        """From a page this script wrote."""
        text = path.read_text(encoding="utf-8")
        data = json.loads(text[text.index(RESULTS) + len(RESULTS) :].rsplit(" -->", 1)[0])
        return cls(**{**data, "rows": [Row(**r) for r in data["rows"]]})

    @classmethod
    def kept_in(cls, path: Path) -> Results | None:
        """The results kept in ``path``; None where there is no such page."""
        exists = path.is_file() and RESULTS in path.read_text(encoding="utf-8")
        return cls.read(path) if exists else None

    def json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


# Running ---------------------------------------------------------------------------------


class Runner:
    """Runs the cases' processes, at most ``jobs`` at a time, logs under ``work``."""

    def __init__(self, size: Size, work: Path, *, jobs: int, timeout: float) -> None:
        self.size, self.work, self.timeout = size, work, timeout
        self.gate = threading.BoundedSemaphore(jobs)
        self.env = {k: v for k, v in os.environ.items() if k != STOP_AT_ENV}
        self.env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")

    def launch(self, case: Case, folder: Path, which: str, env: dict[str, str]) -> None:
        script = SCRIPTS / FRAMEWORKS[case.framework].script
        command = [sys.executable, str(script), "{dir}", "--resume", case.kind,
                   *self.size.args(), *case.args]  # fmt: skip
        with self.gate:
            run(command, location(folder), env, self.work / case.slug / f"{which}.log",
                self.timeout)  # fmt: skip

    def case(self, case: Case) -> Row:
        """Straight and stopped side by side, then the resume; then compare."""
        base = self.work / case.slug
        base.mkdir(parents=True)
        straight, resumed = base / "straight", base / "resumed"
        stop_env = {**self.env, STOP_AT_ENV: str(self.size.stop_at)}
        with ThreadPoolExecutor(2) as pool:
            first = [pool.submit(self.launch, case, straight, "straight", self.env),
                     pool.submit(self.launch, case, resumed, "stopped", stop_env)]  # fmt: skip
        for done in first:
            done.result()
        self.check_stopped(case, resumed)
        self.launch(case, resumed, "resumed", self.env)
        return compare(case, straight, resumed, self.work / case.slug)

    def check_stopped(self, case: Case, folder: Path) -> None:
        logged = sorted(logged_steps(folder))
        wanted = list(range(1, self.size.stop_at + 1))
        if logged != wanted or (folder / FINAL).exists():
            raise RunFailed(
                f"{case.slug}: the stopped run did not stop at step {self.size.stop_at} "
                f"(logged steps {logged[:3]}...{logged[-3:]}, final state written: "
                f"{(folder / FINAL).exists()}); its log: {self.work / case.slug / 'stopped.log'}"
            )


def logged_steps(folder: Path) -> dict[int, list[dict]]:
    """Step -> what was logged at it, in order (a step logged twice has two entries)."""
    out: dict[int, list[dict]] = {}
    path = folder / STEPS
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    for line in lines:
        entry = json.loads(line)
        out.setdefault(entry["step"], []).append(entry)
    return out


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit for bit (a NaN equals the same NaN; 0.0 and -0.0 differ)."""
    if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def compare(case: Case, straight: Path, resumed: Path, logs: Path) -> Row:
    """Final tensors, logged losses and inputs of the straight run against the resumed."""
    final = {}
    for which, folder in (("straight", straight), ("resumed", resumed)):
        if not (folder / FINAL).exists():
            raise RunFailed(f"{case.slug}: the {which} run wrote no {FINAL}, so it did not "
                            f"train every step; its log: {logs / which}.log")  # fmt: skip
        final[which] = load_file(str(folder / FINAL))
    a, b = final["straight"], final["resumed"]
    names = sorted(a.keys() | b.keys())
    differing = [n for n in names if not same_bits(a.get(n), b.get(n))]
    sa, sb = logged_steps(straight), logged_steps(resumed)
    steps = sorted(sa.keys() | sb.keys())

    def field(log: dict[int, list[dict]], step: int, key: str) -> list:
        values = [e[key] for e in log.get(step, []) if key in e]
        return [float(v).hex() for v in values] if key == "loss" else values  # the bits

    with_loss = [s for s in steps if field(sa, s, "loss") or field(sb, s, "loss")]
    loss_diff = [s for s in with_loss if field(sa, s, "loss") != field(sb, s, "loss")]
    batch_diff = [s for s in steps if field(sa, s, "batch") != field(sb, s, "batch")]
    return Row(case.framework, case.kind, case.variant, case.setting, len(names),
               len(differing), len(with_loss), len(loss_diff), min(loss_diff, default=None),
               min(batch_diff, default=None))  # fmt: skip


def measure(selected: list[Case], size: Size, work: Path, *, jobs: int, timeout: float
            ) -> list[Row]:  # fmt: skip
    """Every case, ``jobs`` processes at a time; rows in the order of ``selected``."""
    runner = Runner(size, work, jobs=jobs, timeout=timeout)
    with ThreadPoolExecutor(len(selected)) as pool:
        futures = [pool.submit(runner.case, c) for c in selected]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise RunFailed("; ".join(str(e) for e in errors))
    return [f.result() for f in futures]


# Where the causes are, in the installed sources ------------------------------------------

# name -> (distribution's top package, file in it, a line that names the cause)
SOURCES = {
    "acc_rng": ("accelerate", "checkpointing.py", 'torch.set_rng_state(states["torch_manual_seed"])'),
    "acc_skip": ("accelerate", "data_loader.py", "def skip_first_batches("),
    "acc_epoch": ("accelerate", "data_loader.py", "self.set_epoch(self.iteration)"),
    "acc_seed": ("accelerate", "data_loader.py", "seed = self.epoch + self.initial_seed"),
    "acc_dl_state": ("accelerate", "checkpointing.py", "dataloader.load_state_dict(state_dict)"),
    "torch_shuffle": ("torch", "utils/data/sampler.py",
                      "seed = int(torch.empty((), dtype=torch.int64).random_().item())"),
    "torch_base_seed": ("torch", "utils/data/dataloader.py", "self._base_seed = ("),
    "td_fast_forward": ("torchdata", "stateful_dataloader/stateful_dataloader.py",
                        "# Fallback to fastforward"),
    "pl_dump": ("lightning", "pytorch/trainer/connectors/checkpoint_connector.py",
                "def dump_checkpoint("),
    "pl_loader_state": ("lightning", "pytorch/loops/fit_loop.py",
                        'state_dict["combined_loader"] = loader_states'),
    "tf_rng": ("transformers", "trainer.py", "if rng_to_sync:"),
    "tf_tr_loss": ("transformers", "trainer.py", "self._tr_loss = torch.tensor(0.0"),
    "tf_log": ("transformers", "trainer.py", 'logs["loss"] = tr_loss_scalar / ('),
    "ds_state": ("deepspeed", "runtime/engine.py", "def _common_checkpoint_state("),
    "mc_model": ("megatron", "core/transformer/module.py", "def sharded_state_dict("),
    "mc_main": ("megatron", "core/optimizer/optimizer.py",
                "state_dict['fp32_from_fp16_params'] = ["),
    "mc_step_save": ("megatron", "core/optimizer/optimizer.py",
                     "state_dict['optimizer']['state']['common_step'] = step"),
    "mc_step_load": ("megatron", "core/optimizer/optimizer.py",
                     "self._restore_common_per_param_step(state_dict[optimizer_key], common_step)"),
}  # fmt: skip


def source_refs() -> dict[str, str]:
    """Each cause as ``package/file.py:line`` in the installed package (no line where
    the text was not found: the package changed, and the page's "why" must be rechecked)."""
    refs = {}
    for name, (package, path, text) in SOURCES.items():
        spec = importlib.util.find_spec(package)
        roots = spec.submodule_search_locations if spec else None
        file = Path(roots[0]) / path if roots else None
        lines = file.read_text(encoding="utf-8").splitlines() if file and file.is_file() else []
        hit = next((i + 1 for i, line in enumerate(lines) if text in line), None)
        refs[name] = f"{package}/{path}" + (f":{hit}" if hit else " (line not found)")
    return refs


# The report ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Why:
    """What makes an own recipe's resume differ, or why it is exact (``{ref}``: SOURCES)."""

    short: str = ""  # the table's why column, for a row that differs
    long: str = ""  # the same with the places in the sources
    exact: str = ""  # shown instead for a row that is identical


WHY = {
    ("accelerate", "own", ""): Why(
        "the skipped loader reshuffles from the RNG as restored at K: other batches",
        "`load_state` puts back the global torch RNG as it was at step K ({acc_rng}); "
        "`skip_first_batches` builds a new loader over the batch sampler ({acc_skip}), and "
        "its iterator draws the epoch's permutation anew: a `RandomSampler` without a "
        "generator seeds it from the global RNG ({torch_shuffle}), now in its step-K state "
        "instead of the state it had when the epoch began. The batches after the stop are "
        "other rows, and the dropout masks move too (each new iterator also draws a base "
        "seed from the global RNG, {torch_base_seed}).",
    ),
    ("accelerate", "own", "seedable"): Why(
        "the loader's epoch is not saved: epoch 0's shuffle again after the resume",
        "The shuffle is seeded by `initial_seed + epoch` ({acc_seed}), and the epoch is "
        "the loader's `iteration` counter ({acc_epoch}), which `save_state` does not keep "
        "and `skip_first_batches` copies from the fresh loader (0): a resume in a later "
        "epoch gets epoch 0's order.",
    ),
    ("accelerate", "own", "stateful"): Why(
        "the position is restored, but the shuffle is redrawn from the restored RNG",
        "`load_state` gives the loader its saved position ({acc_dl_state}); torchdata "
        "fast-forwards a sampler without state of its own by iterating it again from the "
        "start ({td_fast_forward}), and a `RandomSampler` then draws another permutation "
        "from the global RNG ({torch_shuffle}), so the rest of the epoch comes in another "
        "order.",
    ),
    ("lightning", "own", ""): Why(
        "no RNG state in the checkpoint: other dropout masks (same batches)",
        "A Lightning checkpoint holds the loops' progress and the `StatefulDataLoader`'s "
        "position ({pl_loader_state}), so the resumed run trains on the same batches, but "
        "no RNG state ({pl_dump} builds it without one): the dropout masks after the "
        "resume come from the generator as seeded at process start.",
    ),
    ("transformers", "own", ""): Why(
        exact="The Trainer saves and restores the RNGs (after it has drawn the first "
        "resumed batches, {tf_rng}) and skips the epoch's trained batches in the seeded "
        "order; with every step logged, each logged loss is its own step's. The "
        "`logging_steps` row shows where its logged loss goes wrong.",
    ),
    ("transformers", "own", "logging"): Why(
        "the logged-loss sum restarts at the resume: the next logged loss averages fewer steps",
        "The logged loss is a sum kept between logging steps; `train()` sets it to zero and "
        "the last logged step to the resumed one ({tf_tr_loss}), and logs the sum divided "
        "by the steps since then ({tf_log}). When the checkpoint falls inside a logging "
        "window (`save_steps` not a multiple of `logging_steps`), the first loss logged "
        "after the resume averages only the steps since the resume: the weights are "
        "identical, the logged loss is not. unbroken keeps that sum and its step "
        "(`trainer_loop`).",
    ),
    ("deepspeed", "own", ""): Why(
        "no RNG state in the checkpoint: other dropout masks (same batches)",
        "A DeepSpeed checkpoint holds the module, the ZeRO optimizer's partitions, the LR "
        "scheduler, the engine's counters and the client state ({ds_state}), but no RNG "
        "state: the resumed run trains on the same batches (the skip is the script's, the "
        "sampler seeded by its epoch), with dropout masks drawn from the generator as "
        "seeded at process start.",
    ),
    ("megatron", "own", ""): Why(
        "the new loader iterator draws a seed from the RNG just restored: other dropout masks",
        "The checkpoint holds what Megatron-LM's `save_checkpoint` puts in it: the model's "
        "sharded state ({mc_model}), the optimizer's fp32 main weights ({mc_main}) and Adam "
        "moments, Adam's step saved once as `common_step` ({mc_step_save}) and copied back "
        "to every parameter on load ({mc_step_load}), the scheduler, the iteration, and the "
        "RNG states (data-parallel rank 0's, loaded on every rank: right here, where both "
        "ranks draw the same numbers). What differs is one draw: after the load the resumed "
        "run starts a data-loader iterator, which takes its base seed from the global "
        "generator ({torch_base_seed}), now in its step-K state; the straight run took that "
        "number when the epoch began. The batches are the same, the dropout masks after the "
        "resume are shifted by one draw. Measured: with a generator of its own for the "
        "loader (`DataLoader(generator=torch.Generator())`) the same recipe comes out "
        "identical, and so does a stop at the end of an epoch (`--quick`), where the "
        "straight run starts a new iterator too.",
    ),
    ("megatron", "own", "no_rng"): Why(
        "no RNG state in the checkpoint: other dropout masks (same batches)",
        "Megatron-Core's `sharded_state_dict` methods hold the model ({mc_model}) and the "
        "optimizer ({mc_main}, {mc_step_save}), no generator state: without the RNG states "
        "Megatron-LM adds (its `--no-save-rng`), the resumed run trains on the same batches "
        "(the skip is the script's, the sampler seeded by its epoch) with dropout masks "
        "drawn from the generator as seeded at process start.",
    ),
}
UNEXPECTED = "unexpected: a bug in unbroken's integration (rerun with --workdir to keep the runs)"


def _step(step: int | None) -> str:
    return "-" if step is None else str(step)


def _resume(row: Row) -> str:
    kind = "own" if row.kind == "own" else "unbroken"
    return f"{kind}, {row.setting}" if row.setting else kind


def _why(row: Row, *, long: bool, refs: dict[str, str] | None = None) -> str:
    """The cause of a difference (or why a row is exact, ``long`` only)."""
    why = WHY.get((row.framework, row.kind, row.variant), Why())
    if row.identical:
        text = why.exact if long else ""
    elif row.kind == "unbroken":
        text = UNEXPECTED
    else:
        text = (why.long if long else why.short) or "not analysed yet"
    return text.format(**(refs or {})) if long else text or "-"


def summary_table(results: Results) -> str:
    headers = ["framework", "resume", "tensors differing", "first differing step (loss)",
               "first differing step (inputs)", "logged losses differing", "verdict"]  # fmt: skip
    rows = []
    for r in results.rows:
        cells = [FRAMEWORKS[r.framework].title, _resume(r),
                 f"{r.tensors_differing} of {r.tensors}", _step(r.first_loss),
                 _step(r.first_batch), f"{r.steps_differing} of {r.steps}",
                 "IDENTICAL" if r.identical else "DIFFERENT", _why(r, long=False)]  # fmt: skip
        rows.append(cells)
    return table([*headers, "why"], rows)


def tally(results: Results) -> str:
    """How many rows of each kind resumed exactly, in one sentence."""
    counts = []
    for kind, who in (("unbroken", "unbroken's"), ("own", "the frameworks' own")):
        rows = [r for r in results.rows if r.kind == kind]
        counts.append(f"{who} in {sum(r.identical for r in rows)} of {len(rows)} rows")
    return f"Resumes IDENTICAL to the straight run: {', '.join(counts)}."


def versions() -> dict[str, str]:
    """Python and the versions of everything the runs import that decides the outcome."""
    out = {"python": sys.version.split()[0]}
    dists = ["torch", *(f.dist for f in FRAMEWORKS.values()), "torchdata", "unbroken"]
    for dist in dists:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    out["unbroken"] += f", revision {git_revision(str(ROOT))}"
    return out


def complete(results: Results) -> bool:
    """Every framework, variant and step: what the committed page must show."""
    wanted = {
        (c.framework, c.kind, c.variant) for c in cases(list(FRAMEWORKS), FULL, variants=True)
    }
    have = {(r.framework, r.kind, r.variant) for r in results.rows}
    return have == wanted and results.size == dataclasses.asdict(FULL)


def merge(kept: Results, new: Results) -> Results:
    """``kept`` with the rows of the frameworks ``new`` measured replaced by ``new``'s: what
    ``--only NAME --write-docs`` writes into a page that already holds every framework.
    ``kept``'s command, machine and versions stay the page's; ``new``'s run is listed
    after it (with the versions that differ), replacing earlier reruns of the same
    frameworks."""
    if kept.size != new.size:
        raise ValueError(f"the kept results are of another size ({kept.size}), not {new.size}")
    measured = {r.framework for r in new.rows}
    canonical = [(c.framework, c.kind, c.variant)
                 for c in cases(list(FRAMEWORKS), Size(**new.size), variants=True)]  # fmt: skip

    def order(row: Row) -> int:
        key = (row.framework, row.kind, row.variant)
        return canonical.index(key) if key in canonical else len(canonical)

    rows = [r for r in kept.rows if r.framework not in measured] + new.rows
    differing = {k: v for k, v in new.versions.items() if kept.versions.get(k, v) != v}
    rerun = {"command": new.command, "seconds": new.seconds,
             "frameworks": [f for f in FRAMEWORKS if f in measured],
             "date": new.machine.get("date", ""), "versions": differing}  # fmt: skip
    earlier = [r for r in kept.reruns if not set(r["frameworks"]) <= measured]
    return dataclasses.replace(
        kept, versions={**new.versions, **kept.versions}, refs=new.refs,
        rows=sorted(rows, key=order), reruns=[*earlier, rerun],
    )  # fmt: skip


def generated(results: Results) -> str:
    """Which command wrote the page, and which later ones replaced some of its rows."""
    text = f"Generated by `{results.command}` in {results.seconds / 60:.1f} minutes"
    for rerun in results.reruns:
        titles = ", ".join(FRAMEWORKS[f].title for f in rerun["frameworks"])
        changed = "; ".join(f"{k} {v}" for k, v in rerun["versions"].items())
        text += (f"; the {titles} rows since by `{rerun['command']}` in "
                 f"{rerun['seconds'] / 60:.1f} minutes ({rerun['date']}"
                 + (f"; {changed}" if changed else "") + ")")  # fmt: skip
    return text + "."


def text_report(results: Results) -> str:
    size = results.size
    return "\n".join([
        f"Resumed at step {size['stop_at']} vs never stopped, {size['steps']} steps:", "",
        summary_table(results), "", tally(results), "",
        "versions: " + "; ".join(f"{k} {v}" for k, v in results.versions.items()),
    ])  # fmt: skip


def page(results: Results) -> str:
    """All of docs/integrations/compared.md."""
    size, refs = results.size, results.refs
    per_epoch = size["rows"] // BATCH_SIZE // ACCUMULATE

    def where(steps_an_epoch: int) -> str:
        epoch, into = divmod(size["stop_at"], steps_an_epoch)
        return f"{into} steps into epoch {epoch}" if into else f"at the end of epoch {epoch - 1}"

    whys = []
    for r in results.rows:
        if r.kind == "own" or not r.identical:
            verdict = "identical on this script" if r.identical else "differs"
            text = _why(r, long=True, refs=refs)
            whys.append(f"- **{FRAMEWORKS[r.framework].title}, {_resume(r)}**: {verdict}."
                        + (f" {text}" if text else ""))  # fmt: skip
    return "\n".join([
        "# Resumed vs never stopped: each framework's own resume and unbroken's",
        "",
        MARKER,
        generated(results),
        "",
        "One training script per framework (an MLP with dropout learning a smooth function, "
        "data shuffled every epoch, AdamW with a warm-up schedule, two micro-batches per "
        "optimizer step), resumed two ways: by the framework's own documented recipe and by "
        "unbroken's integration. For each, one run trains straight through; another is "
        f"stopped at step K = {size['stop_at']} of {size['steps']} ({where(per_epoch)}, epochs "
        "counted from 0) right after its save, then resumed in a fresh process. Compared bit "
        "for bit: "
        "the final model and optimizer tensors, every logged loss, and the inputs each step "
        "trained on. Rows with a setting run the same script with another documented "
        "setting. Megatron-Core's script trains the same MLP as a Megatron model chunk in "
        "bf16 on two data-parallel processes (torchrun, gloo), on the CPU through the "
        "test-only shim `tests/megatron_cpu.py` (Megatron-Core needs CUDA): not a GPU run. "
        f"Its two ranks share each epoch's rows, so its epochs are {per_epoch // 2} steps "
        f"(K is {where(per_epoch // 2)}).",
        "",
        summary_table(results),
        "",
        tally(results),
        "",
        "## Why",
        "",
        "Each own row, with the places in the installed sources (paths under "
        "site-packages).",
        "",
        *whys,
        "",
        kept("recipes", PAGE.path),
        "",
        "## How it is measured",
        "",
        f"- {size['rows']} rows, batches of {BATCH_SIZE}, {ACCUMULATE} micro-batches per "
        "optimizer step: "
        f"{per_epoch} steps an epoch; {size['steps']} steps; a save every {size['every']} "
        f"steps; the stop at step {size['stop_at']} (`UNBROKEN_STOP_AT`: ours stops through "
        "`Checkpointer.should_stop`, the own recipes check it after their save).",
        "- Three fresh processes per row: straight, stopped, resumed (in the stopped run's "
        "folder). One CPU thread each, so a run is deterministic and runs once.",
        "- *tensors differing*: the final `model.state_dict()` and the optimizer's state "
        "tensors (AdamW's `step`, `exp_avg`, `exp_avg_sq`; DeepSpeed and Megatron-Core: "
        "the fp32 main weights too), compared byte for byte. AdamW's "
        "`step` counters (one per parameter) agree whenever the number of steps does, so a "
        "row whose every other tensor differs still counts them as equal.",
        "- *first differing step (loss)*: the first step whose logged loss differs (its "
        "float bits); *(inputs)*: the first step whose micro-batches' inputs differ "
        "(SHA-256 of their bytes): a wrong data position shows there, a lost RNG state "
        "only in the losses and tensors.",
        "",
        "## Versions and machine",
        "",
        *bullets(results.versions),
        *bullets(results.machine),
        "",
        f"{RESULTS}{results.json()} -->",
        "",
    ])  # fmt: skip


# Main ------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--only", nargs="+", choices=list(FRAMEWORKS), default=list(FRAMEWORKS), metavar="NAME")
    add("--quick", action="store_true", help="tiny data, few steps: a smoke test")
    add("--variants", action=argparse.BooleanOptionalAction, default=True, help="other settings")
    add("--jobs", type=int, default=os.cpu_count() or 1, help="training processes at a time")
    add("--timeout", type=float, default=600, help="seconds per run")
    add("--workdir", type=Path, help="keep the runs here (default: a temp folder)")
    add("--render", type=Path, metavar="PAGE", help="report the results kept in PAGE; no runs")
    add_options(parser, PAGE)
    args = parser.parse_args()
    docs = Path(args.write_docs) if args.write_docs else None
    real_page = docs is not None and docs.resolve() == PAGE.path
    if real_page and (args.quick or not args.variants) and not args.render:
        parser.error(f"--write-docs into {PAGE.path} needs every variant and step: drop "
                     "--quick and --no-variants, or give it another PATH")  # fmt: skip
    if args.render:
        results = Results.read(args.render)
    else:
        results = _measure(args, QUICK if args.quick else FULL)
        if results is None:
            return 1
        some = set(args.only) != set(FRAMEWORKS)
        kept = Results.kept_in(docs) if docs is not None and some else None
        if kept is not None and kept.size == results.size:
            results = merge(kept, results)  # the page keeps the other frameworks' rows
    if real_page and not complete(results):
        print(f"not written: {PAGE.path} shows every framework, variant and step (run "
              "without --quick, --only, --no-variants, or give --write-docs a PATH)",
              file=sys.stderr)  # fmt: skip
        docs = None
    publish(text_report(results), lambda: page(results), PAGE, show=args.markdown, page=docs)
    return 0


def _measure(args: argparse.Namespace, size: Size) -> Results | None:
    work = args.workdir or Path(tempfile.mkdtemp(prefix="unbroken-compared-"))
    selected = cases(args.only, size, variants=args.variants)
    print(f"{len(selected)} cases, 3 runs each, {args.jobs} at a time; runs in {work}",
          flush=True)  # fmt: skip
    started = time.perf_counter()
    try:
        rows = measure(selected, size, work, jobs=args.jobs, timeout=args.timeout)
    except RunFailed as exc:
        print(f"RunFailed: {exc}\n(runs kept in {work})", file=sys.stderr)
        return None
    seconds = time.perf_counter() - started
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    info = machine_info(tempfile.gettempdir())
    machine = {k: info[k] for k in ("date", "cpu", "memory", "os")}
    command = shown_command("compared.py", sys.argv[1:])
    return Results(command, seconds, dataclasses.asdict(size), machine, versions(),
                   source_refs(), rows)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
