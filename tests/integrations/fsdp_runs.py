"""What the FSDP-in-a-framework tests share: the scripts under ``scripts/`` loaded as
modules, the state dumps they write, and one runner that drives a framework's script
through the same four launches, with the checks every framework's results must pass.

The runner (:func:`run`), for one FSDP version of one :class:`Framework`: the resume test
(straight, stopped at ``stop_at``, resumed, on 2 ranks); the stopped run's checkpoint
restored on 3 ranks with ``--reset`` (``reset={"rng", "dataloader"}``); and, in this
process, the same script without FSDP restoring it into the plain model of one process,
refused without ``--reset``, then with it. The reference for a restore is the state
torch's own ``get_state_dict`` gathered from the stopped run at its save.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import unbroken as ub
from processes import torchrun
from unbroken.testing import resume_test

SCRIPTS = Path(__file__).parent / "scripts"


def load_script(name: str) -> ModuleType:
    """A module of ``scripts/`` (which import each other by name)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(SCRIPTS))
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


common = load_script("fsdp_common")  # the scripts import it by name


def load_dump(path: Path) -> dict:
    """A state dump the scripts wrote (our own test output, so a full load is fine)."""
    return torch.load(path, weights_only=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Framework:
    """One framework's FSDP script and how the tests drive it."""

    script: Path
    """The script under ``scripts/``: ``DIR --fsdp 0|1|2 --steps N [--reset] [--dump F]``."""
    env: dict[str, str]
    """The environment of its torchrun launches."""
    steps: int
    stop_at: int
    world_args: Callable[[int], list[str]]
    """Arguments that tell the script its world size (Lightning's ``--devices N``)."""
    in_process: Callable[[list[str]], None]
    """The script's ``main(argv)`` in this process, as one plain process."""
    wrapped: dict[int, str]
    """What the framework made of the model, by FSDP version (0: one plain process)."""
    parameters: dict[int, list[str]]
    """The classes of the parameters its optimizer holds, by FSDP version."""


def run(framework: Framework, version: int, work: Path) -> dict[str, Any]:
    """FSDP ``version`` of ``framework``'s script through the four launches (see the
    module docstring): the resume test's result, the folders restored on 3 ranks and on
    one process, and the refusal without ``reset``."""
    steps, stop_at, env = framework.steps, framework.stop_at, framework.env
    args = ["--fsdp", str(version), "--steps", str(steps)]
    on_two = torchrun(2, framework.script, "{dir}", *args, *framework.world_args(2))
    command = [*on_two, "--dump", "{dir}.dump"]
    result = resume_test(command, stop_at=stop_at, workdir=work, env=env, plot=False, timeout=240)
    saved = work / "resumed" / f"step_{stop_at:08d}"
    resharded = {}
    for ranks in (3, 1):
        folder = work / f"on-{ranks}"
        shutil.copytree(saved, folder / saved.name)
        dump = ["--dump", f"{folder}.dump"]
        if ranks == 1:
            argv = [str(folder), "--fsdp", "0", "--steps", str(steps), *framework.world_args(1)]
            with pytest.raises(ub.IncompleteCheckpointError) as refused:
                framework.in_process([*argv, *dump])  # without reset: per-rank state, no owner
            framework.in_process([*argv, *dump, "--reset"])
        else:
            command = torchrun(ranks, framework.script, folder, *args)
            command += [*framework.world_args(ranks), "--reset", *dump]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        resharded[ranks] = folder
    outcome = {"version": version, "result": result, "work": work, "resharded": resharded}
    return {**outcome, "refused": str(refused.value)}


def saved_and_restored(runs: dict[str, Any], framework: Framework) -> tuple[dict, dict]:
    """The 2-rank stopped run's gathered state at its save, and the resumed run's right
    after its restore."""
    dumps, stop_at = runs["work"] / "resumed.dump", framework.stop_at
    saved = load_dump(dumps / f"end-step{stop_at}.pt")
    return saved, load_dump(dumps / f"restored-step{stop_at}.pt")


def check_resume(runs: dict[str, Any], framework: Framework) -> dict:
    """Stopped and resumed on 2 ranks: every tracked loss and grad norm after the stop
    and every final tensor equal the straight run's, bit for bit; the model was wrapped
    as this FSDP version wraps it. The restored dump, for more checks."""
    result, version = runs["result"], runs["version"]
    assert result.verdict == "IDENTICAL", str(result)
    assert result.compared_steps == framework.steps - framework.stop_at
    assert {"loss", "grad_norm"} <= set(result.metrics)
    _, restored = saved_and_restored(runs, framework)
    assert restored["wrapped"] == framework.wrapped[version]
    assert restored["parameters"] == framework.parameters[version]
    return restored


def check_reshard(
    runs: dict[str, Any], framework: Framework, ranks: int, components: dict[str, str]
) -> tuple[dict, dict]:
    """The 2-rank checkpoint restored on ``ranks``: resharded and verified, with these
    ``components`` states, wrapped as FSDP (3 ranks) or plain (one process), every model
    and optimizer tensor bit-equal to the gathered saved state, the learning rate too.
    The saved and the restored dumps, for more checks."""
    folder = runs["resharded"][ranks]
    saved, _ = saved_and_restored(runs, framework)
    restored = load_dump(Path(f"{folder}.dump") / f"restored-step{framework.stop_at}.pt")
    report = restored["report"]
    assert report["resharded"] and report["verified"]
    assert (report["saved_world_size"], report["world_size"]) == (2, ranks)
    assert report["components"] == components
    kind = runs["version"] if ranks > 1 else 0
    assert restored["wrapped"] == framework.wrapped[kind]
    assert restored["parameters"] == framework.parameters[kind]
    assert common.differences(restored, saved) == []
    assert restored["lr"] == saved["lr"]
    return saved, restored


def check_refusal(message: str) -> None:
    """Restoring the 2-rank checkpoint on one process without ``reset`` was refused,
    naming the per-rank components and the ``reset=`` that starts them fresh."""
    assert "per-rank state saved by 2 rank(s), not mappable onto 1" in message, message
    assert "reset={" in message and "'rng'" in message and "'dataloader'" in message
