"""DeepSpeed engines (ZeRO 0-3, bf16 and fp32, torch AdamW, DeepSpeed's AdamW and Muon)
through ``unbroken.integrations.deepspeed``: resumed bit for bit at the same layout, and
restored onto another world size and stage with every tensor as saved.

Bug classes (DESIGN.md): F3 (optimizer state lost: ZeRO's flat partitions, and Muon's
momentum that DeepSpeed's own per-parameter API does not expose at stages 1-2), F5
(Muon's momentum in the wrong dtype under bf16: seed 004), F1/F4 (compute weights and
fp32 masters both installed before the first step, verified by fingerprint).

Every process-launching run is in one module fixture per group of cases: a DeepSpeed
engine process takes ~10 s to start on two cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("torchdata")

from unbroken.testing import resume_test

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

SCRIPT = str(Path(__file__).parent / "scripts" / "deepspeed_train.py")
TIMEOUT = 300
# Muon's Newton-Schulz runs eagerly: compiling it costs ~20 s a process here, and the
# straight and resumed runs alike run it the same way. (DeepSpeed's C++ ops: tests/conftest.py.)
ENV = {"TORCHDYNAMO_DISABLE": "1"}

# name -> (processes, script options): each resumed bit for bit by resume_test.
CASES = {
    "zero3-adamw-bf16-2": (2, ["--stage", "3", "--opt", "adamw", "--bf16"]),
    "zero1-muon-bf16-2": (2, ["--stage", "1", "--opt", "muon", "--bf16"]),
    "zero3-muon-bf16-2": (2, ["--stage", "3", "--opt", "muon", "--bf16"]),
    "zero2-torch-fp32-1": (1, ["--stage", "2", "--opt", "torch"]),
    # stage 0 in fp32: the engine's optimizer is the torch AdamW itself
    "zero0-torch-fp32-1": (1, ["--stage", "0", "--opt", "torch"]),
}
# name -> (source case, processes, options of the restoring run): the source's straight
# run's step 4 restored there, then two more steps trained.
RESHARDS = {
    "zero3x2-to-zero2x1": ("zero3-adamw-bf16-2", 1, ["--stage", "2", "--opt", "adamw", "--bf16"]),
    "zero2x1-to-zero3x2": ("zero2-torch-fp32-1", 2, ["--stage", "3", "--opt", "torch"]),
    "zero1x2-to-zero3x1-muon": (
        "zero1-muon-bf16-2",
        1,
        ["--stage", "3", "--opt", "muon", "--bf16"],
    ),
}


def command(processes: int, options: list[str], folder: str, steps: int = 8) -> list[str]:
    launch = [sys.executable, SCRIPT]
    if processes > 1:
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                  f"--nproc_per_node={processes}", SCRIPT]  # fmt: skip
    return [*launch, folder, *options, "--steps", str(steps), "--dump", f"{folder}.dump"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = {}
    for name, (processes, options) in CASES.items():
        work = tmp_path_factory.mktemp(name)
        out[name] = (work, resume_test(command(processes, options, "{dir}"), stop_at=5,
                                       workdir=work, timeout=TIMEOUT, plot=False, env=ENV))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def resharded(resumed: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = {}
    for name, (source, processes, options) in RESHARDS.items():
        work = tmp_path_factory.mktemp(name)
        folder = work / "ckpt"
        shutil.copytree(resumed[source][0] / "straight", folder)
        shutil.rmtree(folder / "step_00000008")  # restore step 4, then train on from it
        log = work / "run.log"
        with open(log, "w") as f:
            done = subprocess.run([*command(processes, options, str(folder), steps=6), "--new-world"],
                                  stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT,
                                  env={**os.environ, **ENV})  # fmt: skip
        assert done.returncode == 0, log.read_text()[-4000:]
        out[name] = (resumed[source][0] / "straight.dump.4", Path(f"{folder}.dump.restored"), log)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_resumes_bit_for_bit(resumed: dict, name: str) -> None:
    """F3/F5: stopped at step 5 and resumed, every metric after the stop and every
    tensor of the final state (fp32 masters, moments, Muon's momentum, compute weights)
    identical to the uninterrupted run."""
    _, result = resumed[name]
    assert result.passed and result.exact, str(result)
    assert result.compared_steps >= 3


def _dump(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("name", list(RESHARDS))
def test_restores_onto_another_world_size_and_stage(resharded: dict, name: str) -> None:
    """Restored onto another world size and ZeRO stage, DeepSpeed's own API (not ours)
    reads back every compute weight, fp32 master and moment bit for bit as the source run
    held them at the save; the run then trains on."""
    saved_path, restored_path, log = resharded[name]
    saved, restored = _dump(saved_path), _dump(restored_path)
    common = sorted(set(saved) & set(restored))
    assert len(common) >= 16, (sorted(saved), sorted(restored))
    for key in common:
        a, b = saved[key], restored[key]
        assert a.dtype == b.dtype and a.shape == b.shape, (key, a.dtype, b.dtype)
        assert torch.equal(a, b), key
    assert "Traceback" not in log.read_text()


def test_muon_momentum_keeps_its_dtype(resumed: dict) -> None:
    """F5 (seed 004): under bf16, DeepSpeed keeps Muon's momentum in the gradients' dtype
    (bf16 here, at ZeRO-1 and ZeRO-3 alike with torch's AdamW beside it) next to fp32
    Adam moments and fp32 masters; each checkpoint records every state tensor in the dtype
    the engine held it in, not the parameter's or fp32."""
    from unbroken.tools.inspection import inspect_checkpoint

    for name in ("zero1-muon-bf16-2", "zero3-muon-bf16-2"):
        work = resumed[name][0]
        live = _dump(work / "straight.dump.8.dtypes")
        assert live["momentum_buffer"] == "bfloat16" and live["exp_avg"] == "float32", live
        report = inspect_checkpoint(str(work / "straight"), step=8)
        dtypes = {t.key: t.dtype for t in report.tensors}
        state = "optimizer/state"
        assert dtypes[f"{state}/hidden.weight/momentum_buffer"] == live["momentum_buffer"], name
        assert dtypes[f"{state}/hidden.bias/exp_avg"] == live["exp_avg"], name
        assert dtypes[f"{state}/hidden.weight/fp32_master"] == "float32", name
        assert dtypes["model/hidden.weight"] == "bfloat16", name


def _refusals(rank: int, world: int, folder: str) -> dict[str, str]:
    """In one process (a gloo group of 1): what checkpointer_for and save refuse."""
    import deepspeed
    from torch import nn

    from unbroken.errors import CheckpointError
    from unbroken.integrations.deepspeed import checkpointer_for

    def engine(config: dict, optimizer: str = "adamw", **zero):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  **config, "zero_optimization": {"stage": 1, **zero}}  # fmt: skip
        opts = {
            "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=1e-2),
            "rmsprop": lambda: torch.optim.RMSprop(model.parameters(), lr=1e-2),
        }
        if optimizer in opts:
            return deepspeed.initialize(model=model, optimizer=opts[optimizer](), config=config)[0]
        for p in model.parameters():
            p.use_muon = p.ndim == 2  # read by "Muon" only
        config["optimizer"] = {"type": optimizer, "params": {"lr": 1e-2}}
        return deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )[0]

    def refusal(make) -> str:
        try:
            checkpointer_for(make(), f"{folder}/refused")
        except ValueError as exc:
            return str(exc)
        return "accepted"

    out = {
        "rmsprop": refusal(lambda: engine({"zero_allow_untested_optimizer": True}, "rmsprop")),
        "fused_adam": refusal(lambda: engine({}, "AdamW")),
        "offload": refusal(
            lambda: engine(
                {"zero_force_ds_cpu_optimizer": False}, offload_optimizer={"device": "cpu"}
            )
        ),
        "muon_fused_adam": refusal(lambda: engine({}, "Muon")),
        "stage0_bf16": refusal(lambda: engine({"bf16": {"enabled": True}}, stage=0)),
        "model_given": "",
    }
    try:
        checkpointer_for(engine({}), f"{folder}/given", model=nn.Linear(1, 1))
    except ValueError as exc:
        out["model_given"] = str(exc)
    accumulating = engine({"gradient_accumulation_steps": 2})
    ckpt = checkpointer_for(accumulating, f"{folder}/mid")
    x = torch.randn(2, 4)
    accumulating.backward(accumulating(x).pow(2).mean())
    accumulating.step()  # micro-step 1 of 2: no optimizer step yet
    try:
        ckpt.save(1)
        out["mid_accumulation"] = "saved"
    except CheckpointError as exc:
        out["mid_accumulation"] = str(exc)
    ckpt.close()
    return out


def test_what_cannot_be_captured_exactly_is_refused_by_name(tmp_path: Path) -> None:
    """F3: state the integration would not capture whole (an unknown optimizer's layout,
    DeepSpeed's FusedAdam, Muon's auxiliary FusedAdam on the CPU whose bias-correction
    powers live in its C++ object, offloaded optimizer state, gradients accumulated in
    DeepSpeed's buffers) is refused with the class or setting named and what to do, never saved
    partially."""
    from distributed import launcher

    (found,) = launcher.run(_refusals, 1, str(tmp_path))
    assert "torch.optim.rmsprop.RMSprop" in found["rmsprop"], found
    assert "FusedAdam" in found["fused_adam"] and "torch_adam" in found["fused_adam"], found
    assert "offload" in found["offload"], found
    assert "FP16_UnfusedOptimizer" in found["stage0_bf16"], found  # stage 0's bf16 wrapper
    # FusedAdam on the CPU keeps beta**step in its C++ object: a resume differs in the last bit
    assert "FusedAdam" in found["muon_fused_adam"], found
    assert '"torch_adam": true' in found["muon_fused_adam"], found
    assert "model" in found["model_given"], found
    assert "micro-step 1" in found["mid_accumulation"], found
    assert not list((tmp_path / "mid").glob("step_*")), "nothing committed mid-accumulation"
