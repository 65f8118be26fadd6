"""Accelerate's FSDP plugin (FSDP1 and FSDP2) through ``checkpointer_for``: resumed bit for
bit on 2 ranks, and resharded from 2 ranks onto 1 and 3.

accelerate 1.15 enters its FSDP code path only on GPU-like devices; the script
(``scripts/fsdp_accelerate_train.py``) runs it on CPU/gloo under torchrun through a
documented test-only shim (``fsdp_on_cpu``: the distributed type and the device the
``AcceleratorState`` branch for GPUs would set). ``prepare`` then wraps the model itself:
FSDP1 ``FullyShardedDataParallel`` over flat parameters (the plugin's default
``use_orig_params=False``), FSDP2 ``fully_shard``. Each version costs four launches: the
resume test (straight, stopped, resumed on 2 ranks), then the stopped run's checkpoint
restored on 3 ranks with ``reset={"rng", "dataloader"}``; and, in this process, the same
script without the plugin restoring it into the plain model on one process (refused
without ``reset``, then with it). The reference for a restore is the state torch's own
``get_state_dict`` gathered from the stopped run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState

from . import fsdp_runs
from .fsdp_runs import SCRIPTS, Framework, load_script

pytestmark = pytest.mark.e2e
script = load_script("fsdp_accelerate_train")


def _one_plain_process(argv: list[str]) -> None:
    """The script in this process without the plugin: one process, the plain model."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("UNBROKEN_STOP_AT", "ACCELERATE_USE_FSDP", "WORLD_SIZE", "LOCAL_RANK"):
            mp.delenv(name, raising=False)
        try:
            script.main(argv)
        finally:
            AcceleratorState._reset_state(True)


ACCELERATE = Framework(
    script=SCRIPTS / "fsdp_accelerate_train.py",
    env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"},
    steps=10,
    stop_at=5,  # 8 steps an epoch on 2 ranks: the resumed run crosses an epoch
    world_args=lambda ranks: [],  # torchrun's world size is Accelerate's
    in_process=_one_plain_process,
    # What prepare() made of the model, and the classes of the parameters the optimizer it
    # hands over holds, by FSDP version (0: the plain process).
    wrapped={0: "Net", 1: "FullyShardedDataParallel", 2: "FSDPNet"},
    parameters={0: ["Parameter"], 1: ["FlatParameter"], 2: ["DTensor"]},
)
STEPS, STOP_AT = ACCELERATE.steps, ACCELERATE.stop_at


@pytest.fixture(scope="module", params=[1, 2], ids=["fsdp1", "fsdp2"])
def runs(request, tmp_path_factory) -> dict:
    """One FSDP version's runs: the resume test's result and dumps, and the restores of
    its step-``STOP_AT`` checkpoint on 3 ranks (FSDP) and on one process (plain)."""
    version = request.param
    return fsdp_runs.run(ACCELERATE, version, tmp_path_factory.mktemp(f"accelerate-fsdp{version}"))


def test_two_ranks_resume_bit_exact(runs):
    """F1/F3 through Accelerate's FSDP (lost optimizer moments, RNG, data position or
    scheduler): stopped at step 5 and resumed on 2 ranks, every tracked loss and grad norm
    after it and every final tensor equal the straight run's, bit for bit; the model
    really was FSDP-wrapped by ``prepare``, with the optimizer over FSDP's parameters."""
    restored = fsdp_runs.check_resume(runs, ACCELERATE)
    assert restored["report"]["components"] == {
        "model": "restored",
        "optimizer": "restored",
        "scheduler": "restored",
        "accelerator": "restored",
        "dataloader": "restored",
        "rng": "restored",
    }


def test_two_ranks_restore_the_gathered_state(runs):
    """F2 at the same world size: the restored shards, gathered by torch, are the
    stopped run's gathered state at its save (model and AdamW moments and step)."""
    saved, restored = fsdp_runs.saved_and_restored(runs, ACCELERATE)
    assert fsdp_runs.common.differences(restored, saved) == []


@pytest.mark.parametrize("ranks", [3, 1])
def test_reshards_from_two_ranks(runs, ranks):
    """F2 (a sharded checkpoint bound to its world size) through Accelerate: the 2-rank
    checkpoint restores onto 3 FSDP ranks (shards of 13 rows cut anew, FSDP1 flat
    parameters into other flat parameters) and into the plain model of one process, with
    every model and optimizer tensor bit-equal to the gathered saved state; per-rank RNG
    and loader position are reset as asked, the rest restored, and training goes on to
    the last step."""
    components = {
        "model": "restored",
        "optimizer": "restored",
        "scheduler": "restored",
        "accelerator": "restored",
        "dataloader": "reset",
        "rng": "reset",
    }
    _, restored = fsdp_runs.check_reshard(runs, ACCELERATE, ranks, components)
    assert restored["accelerator_step"] == 2 * STOP_AT
    folder = runs["resharded"][ranks]
    assert (Path(f"{folder}.dump") / f"end-step{STEPS}.pt").exists()


def test_another_world_size_without_reset_is_refused(runs):
    """F3 (per-rank state silently mis-assigned or dropped): restoring the 2-rank
    checkpoint on one process without ``reset`` is refused before anything changes,
    naming the per-rank components and the ``reset=`` that starts them fresh."""
    fsdp_runs.check_refusal(runs["refused"])
