"""The fingerprints of loaded tensors (issue 15, restore speed): every tensor is checked
exactly once against the manifest, whichever thread computes it; when the reads are over
the restoring thread takes the fingerprint worker's backlog instead of waiting on it."""

from __future__ import annotations

import threading
from collections import Counter

import torch

from unbroken.core import verify
from unbroken.format import fingerprint


def test_the_restoring_thread_takes_the_backlog_and_every_tensor_is_checked_once(monkeypatch):
    """F4/F5 still caught (a loaded value unlike the saved one is named) while the work is
    shared: with the worker held up, the calling thread fingerprints what it had queued."""
    torch.manual_seed(0)
    tensors = {f"t{i}": torch.randn(3000) for i in range(8)}
    entries = {k: {"fingerprint": fingerprint.fingerprint(t)} for k, t in tensors.items()}
    entries["t5"]["fingerprint"] = "0" * 16  # what a damaged or mis-installed value shows
    computed: Counter[str] = Counter()
    by_caller = Counter()
    release = threading.Event()
    real = verify.held_partial

    def traced(t, algorithm, key=""):
        worker = threading.current_thread().name.startswith("unbroken-fp")
        if worker:
            release.wait(10)  # held until the calling thread has taken its share
        key = next(k for k, v in tensors.items() if v is t)
        computed[key] += 1
        by_caller[worker] += 1
        return real(t, algorithm, key)

    monkeypatch.setattr(verify, "held_partial", traced)
    loaded = verify.LoadedFingerprints(tensors, fingerprint.ALGORITHM)
    for key in tensors:
        loaded.loaded(key)
    timer = threading.Timer(0.5, release.set)
    timer.start()
    try:
        problems = loaded.check(entries)
    finally:
        release.set()
        timer.cancel()
    assert problems == ["t5: the loaded value does not match its saved fingerprint"]
    assert computed == Counter(dict.fromkeys(tensors, 1))
    assert by_caller[False] >= len(tensors) - 1  # the worker had started one at most
    for key, t in tensors.items():
        assert loaded.partials[key] == real(t, fingerprint.ALGORITHM), key
