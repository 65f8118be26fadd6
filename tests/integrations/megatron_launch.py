"""What the Megatron test files share: the environment of the processes they launch, the
scripts under ``scripts/`` under torchrun, and a resume test of one of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from unbroken.testing import ResumeTestResult, resume_test

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONWARNINGS": "ignore",
    "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
}
TIMEOUT = 300


def script(nproc: int, name: str, *args: str) -> list[str]:
    """``scripts/NAME`` with ``args`` under torchrun on ``nproc`` processes (a standalone
    rendezvous: no port to pick)."""
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*run, f"--nproc_per_node={nproc}", str(SCRIPTS / name), *args]


def launch(*command: str) -> None:
    """Run ``command`` to the end; it must exit 0 (else its output's tail is shown)."""
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def resume(command: list[str], workdir: Path, stop_at: int) -> ResumeTestResult:
    """``resume_test`` of ``command`` (with ``{dir}``), no plot."""
    return resume_test(
        command, stop_at=stop_at, workdir=workdir, env=ENV, timeout=TIMEOUT, plot=False
    )


def check_restored_as_saved(report: dict, diff, step: int) -> None:
    """A 2-rank checkpoint restored on one process at ``step`` (its restore ``report``),
    verified, and saved again: ``diff`` (of the two checkpoints) finds every model and
    optimizer tensor equal, the bf16 weights' fp32 main weights among them."""
    restore = {k: report[k] for k in ("step", "restored", "verified", "resharded")}
    assert restore == {"step": step, "restored": True, "verified": True, "resharded": True}
    assert (report["saved_world_size"], report["world_size"]) == (2, 1)
    assert diff.identical, [t.key for t in diff.tensors if t.status != "equal"]
    keys = [t.key for t in diff.tensors]
    assert any(k.endswith("linear_qkv.weight/main_param") for k in keys), keys[:5]


def check_qkv_saved_whole(manifest: dict) -> None:
    """The first layer's QKV weight (split by TP or sharded over DP while training) in the
    ``manifest`` saved whole: the bf16 compute weight, and beside it the fp32 main weight
    and moments and a scalar step, by the model's FQN."""
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    shape_dtype = {k: (v["shape"], v["dtype"]) for k, v in manifest["tensors"].items() if qkv in k}
    assert shape_dtype == {
        f"model/{qkv}": ([96, 32], "bfloat16"),
        f"optimizer/state/{qkv}/main_param": ([96, 32], "float32"),
        f"optimizer/state/{qkv}/exp_avg": ([96, 32], "float32"),
        f"optimizer/state/{qkv}/exp_avg_sq": ([96, 32], "float32"),
        f"optimizer/state/{qkv}/step": ([], "float32"),
    }


def manifest_of(folder: Path, step: int) -> dict:
    """The manifest of ``folder``'s step ``step``."""
    return json.loads((Path(folder) / f"step_{step:08d}" / "manifest.json").read_text())
