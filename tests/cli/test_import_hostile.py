"""`unbroken import` of a hostile DCP folder (issue 12, item 1): no code ever runs.

DCP's ``.metadata`` is a pickle, and DCP stores non-tensor values as ``torch.save``
pickles. A crafted one used to run its payload while the import exited 0. Now
``.metadata`` is read by an unpickler that knows only the classes DCP metadata is made
of, and non-tensor entries by ``torch.load(weights_only=True)``; anything else is a
``CorruptCheckpointError`` naming the file or entry (``--trust-pickle`` lifts both, with a
warning).
"""

from __future__ import annotations

import builtins
import os
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import unbroken as ub

from . import factories
from .conftest import run_cli, run_json


class _System:
    """A payload: runs a shell command when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Exec:
    """A payload: runs Python code when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').close()",))


PAYLOADS = {"os.system": (_System, "posix.system"), "exec": (_Exec, "builtins.exec")}


def _dcp_save(path, extra=None):
    model = factories.model_only()
    state = {"model": get_model_state_dict(model), "step": 3, **(extra or {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return model


def _import(src, dest, *extra):
    return run_cli("import", src, dest, "--model", "cli.factories:model_only", *extra)


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_payload_in_metadata_never_runs(tmp_path, payload):
    """A real DCP folder whose .metadata carries a payload (in planner_data): refused
    naming .metadata and the class, the payload never runs, nothing is written."""
    src, marker = tmp_path / "dcp", tmp_path / "pwned"
    _dcp_save(src)
    kind, name = PAYLOADS[payload]
    md = pickle.loads((src / ".metadata").read_bytes())  # our own file: trusted here
    md.planner_data["model.inp.weight"] = kind(marker)
    (src / ".metadata").write_bytes(pickle.dumps(md))
    result = _import(src, tmp_path / "run")
    assert not marker.exists(), "the payload ran"
    assert result.exit_code == 1, result.stderr
    assert result.stderr.startswith("CorruptCheckpointError:")
    assert (
        ".metadata" in result.stderr and name in result.stderr and "--trust-pickle" in result.stderr
    )
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_payload_in_a_non_tensor_entry_never_runs(tmp_path, payload):
    """A DCP non-tensor entry (a torch.save pickle) carrying a payload: a clear error
    naming the entry (no traceback), and the payload never runs."""
    src, marker = tmp_path / "dcp", tmp_path / "pwned"
    _dcp_save(src, {"step": PAYLOADS[payload][0](marker)})
    assert not marker.exists()
    result = _import(src, tmp_path / "run")
    assert not marker.exists(), "the payload ran"
    assert result.exit_code == 1, result.stderr
    assert result.stderr.startswith("CorruptCheckpointError:") and "'step'" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreadable_non_tensor_entry_is_a_clear_error(tmp_path):
    """A DCP non-tensor entry whose bytes are damaged: CorruptCheckpointError naming the
    entry, exit 1, no traceback."""
    src = tmp_path / "dcp"
    _dcp_save(src)
    md = pickle.loads((src / ".metadata").read_bytes())
    where = next(v for k, v in md.storage_data.items() if k.fqn == "step")
    shard = src / where.relative_path
    data = bytearray(shard.read_bytes())
    data[where.offset : where.offset + where.length] = b"\x00" * where.length
    shard.write_bytes(bytes(data))
    result = _import(src, tmp_path / "run")
    assert result.exit_code == 1, result.stderr
    assert result.stderr.startswith("CorruptCheckpointError:") and "'step'" in result.stderr
    assert "Traceback" not in result.stderr


def test_metadata_that_is_not_dcp_metadata_is_refused(tmp_path):
    """A .metadata whose classes are allowed but which is not DCP metadata (a torch.Size,
    a path escaping the folder): a clear CorruptCheckpointError, never a traceback."""
    src = tmp_path / "dcp"
    _dcp_save(src)
    md = pickle.loads((src / ".metadata").read_bytes())
    index = next(iter(md.storage_data))
    md.storage_data[index].relative_path = "../../etc/passwd"
    (src / ".metadata").write_bytes(pickle.dumps(md))
    escaping = _import(src, tmp_path / "run")
    assert escaping.exit_code == 1 and "../../etc/passwd" in escaping.stderr, escaping.stderr
    (src / ".metadata").write_bytes(pickle.dumps(md.state_dict_metadata["model.inp.weight"].size))
    other = _import(src, tmp_path / "run")
    assert other.exit_code == 1 and "not DCP metadata" in other.stderr, other.stderr
    assert "Traceback" not in escaping.stderr + other.stderr


def test_trust_pickle_reads_what_weights_only_refuses_with_a_warning(tmp_path):
    """A step saved as a NumPy integer (refused by weights_only) is an error naming the
    entry and --trust-pickle; with --trust-pickle the import succeeds, warning first."""
    src = tmp_path / "dcp"
    model = _dcp_save(src, {"step": np.int64(5)})
    refused = _import(src, tmp_path / "run")
    assert refused.exit_code == 1 and "'step'" in refused.stderr
    assert "--trust-pickle" in refused.stderr
    trusted = _import(src, tmp_path / "run", "--trust-pickle")
    assert trusted.exit_code == 0, trusted.stderr
    assert "WARNING" in trusted.stderr and "run code" in trusted.stderr
    assert run_json("inspect", tmp_path / "run")["checkpoints"][0]["step"] == 5
    restored = factories.model_only()
    ub.Checkpointer(tmp_path / "run", model=restored).restore()
    for (key, saved), back in zip(model.state_dict().items(), restored.state_dict().values(),
                                  strict=True):  # fmt: skip
        assert torch.equal(saved, back), key
