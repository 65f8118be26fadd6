"""Memory bounded by the checkpoint's real size (issue 12, item 3).

A re-sealed manifest could claim a world size of millions, be padded far beyond what its
checkpoint needs (parsing JSON takes up to ~26x its size in memory), or describe a huge
tensor in a sparse shard file that takes a few KiB on disk. Each is refused before the
memory is spent. Peak RSS growth is measured in a forked child with
``/proc/self/status`` (VmHWM, reset before each step: a memory figure, not a timing
one).
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import tamper
import unbroken as ub
from conftest import Problem
from unbroken.tools.verification import verify_folder as audit

LIMIT_MB = 32  # each hostile checkpoint below cost 70-310 MB before the bounds


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field))


def _restore(folder: Path) -> str:
    try:
        Problem(seed=3).checkpointer(folder.parent).restore(step=1)
        return "restored"
    except ub.CheckpointError as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"


def _verify(folder: Path) -> str:
    return "; ".join(f.message[:300] for f in audit(folder).failures[:2])


def _peak_growth(op: Callable[[Path], str], folder: Path) -> tuple[float, str]:
    """Peak RSS growth (MB) while ``op(folder)`` runs in a forked child, so that each
    step starts from the same memory; VmHWM is reset to the current RSS first (the peak
    of ru_maxrss is inherited across fork and exec)."""
    read, write = os.pipe()
    if os.fork() == 0:  # the child: measure, report through the pipe, leave at once
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            before = _status("VmRSS:")
            verdict = op(folder)
            out = [_status("VmHWM:") - before, verdict]
        except BaseException:
            out = [0.0, "crashed: " + traceback.format_exc()[-600:]]
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        grown, verdict = json.loads(f.read() or '[0, "no report"]')
    os.wait()
    return grown, verdict


def _saved(root: Path) -> Path:
    p = Problem()
    ckpt = p.checkpointer(root, keep_last=None)
    p.step()
    ckpt.save(1)
    ckpt.close()
    return root / "step_00000001"


def _huge_world(folder: Path) -> None:
    # Within the cap: refused as one rank's files describe one rank (10**9 took over 6 GB
    # before).
    tamper.edit(folder, lambda doc: doc.update(world_size=1_000_000))


def _padded_manifest(folder: Path) -> None:
    doc = tamper.read(folder)
    doc["metrics"] = "PAD"  # 12 MB of JSON that parses into ~290 MB (parsed before the
    pad = "[" + ",".join(["{}"] * 4_000_000) + "]"  # checksum is checked: no need to seal)
    (folder / "manifest.json").write_text(json.dumps(doc).replace('"PAD"', pad))


def _sparse_shard(folder: Path) -> None:
    doc = tamper.read(folder)
    shard = folder / "rank_00000.bin"
    end = shard.stat().st_size
    numel = 64 * 2**20  # 256 MiB of float32, in a file that takes a few KiB on disk
    entry = doc["tensors"]["optimizer/state/inp.bias/step"]
    entry.update(shape=[numel], stride=[1])
    entry["chunks"] = [
        dict(entry["chunks"][0], offsets=[0], sizes=[numel], offset=end, length=numel * 4)
    ]
    doc["files"]["rank_00000.bin"]["size"] = end + numel * 4
    os.truncate(shard, end + numel * 4)
    tamper.write(folder, doc)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux /proc")
def test_hostile_checkpoints_are_refused_before_their_memory_is_spent(tmp_path):
    """A world size of 1,000,000 with one rank's files, a manifest padded to 12 MB beside
    an 8 KiB shard, and a 256 MiB tensor in a sparse shard: restore() and verify each
    refuse them (CorruptCheckpointError, a failed check) with peak RSS growing by less
    than 32 MB more than restoring (verifying) the same checkpoint unspoiled does."""
    # Everything a restore and an audit import (and, in a fresh clone, compile to .pyc)
    # is loaded once here, before any fork: the children measure the checkpoint's cost.
    sound = _saved(tmp_path / "warm-up")
    assert _restore(sound) == "restored" and _verify(sound) == ""
    baseline = {op: _peak_growth(op, sound)[0] for op in (_restore, _verify)}
    results = {}
    spoilers = {"world": _huge_world, "padded": _padded_manifest, "sparse": _sparse_shard}
    for name, spoil in spoilers.items():
        folder = _saved(tmp_path / name)
        spoil(folder)
        for op in (_restore, _verify):
            mb, verdict = _peak_growth(op, folder)
            results[f"{name} {op.__name__.strip('_')}"] = (mb - baseline[op], verdict)
    grown = {what: round(mb, 1) for what, (mb, _) in results.items()}
    assert max(grown.values()) < LIMIT_MB, f"peak RSS growth above a sound one's, MB: {grown}"
    for what, (_, verdict) in results.items():
        if what.endswith("restore"):
            assert verdict.startswith("CorruptCheckpointError"), (what, verdict)
        else:
            assert verdict and not verdict.startswith("crashed"), (what, verdict)


class _Blob:
    """An ``extra`` holding 9 MiB of text: state that is not tensors."""

    def state_dict(self):
        return {"blob": "x" * (9 << 20)}

    def load_state_dict(self, state):
        pass


def test_a_save_readers_would_refuse_as_too_large_is_not_committed(tmp_path):
    """A save whose manifest (9 MiB of non-tensor state beside an 8 KiB shard) would be
    larger than readers accept: save() raises a CheckpointError saying so, and commits
    nothing (restore would have refused the checkpoint)."""
    p = Problem()
    ckpt = p.checkpointer(tmp_path / "run", extra={"blob": _Blob()})
    with pytest.raises(ub.CheckpointError, match="not tensors"):
        ckpt.save(1)
    assert ckpt.steps() == []
    assert [f.name for f in (tmp_path / "run").iterdir() if f.is_dir()] == []


def test_a_manifest_too_large_for_its_chunk_entries_says_so(tmp_path, monkeypatch):
    """At many ranks the chunk table (one entry per piece of a tensor on a rank), not the
    non-tensor state, outgrows what readers accept (docs/scaling.md: about 16,384 ranks
    for an 8B model): the refusal names the chunk entries and what to do, not the
    non-tensor state (it used to say "return large values as tensors")."""
    from torch import nn

    from unbroken.format import manifest

    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 20_000)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(60)))
    opt = torch.optim.AdamW(model.parameters())
    for q in model.parameters():
        q.grad = torch.ones_like(q)
    opt.step()
    ckpt = ub.Checkpointer(tmp_path / "run", model=model, optimizer=opt)
    with pytest.raises(
        ub.CheckpointError, match=r"chunk entries \(one per piece of a tensor on a rank\)"
    ) as err:
        ckpt.save(1)
    assert "not tensors" not in str(err.value)
    assert ckpt.steps() == []
