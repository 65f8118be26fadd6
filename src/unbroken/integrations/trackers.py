"""TensorBoard and W&B trackers for ``Checkpointer(..., trackers=[...])``.

Each forwards the metrics given to ``Checkpointer.track`` (rank 0 only) so that every
step is logged once, crashes and recomputed steps included, and logs the replay check's
verdict after a resume. ``tensorboard`` and ``wandb`` are imported when a tracker starts,
never by ``import unbroken`` (or this module); a tracker made without its package raises
``ImportError`` at once, on every rank alike. The protocol a tracker of your own follows
is :class:`Tracker` (``unbroken.run.trackers``). See docs/integrations/trackers.md.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

from ..run.replay_check import ReplayVerdict
from ..run.trackers import Tracker

__all__ = ["TensorBoardTracker", "Tracker", "WandbTracker"]


def _require(package: str, who: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{who} needs the {package} package: pip install {package}")


class TensorBoardTracker:
    """Writes tracked metrics as TensorBoard scalars into ``log_dir`` (one run per folder).

    Each value is kept exactly, as a float64 (``add_scalar(..., new_style=True,
    double_precision=True)``): read it back as the TensorBoard server does, with
    ``plugin_event_accumulator.EventAccumulator(...).Tensors(name)`` (the older
    ``event_accumulator`` ignores ``purge_step`` for such tensor summaries).
    Every step is flushed to the event file as it is logged, so a crash loses nothing
    forwarded. A start (fresh, or a resume from step S) opens a new event file with
    ``purge_step=S + 1``: TensorBoard then hides the events of earlier files at steps
    after S, which the run recomputes. Texts are written under their tag as named
    (``SummaryWriter.add_text`` would append ``/text_summary``). The replay verdict is a
    text (``unbroken/replay``) and, once identical or different, a scalar
    (``unbroken/replay_identical``: 1.0 or 0.0) at the step it was decided; the run id
    is a text (``unbroken/run``) at step S + 1.

    Args:
        log_dir: the event files' folder (the same for every process of the run).
        **writer_kwargs: passed to ``SummaryWriter`` (not ``purge_step``: set here).
    Raises:
        ImportError: tensorboard is not installed.
        ValueError: ``purge_step`` given.

    Example::

        ckpt = ub.Checkpointer("ckpts/run1", model=model, optimizer=opt,
                               trackers=[TensorBoardTracker("tb/run1")])
    """

    def __init__(self, log_dir: str | os.PathLike, **writer_kwargs: Any) -> None:
        _require("tensorboard", "TensorBoardTracker")
        if "purge_step" in writer_kwargs:
            raise ValueError("TensorBoardTracker sets purge_step from the resume; drop it")
        self.log_dir = os.fspath(log_dir)
        self._kwargs = writer_kwargs
        self.writer: Any = None  # the SummaryWriter, once started

    def start(self, run_id: str, resume_step: int, tracked_upto: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.log_dir, purge_step=resume_step + 1, **self._kwargs)
        how = f"resumed from step {resume_step}" if resume_step else "started"
        self._text("unbroken/run", f"run {run_id} {how}", resume_step + 1)
        self.writer.flush()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step, new_style=True, double_precision=True)
        self.writer.flush()

    def verdict(self, step: int, verdict: ReplayVerdict) -> None:
        self._text("unbroken/replay", str(verdict), step)
        if verdict.identical is not None:
            self.writer.add_scalar("unbroken/replay_identical", float(verdict.identical), step)
        self.writer.flush()

    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()

    def _text(self, tag: str, text: str, step: int) -> None:
        """A text summary whose tag reads back as ``tag``: ``SummaryWriter.add_text``
        writes ``tag + "/text_summary"`` (torch's ``summary.text``), which is the tag
        TensorBoard and its readers then show."""
        from tensorboard.plugins.text.summary_v2 import text_pb

        self.writer.file_writer.add_summary(text_pb(tag, text), step)


class WandbTracker:
    """Logs tracked metrics to a Weights & Biases run whose id is ``Checkpointer.run_id``.

    ``wandb.init(id=run_id, resume="allow", **init_kwargs)``: a resumed job continues the
    same W&B run. W&B only appends (wandb-core drops a step below the run's current one,
    "Tried to log to step ... less than the current step", and its uploader moves such a
    row to the next free step), so after a resume the steps up to the last one the run
    had tracked before (``tracked_upto``, and online also those the server already
    holds) are not logged again: W&B keeps the values the earlier process sent, and the
    replay check compares the recomputed ones with them bit for bit. Its verdict goes
    into the run's summary: ``unbroken/replay`` (the status),
    ``unbroken/replay_from_step`` and ``unbroken/replay_detail``. Each step is logged
    once it is complete, every metric tracked for it in one row (a step tracked in two
    calls, a loss then an evaluation, included), with ``commit=True``, so wandb-core
    holds no half-made row (a second row for a committed step would be dropped).

    What wandb-core had not written when the process was killed (SIGKILL, the OOM
    killer) is lost: offline, up to 15 s of rows (its transaction-log flush interval);
    online, what its stream had not sent. Those steps stay missing (never doubled); a
    detached wandb-core survives the kill (docs/integrations/trackers.md).

    The run is ``tracker.run`` once started (log anything else there). Do not call
    ``wandb.init`` yourself first: in a script, wandb 0.31 then returns that run instead
    of one with the run id (``reinit="return_previous"``), which :meth:`start` refuses.

    Args:
        project: the W&B project.
        **init_kwargs: passed to ``wandb.init`` (``mode="offline"``, ``dir``,
            ``entity``, ``config``...), not ``id``, ``resume``, ``resume_from`` or
            ``fork_from``: those follow from the run.
    Raises:
        ImportError: wandb is not installed.
        ValueError: one of the arguments set here given.

    Example::

        ckpt = ub.Checkpointer("ckpts/run1", model=model, optimizer=opt,
                               trackers=[WandbTracker(project="gpt")])
    """

    def __init__(self, *, project: str | None = None, **init_kwargs: Any) -> None:
        _require("wandb", "WandbTracker")
        taken = sorted({"id", "resume", "resume_from", "fork_from"} & set(init_kwargs))
        if taken:
            raise ValueError(
                f"WandbTracker sets {', '.join(taken)} from the run (id=Checkpointer.run_id, "
                'resume="allow"); drop them'
            )
        self._init = {"project": project, **init_kwargs} if project else dict(init_kwargs)
        self.run: Any = None  # the wandb Run, once started
        self._logged_upto = 0  # steps up to here are in the W&B run already

    def start(self, run_id: str, resume_step: int, tracked_upto: int) -> None:
        import wandb

        self.run = wandb.init(id=run_id, resume="allow", **self._init)
        if self.run.id != run_id:  # another run was active: wandb returned it
            found, self.run = self.run.id, None
            raise RuntimeError(
                f"wandb.init returned the active run {found} instead of run {run_id}: do "
                "not call wandb.init yourself (log through WandbTracker.run), or pass "
                'reinit="create_new" to WandbTracker'
            )
        held = int(getattr(self.run, "starting_step", 0) or 0)  # online: the server's next
        self._logged_upto = max(tracked_upto, held - 1)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if step > self._logged_upto:
            self.run.log(dict(metrics), step=step, commit=True)

    def verdict(self, step: int, verdict: ReplayVerdict) -> None:
        self.run.summary.update(
            {
                "unbroken/replay": verdict.status,
                "unbroken/replay_from_step": verdict.from_step,
                "unbroken/replay_detail": str(verdict),
            }
        )

    def close(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish()
