"""Per-rank random number generator state: Python, NumPy, torch CPU and CUDA.

Captured as a plain state dict (tensors and JSON values), so it is saved like any other
component and never pickled.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..errors import CorruptCheckpointError


class RNGState:
    """The ``rng`` component: a ``Stateful`` view of this process's generators."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state: dict[str, Any] = {
            "python": {"version": version, "state": list(internal), "gauss_next": gauss},
            "numpy": {
                "kind": kind,
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.uint32).view(np.int32)).clone(),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            },
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set every generator, or none: a malformed state (a damaged or hostile manifest)
        is refused before any generator changes.

        Raises:
            CorruptCheckpointError: the state is not one :meth:`state_dict` returns.
        """
        try:
            py = state["python"]
            python = (py["version"], tuple(py["state"]), py["gauss_next"])
            random.Random().setstate(python)  # each is tried on a throwaway generator first
            npy = state["numpy"]
            keys = npy["keys"].numpy().view(np.uint32)
            legacy = (npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
            np.random.RandomState().set_state(legacy)
            torch.Generator().set_state(state["torch"])
        except (
            LookupError,
            TypeError,
            ValueError,
            ArithmeticError,
            AttributeError,
            RuntimeError,
        ) as exc:
            raise CorruptCheckpointError(
                f"the saved rng state is malformed ({type(exc).__name__}: {exc}); the "
                "checkpoint is damaged"
            ) from None
        random.setstate(python)
        np.random.set_state(legacy)
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            cuda_states = state["cuda"]
            if len(cuda_states) != torch.cuda.device_count():
                raise ValueError(
                    f"the checkpoint has CUDA RNG state for {len(cuda_states)} devices, "
                    f"this process sees {torch.cuda.device_count()}"
                )
            torch.cuda.set_rng_state_all(cuda_states)


@contextlib.contextmanager
def preserved() -> Iterator[None]:
    """Leave every generator as it was, whatever the body draws (used around probes)."""
    rng = RNGState()
    saved = rng.state_dict()
    saved["torch"] = saved["torch"].clone()
    try:
        yield
    finally:
        rng.load_state_dict(saved)
