"""Memory and time bounds on a hostile folder or store: a manifest is bounded by its own
shard files before it is read (a padding file beside them raises nothing), and junk
``step_*/manifest.json`` keys newer than the sound step cost one small read each.
"""

from __future__ import annotations

import collections
import os
import uuid

import fsspec
import pytest
import torch

import unbroken as ub
from unbroken.format import manifest
from unbroken.storage import store as remote
from unbroken.storage.locate import checkpoint_dir

JUNK = 300


def _saved(url: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    ub.Checkpointer(url, model=model).save(5)
    return model


def _write(url: str, rel: str, data: bytes) -> None:
    if "://" in url:
        fs, root = fsspec.core.url_to_fs(url)
        fs.pipe_file(f"{root}/{rel}", data)
    else:
        with open(os.path.join(url, rel), "wb") as f:
            f.write(data)


@pytest.mark.parametrize("where", ["disk", "store"])
def test_a_padding_file_does_not_raise_the_manifest_limit(tmp_path, where):
    """Guards: a 12 MB manifest beside a 400 KB padding file was read and parsed (the
    limit counted every file in the folder, not only the checkpoint's shards); it is
    refused by its size now, before a byte of it is read."""
    url = (
        str(tmp_path / "run") if where == "disk" else f"memory://ub-hostile/{uuid.uuid4().hex[:8]}"
    )
    _saved(url)
    step = "step_00000005"
    _write(url, f"{step}/padding", os.urandom(400 << 10))
    _write(url, f"{step}/manifest.json", b'{"a": "' + b"x" * (12 << 20) + b'"}')
    with pytest.raises(ub.CorruptCheckpointError, match="it was not parsed"):
        manifest.read(checkpoint_dir(url).step_path(5))


@pytest.fixture
def counted(monkeypatch):
    """Store requests, by key: (method, key) -> count."""
    calls: collections.Counter = collections.Counter()
    for name in ("read", "read_upto", "read_into", "info", "listing", "put", "copy"):
        real = getattr(remote.Store, name, None)
        if real is None:  # read_upto: new with the bound
            continue

        def wrap(self, key, *a, _real=real, _name=name, **k):
            calls[(_name, key)] += 1
            return _real(self, key, *a, **k)

        monkeypatch.setattr(remote.Store, name, wrap)
    return calls


def test_junk_newer_steps_cost_one_small_read_each(counted):
    """Guards: 1,000 junk newer-step keys (garbage step_*/manifest.json objects) made a
    restore take 228 s: each cost five requests, two of them listings. Now each junk
    key costs one ranged read of its first bytes, and the sound step is restored."""
    url = f"memory://ub-hostile/{uuid.uuid4().hex[:8]}/run"
    model = _saved(url)
    for i in range(JUNK):
        body = b"garbage " * 20 if i % 10 else b"\x00" * (8 << 20)  # some large ones
        _write(url, f"step_{99990000 + i:08d}/manifest.json", body)
    counted.clear()
    torch.manual_seed(1)
    fresh = torch.nn.Linear(16, 16)
    report = ub.Checkpointer(url, model=fresh).restore()
    assert report.step == 5 and report.verified, report
    assert torch.equal(fresh.weight, model.weight)
    assert sum("damaged checkpoint of step 9999" in w for w in report.warnings) == 5
    assert f"skipped {JUNK - 5} more damaged checkpoint(s)" in report.warnings[5]
    per_key = collections.Counter()
    for (_, key), n in counted.items():
        if "/step_9999" in key:
            per_key[key.split("/step_")[1][:8]] += n
    assert len(per_key) == JUNK and max(per_key.values()) == 1, per_key.most_common(3)
    assert sum(counted.values()) <= JUNK + 40, sum(counted.values())


FAKES = 1000
FAKE_BODIES = [  # (body, most requests it may cost)
    (b"garbage " * 20, 1),  # not JSON
    (b'{"format": "unbroken-checkpoint", "step": ', 1),  # cut off, shorter than any manifest
    (b"{}", 1),  # JSON, but no manifest
    (b'{"format": "unbroken-checkpoint", "format_version": 1, "tensors": {"model/w": {', 4),
    (b'{"format": "unbroken-checkpoint", "format_version": 1, "step": 1}', 6),  # checksum
]


def test_a_thousand_fake_newer_manifests_cost_bounded_work_and_one_summary(counted):
    """Issue 36, item 16 (b): 1,000 fake newer step manifests (garbage, unparsable JSON,
    JSON that is no manifest, a manifest failing its checksum) cost minutes before the
    restore reached the sound step: each JSON-looking one was read three times, its folder
    listed at each read and once more to ask whether it vanished; and each left its own
    warning. Now one shorter than any manifest costs its first small read alone, longer
    junk is read at most twice and its folder listed once, and the report names the
    first few and sums up the rest in one line."""
    url = f"memory://ub-hostile/{uuid.uuid4().hex[:8]}/run"
    model = _saved(url)
    for i in range(FAKES):
        _write(url, f"step_{99990000 + i:08d}/manifest.json", FAKE_BODIES[i % len(FAKE_BODIES)][0])
    counted.clear()
    torch.manual_seed(1)
    fresh = torch.nn.Linear(16, 16)
    report = ub.Checkpointer(url, model=fresh).restore()
    assert report.step == 5 and report.verified, report
    assert torch.equal(fresh.weight, model.weight)
    per_step: collections.Counter = collections.Counter()
    listings: collections.Counter = collections.Counter()
    for (method, key), n in counted.items():
        if "/step_9999" in key:
            fake = int(key.split("/step_")[1][:8]) - 99990000
            per_step[fake] += n
            if method == "listing":
                listings[fake] += n
    assert len(per_step) == FAKES
    for kind, (_, most) in enumerate(FAKE_BODIES):  # the worst of each kind of fake
        worst = max(per_step[i] for i in range(kind, FAKES, len(FAKE_BODIES)))
        assert worst <= most, (kind, worst)
    assert max(listings.values()) <= 2, listings.most_common(3)
    root_listings = sum(n for (m, k), n in counted.items() if m == "listing" and "/step_" not in k)
    assert root_listings <= 10, root_listings
    damaged = [w for w in report.warnings if "damaged checkpoint" in w]
    assert len(damaged) == 6, damaged
    assert f"skipped {FAKES - 5} more damaged checkpoint(s), steps 99990000 to" in damaged[-1]
