"""A shuffle buffer for streamed datasets whose content is saved with the stream's position.

Hugging Face ``datasets`` shuffles a stream through a buffer
(``IterableDataset.shuffle(buffer_size=...)``) but its ``state_dict()`` keeps only the
stream's position, not the buffer: a resume drops up to ``buffer_size`` examples and
shuffles the rest differently. :class:`ShuffleBuffer` keeps the buffer's rows and its
random generator in its own ``state_dict()``, beside the stream's, so a torchdata
``StatefulDataLoader`` over it resumes with the very rows the stopped run would have
drawn next (docs/integrations/datasets.md). It imports neither ``datasets`` nor
torchdata: any stream with ``state_dict()``/``load_state_dict()``, ``set_epoch()`` and
``epoch`` works.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["ShuffleBuffer"]


class ShuffleBuffer(torch.utils.data.IterableDataset):
    """Shuffles a stream through a buffer saved with the stream's position.

    Each pass fills the buffer to ``buffer_size`` rows, then yields a row drawn at random
    from it for each row read, and empties it at the stream's end. The random stream of
    a pass comes from ``(seed, epoch, worker id)``, so every pass, epoch and loader
    worker shuffles differently and reproducibly. ``state_dict()`` holds the stream's
    state, the buffer's rows and the generator's state: they go into the checkpoint's
    manifest as JSON, so keep ``buffer_size`` times a row's size small (token ids or
    short text, not images), and rows must be JSON values (dicts, lists, strings,
    numbers).

    Not thread-safe: one pass at a time, as a ``DataLoader`` (or each of its workers,
    with a copy of its own) iterates it.

    Args:
        stream: the rows, e.g. a ``datasets.IterableDataset`` (``streaming=True``); it
            must have ``state_dict()``, ``load_state_dict()``, ``set_epoch()`` and
            ``epoch``.
        buffer_size: rows held to draw from (>= 1).
        seed: the seed of every pass's random stream.

    Raises:
        ValueError: ``buffer_size`` below 1.

    Example::

        from unbroken.integrations.datasets import ShuffleBuffer

        stream = load_dataset("json", data_files="data/*.jsonl", split="train",
                              streaming=True)
        data = ShuffleBuffer(stream, buffer_size=1024, seed=0)
        loader = StatefulDataLoader(data, batch_size=8)
        ckpt = ub.Checkpointer("ckpts/run1", model=model, dataloader=loader)
    """

    def __init__(self, stream: Any, buffer_size: int, seed: int) -> None:
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"buffer_size must be an int >= 1, got {buffer_size!r}")
        self.stream, self.buffer_size, self.seed = stream, buffer_size, seed
        self.buffer: list[Any] = []
        self.rng: np.random.Generator | None = None
        self.restored: dict[str, Any] | None = None

    @property
    def epoch(self) -> int:
        """The stream's epoch (saved and set again by the Checkpointer)."""
        return self.stream.epoch

    def set_epoch(self, epoch: int) -> None:
        """Start the next pass in ``epoch`` (datasets reshuffles its shards by epoch)."""
        self.stream.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self.restored is None:  # a new pass: an empty buffer, a new random stream
            worker = torch.utils.data.get_worker_info()
            self.buffer = []
            self.rng = np.random.default_rng([self.seed, self.epoch, worker.id if worker else 0])
        else:  # the pass a checkpoint stopped in: its buffer, random stream and position
            self.stream.load_state_dict(self.restored["stream"])
            self.buffer = list(self.restored["buffer"])
            self.rng = np.random.default_rng()
            self.rng.bit_generator.state = self.restored["rng"]
            self.restored = None
        for row in self.stream:
            self.buffer.append(row)
            if len(self.buffer) >= self.buffer_size:
                yield self._draw()
        while self.buffer:
            yield self._draw()

    def _draw(self) -> Any:
        assert self.rng is not None  # set by __iter__ before any draw
        i = int(self.rng.integers(len(self.buffer)))
        self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
        return self.buffer.pop()

    def state_dict(self) -> dict[str, Any]:
        """The stream's state, the buffer's rows and the random stream's state."""
        if self.restored is not None:  # restored, not iterated yet
            return self.restored
        rng = None if self.rng is None else self.rng.bit_generator.state
        return {"stream": self.stream.state_dict(), "buffer": list(self.buffer), "rng": rng}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` at the next pass (a state saved before any pass began
        starts a fresh one)."""
        self.restored = state if state["rng"] is not None else None
