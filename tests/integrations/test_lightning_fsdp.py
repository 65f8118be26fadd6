"""``UnbrokenCallback`` under Lightning's FSDP strategies: ``FSDPStrategy`` (FSDP1) and
``ModelParallelStrategy`` (FSDP2 ``fully_shard`` in ``configure_model``), resumed bit for
bit on 2 CPU processes (gloo), and resharded from 2 processes onto 3 and onto one.

The script (``scripts/fsdp_lightning_train.py``) runs under torchrun, whose workers
start together (Lightning's own launcher starts them one after the other). FSDP1 runs
through a documented test-only subclass of ``FSDPStrategy`` (Lightning refuses FSDP1 on
the CPU, and its wrapping passes ``device_id=None``, which torch's FSDP1 takes to mean an
accelerator); FSDP2 runs unchanged. Each version costs four launches: the resume test
(straight, stopped, resumed on 2), then the stopped run's checkpoint restored on 3 with
``reset={"rng", "dataloader"}``; and, in this process, the same script without FSDP on
one device restoring it into the plain module (refused without ``reset``, then with it).
The reference for a restore is the state torch's own ``get_state_dict`` gathered from the
stopped run at its save.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from unbroken.format.series import read_series
from unbroken.integrations.lightning import UnbrokenCallback

from . import fsdp_runs
from .fsdp_runs import SCRIPTS, Framework, load_dump, load_script

pytestmark = pytest.mark.e2e
script = load_script("fsdp_lightning_train")
VERSIONS = {1: "fsdp1", 2: "fsdp2"}


def _one_device(argv: list[str]) -> None:
    """The script in this process without FSDP: one device, the plain module."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("UNBROKEN_STOP_AT", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
            mp.delenv(name, raising=False)
        script.main(argv)


LIGHTNING = Framework(
    script=SCRIPTS / "fsdp_lightning_train.py",
    env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    steps=12,
    stop_at=6,  # 16 batches an epoch on 2 processes: stopped mid-epoch
    world_args=lambda devices: ["--devices", str(devices)],
    in_process=_one_device,
    # What ``trainer.model`` is, and the classes of the parameters the optimizer holds, by
    # FSDP version (0: one device without FSDP).
    wrapped={0: "Regressor", 1: "FullyShardedDataParallel", 2: "Regressor"},
    parameters={0: ["Parameter"], 1: ["Parameter"], 2: ["DTensor"]},  # FSDP1: use_orig_params
)
STEPS, STOP_AT = LIGHTNING.steps, LIGHTNING.stop_at


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    """Per FSDP version: the resume test's result and dumps, and the restores of its
    step-``STOP_AT`` checkpoint on 3 processes (FSDP) and on one device (plain)."""
    return {
        v: fsdp_runs.run(LIGHTNING, v, tmp_path_factory.mktemp(name))
        for v, name in VERSIONS.items()
    }


@pytest.mark.parametrize("version", VERSIONS, ids=VERSIONS.values())
def test_two_processes_resume_bit_exact(runs, version):
    """F1/F3 under FSDP (lost optimizer moments, RNG, data position, loop state): stopped
    at step 6, mid-epoch, and resumed on 2 processes, every tracked loss and grad norm
    after it and every final tensor equal the straight run's, bit for bit; the strategy
    really sharded the model (FSDP1's wrapper, FSDP2's DTensors)."""
    restored = fsdp_runs.check_resume(runs[version], LIGHTNING)
    assert set(restored["report"]["components"].values()) == {"restored"}
    assert restored["global_step"] == STOP_AT


@pytest.mark.parametrize("version", VERSIONS, ids=VERSIONS.values())
def test_two_processes_restore_the_gathered_state(runs, version):
    """F2 at the same world size: the restored shards, gathered by torch, are the stopped
    run's gathered state at its save (model, AdamW moments and step, learning rate)."""
    saved, restored = fsdp_runs.saved_and_restored(runs[version], LIGHTNING)
    assert fsdp_runs.common.differences(restored, saved) == []
    assert restored["lr"] == saved["lr"]


@pytest.mark.parametrize("devices", [3, 1])
@pytest.mark.parametrize("version", VERSIONS, ids=VERSIONS.values())
def test_reshards_from_two_processes(runs, version, devices):
    """F2 (a sharded checkpoint bound to its world size) through the callback: the
    2-process checkpoint restores onto 3 FSDP processes (shards of 13 rows cut anew) and
    into the plain module on one device, every model and optimizer tensor bit-equal to
    the gathered saved state; ``reset={"rng", "dataloader"}`` starts the per-rank state
    fresh, the loop state is restored (step 7 is batch 6 of epoch 0, as Lightning counts;
    the reset loader starts the epoch's data over), and training goes on to the last
    step."""
    components = {
        "model": "restored",
        "optimizer": "restored",
        "scheduler": "restored",
        "lightning_loops": "restored",
        "dataloader": "reset",
        "rng": "reset",
    }
    _, restored = fsdp_runs.check_reshard(runs[version], LIGHTNING, devices, components)
    assert restored["global_step"] == STOP_AT
    folder = runs[version]["resharded"][devices]
    end = load_dump(Path(f"{folder}.dump") / f"end-step{STEPS}.pt")
    assert sorted(end["positions"]) == list(range(STOP_AT + 1, STEPS + 1))
    assert end["positions"][STOP_AT + 1] == (0, STOP_AT)


def test_grad_norm_is_the_whole_models(runs):
    """The tracked gradient norm (what the post-resume health check reads) is the whole
    model's, not one rank's shard: FSDP1 sums the squares of flat-gradient shards over
    the process group, FSDP2 lets DTensor reduce; two different reductions of the same
    gradients, so they agree to rounding (a shard's norm would be far off), and they
    cannot be compared bit for bit."""
    norms = {
        v: dict(read_series(runs[v]["work"] / "straight").values["grad_norm"]) for v in VERSIONS
    }
    assert sorted(norms[1]) == sorted(norms[2]) == list(range(1, STEPS + 1))
    for step, value in norms[1].items():
        assert math.isclose(value, norms[2][step], rel_tol=1e-5), (step, value, norms[2][step])


@pytest.mark.parametrize("version", VERSIONS, ids=VERSIONS.values())
def test_another_world_size_without_reset_is_refused(runs, version):
    """F3 (per-rank state silently mis-assigned or dropped): the 2-process checkpoint on
    one device without ``reset`` is refused when training starts, naming the per-rank
    components and the ``reset=`` that starts them fresh (the callback's option too)."""
    fsdp_runs.check_refusal(runs[version]["refused"])


def test_reset_takes_component_names(tmp_path):
    """``reset`` is a collection of component names; one name given as a string (whose
    letters would each be taken for a component) is refused when the callback is made."""
    with pytest.raises(TypeError, match="reset must be a collection"):
        UnbrokenCallback(tmp_path, reset="rng")
