"""unbroken's reshard of a DeepSpeed checkpoint beside DeepSpeed's own universal
checkpoint path (``ds_to_universal``, then ``"checkpoint": {"load_universal": true}``).

Bug class (DESIGN.md): F3, optimizer state lost on reshard. A run saved by 2 ranks is
restored onto ZeRO-1 on 1 rank, once from unbroken's checkpoint (``checkpointer_for``) and
once from DeepSpeed's folder of the same step, converted by DeepSpeed 0.19.8's
``ds_to_universal``:

- from ZeRO-2 on 2 ranks: both restore every fp32 master, Adam moment, step and compute
  weight as saved, and train on to the same state;
- from ZeRO-3 on 2 ranks: unbroken restores everything as saved; DeepSpeed's universal
  load onto ZeRO-1 fails: the ZeRO-3 conversion writes a folder laid out for a ZeRO-3
  load only.

One module fixture: two torchrun launches (2 ranks) write both checkpoints and DeepSpeed's
gathered view at step 4 (``--own``, ``--dump``); four one-process launches restore.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from processes import torchrun

pytest.importorskip("deepspeed")
pytest.importorskip("torchdata")
pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

SCRIPT = Path(__file__).parent / "scripts" / "deepspeed_train.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
TIMEOUT = 300
STAGES = (2, 3)  # the saving runs' ZeRO stage, on 2 ranks
MODEL = ["--opt", "torch", "--bf16"]
TENSORS = 32  # 8 parameters: compute weight, fp32 master, exp_avg, exp_avg_sq


def _launch(command: list, log: Path) -> int:
    with open(log, "w") as f:
        done = subprocess.run(
            list(map(str, command)), stdout=f, stderr=subprocess.STDOUT, env=ENV, timeout=TIMEOUT
        )
    return done.returncode


def _to_universal(source: Path, target: Path) -> None:
    """DeepSpeed's own converter, as ``python -m deepspeed.checkpoint.ds_to_universal``
    runs it (one worker: no process pool). ``inject_missing_state``: an engine without
    Megatron's model info records no universal checkpoint info, which stages 1-2 require."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(target),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    ds_to_universal.main(args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Per saving stage: the source's gathered view at step 4 (``saved``), and for each
    restoring path (``ours``, ``universal``) onto ZeRO-1 on 1 rank the return code, log and
    dump prefix (``PREFIX.restored`` right after the restore, ``PREFIX.6`` two steps on)."""
    out = {}
    for stage in STAGES:
        work = tmp_path_factory.mktemp(f"zero{stage}")
        args = ["--stage", str(stage), *MODEL, "--steps", "4", "--every", "4"]
        args += ["--own", work / "ds", "--dump", work / "saved"]
        log = work / "save.log"
        assert _launch(torchrun(2, SCRIPT, work / "ub", *args), log) == 0, log.read_text()[-3000:]
        _to_universal(work / "ds" / "global_step4", work / "universal" / "global_step4")
        restore = [sys.executable, SCRIPT]
        target = ["--stage", "1", *MODEL, "--steps", "6", "--every", "4"]
        paths = {
            "ours": [work / "ub", "--new-world"],
            "universal": [work / "fresh", "--universal", work / "universal"],
        }
        out[stage] = {"saved": work / "saved.4", "folder": work / "universal" / "global_step4"}
        for path, (folder, *how) in paths.items():
            log = work / f"{path}.log"
            code = _launch([*restore, folder, *target, *how, "--dump", work / path], log)
            out[stage][path] = (code, log, work / path)
    return out


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b) and len(a) == TENSORS, (sorted(a), sorted(b))
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("stage", STAGES)
def test_ours_restores_every_tensor_as_saved_onto_zero1(runs: dict, stage: int) -> None:
    """F3: saved by ZeRO-2 or ZeRO-3 on 2 ranks and restored by ``checkpointer_for`` onto
    ZeRO-1 on 1 rank, DeepSpeed's own API reads back every compute weight, fp32 master and
    Adam moment bit for bit as the saving run held them, the optimizer's step and the
    engine's step count as saved; the run then trains on."""
    code, log, dump = runs[stage]["ours"]
    assert code == 0, log.read_text()[-3000:]
    saved = runs[stage]["saved"]
    _assert_identical(_load(saved), _load(f"{dump}.restored"))
    steps = {"global_steps": 4, "optimizer": [4.0]}
    assert _load(f"{saved}.steps") == steps
    assert _load(f"{dump}.restored.steps") == steps
    assert _load(f"{dump}.6.steps") == {"global_steps": 6, "optimizer": [6.0]}


def test_deepspeeds_universal_path_from_zero2_equals_ours(runs: dict) -> None:
    """F3: from ZeRO-2 on 2 ranks, DeepSpeed's universal path restores onto ZeRO-1 what
    unbroken restores, tensor for tensor and step for step, and the two runs train on to
    the same state (same batches: neither carries the 2-rank data position over)."""
    code, log, universal = runs[2]["universal"]
    assert code == 0, log.read_text()[-3000:]
    ours = runs[2]["ours"][2]
    _assert_identical(_load(f"{ours}.restored"), _load(f"{universal}.restored"))
    assert _load(f"{universal}.restored.steps") == _load(f"{ours}.restored.steps")
    _assert_identical(_load(f"{ours}.6"), _load(f"{universal}.6"))
    assert _load(f"{universal}.6.steps") == _load(f"{ours}.6.steps")


def test_deepspeeds_universal_path_from_zero3_fails_onto_zero1(runs: dict) -> None:
    """F3: from ZeRO-3 on 2 ranks (where unbroken restores everything, above), DeepSpeed
    0.19.8's universal load onto ZeRO-1 fails before it restores anything: the engine looks
    for ``mp_rank_*_model_states.pt`` and the ZeRO-3 conversion copies only
    ``zero_pp_rank_*_mp_rank_00_model_states.pt``, so DeepSpeed asserts on an empty file list.
    Past that, the converted folder lacks what the ZeRO-1/2 loader reads: per-parameter
    ``step.pt``, ``{"param": tensor}`` files (it writes bare tensors) and ``ds_version``."""
    code, log, dump = runs[3]["universal"]
    text = log.read_text()
    assert code != 0
    assert "in check_ckpt_list" in text and "assert len(self.ckpt_list) > 0" in text, text[-3000:]
    assert "AssertionError" in text
    assert not Path(f"{dump}.restored").exists()

    folder = runs[3]["folder"]
    assert sorted(p.name for p in folder.glob("*model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
    ]
    param = folder / "zero" / "hidden.weight"
    assert sorted(p.name for p in param.iterdir()) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt"]
    assert isinstance(torch.load(param / "fp32.pt", weights_only=True), torch.Tensor)
    assert "ds_version" not in torch.load(
        folder / "zero" / "optimizer_state.pt", weights_only=False
    )
    # the ZeRO-2 conversion of the same model, for contrast: what ZeRO-1 reads is there
    zero2 = runs[2]["folder"]
    assert (zero2 / "mp_rank_00_model_states.pt").exists()
    assert (zero2 / "zero" / "hidden.weight" / "step.pt").exists()
    assert "param" in torch.load(zero2 / "zero" / "hidden.weight" / "fp32.pt", weights_only=False)
