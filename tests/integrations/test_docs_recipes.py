"""Every docs/integrations page's recipe runs as printed and resumes bit-exact.

Each page's marked script (``tests/integrations/recipes.py``) is written to a file
unchanged and run by ``unbroken resume-test``: straight, stopped and resumed. Bug class:
docs that drift from working code (a recipe that skips the epoch-end evaluation on a stop,
skips batches a restored loader already skipped, or leaves a loader out and shifts the RNG
resumes wrong without an error).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .recipes import DOCS, recipes, write_recipe

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _resume_test(workdir: Path, stop_at: int, *command: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "unbroken.cli", "resume-test", "--stop-at", str(stop_at),
         "--workdir", str(workdir / "runs"), "--json", "--timeout", "180", "--parallel", "--",
         *command],
        capture_output=True, text=True, timeout=600, env=ENV, cwd=workdir,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def test_every_integration_page_has_a_recipe():
    """A page without a marked recipe would go untested here."""
    for page in sorted(p.name for p in DOCS.glob("*.md") if p.name != "compared.md"):
        assert recipes(page), f"docs/integrations/{page} marks no <!-- recipe: ... --> script"


def test_every_integration_page_says_to_seed_the_script():
    """Issue 36, item 10: torch 2.13 starts its generators from OS entropy in every
    process, so an unseeded script cannot resume exactly against its straight run. Each
    page says the script must be seeded, and with which call."""
    calls = {"accelerate.md": "set_seed(0)", "lightning.md": "L.seed_everything(0)",
             "transformers.md": "transformers.set_seed(0)", "datasets.md": "torch.manual_seed(0)",
             "trackers.md": "torch.manual_seed(0)", "megatron.md": "torch.manual_seed(0)",
             "deepspeed.md": "torch.manual_seed(0)"}  # fmt: skip
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "compared.md")
    assert pages == sorted(calls), pages
    calls["../fine-tuning.md"] = "torch.manual_seed(0)"  # its recipes run the same way
    for page, call in calls.items():
        text = " ".join((DOCS / page).read_text(encoding="utf-8").split())
        assert "from OS entropy in every process" in text, page
        assert "seed the script" in text.lower() and call in text, page


def test_the_accelerate_recipe_resumes_exactly_after_a_stop_at_an_epoch_end(tmp_path):
    """Stopped at step 16, the last step of epoch 1: the epoch-end evaluation runs before
    the save, the resumed run starts epoch 2 (``starting_epoch`` from the loader) with
    both loaders' draws where the straight run has them."""
    script = write_recipe("accelerate.md", "accelerate", tmp_path)
    result = _resume_test(tmp_path, 16, sys.executable, str(script), "{dir}")
    assert result["passed"] and result["compared_steps"] > 0, result


def test_the_lightning_recipe_resumes_exactly_under_ddp(tmp_path):
    """On two processes (DDP on gloo), with the loader built in ``train_dataloader()`` as the
    page says: stopped at step 10, inside epoch 1, every rank's position and RNG come back."""
    script = write_recipe("lightning.md", "lightning", tmp_path)
    result = _resume_test(tmp_path, 10, sys.executable, str(script), "{dir}", "2")
    assert result["passed"] and result["compared_steps"] > 0, result


def test_the_trainer_recipe_resumes_exactly(tmp_path):
    """The page's "every line to change" applied to a plain Trainer script: stopped at step
    10 (mid-epoch), the logged losses and the final state equal the straight run's."""
    script = write_recipe("transformers.md", "trainer", tmp_path)
    result = _resume_test(tmp_path, 10, sys.executable, str(script), "{dir}")
    assert result["passed"] and result["compared_steps"] > 0, result


def test_the_deepspeed_recipe_resumes_exactly_mid_epoch(tmp_path):
    """A ZeRO-2 bf16 engine with DeepSpeed's AdamW and WarmupLR, stopped at step 45 (inside
    epoch 1): the fp32 masters, moments, scheduler and the loader's position come back,
    and the losses after the stop equal the straight run's."""
    pytest.importorskip("deepspeed")
    script = write_recipe("deepspeed.md", "deepspeed", tmp_path)
    result = _resume_test(tmp_path, 45, sys.executable, str(script), "{dir}")
    assert result["passed"] and result["compared_steps"] > 0, result


def test_the_megatron_recipe_resumes_exactly_on_two_data_parallel_ranks(tmp_path):
    """Megatron-Core's GPT with its bf16 optimizer and LR scheduler, on two processes
    (gloo), run unchanged under the test-only CPU shim (``tests/megatron_cpu.py``):
    stopped at step 6, the losses after it and the final state equal the straight run's."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    script = write_recipe("megatron.md", "megatron", tmp_path)
    launcher = Path(__file__).parent / "scripts" / "with_megatron_cpu.py"
    result = _resume_test(
        tmp_path, 6, sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node=2", str(launcher), str(script), "{dir}",
    )  # fmt: skip
    assert result["passed"] and result["compared_steps"] == 6, result


class _Mesh:
    """A device mesh of ``data_parallel`` x ``tensor_parallel`` seen from one rank: what
    Lightning's ``ModelParallelStrategy.distributed_sampler_kwargs`` reads of it."""

    def __init__(self, dp_size: int, dp_rank: int) -> None:
        self.dp_size, self.dp_rank = dp_size, dp_rank

    def __getitem__(self, name: str) -> _Mesh:
        assert name == "data_parallel", name
        return self

    def size(self) -> int:
        return self.dp_size

    def get_local_rank(self) -> int:
        return self.dp_rank


def _recipe_module(page: str, name: str) -> dict:
    """The imports, classes and functions a recipe defines, without running its script."""
    import ast

    tree = ast.parse(recipes(page)[name])
    kept = (ast.Import, ast.ImportFrom, ast.ClassDef, ast.FunctionDef)
    tree.body = [node for node in tree.body if isinstance(node, kept)]
    scope: dict = {"__name__": "recipe"}
    exec(compile(tree, f"{page}:{name}", "exec"), scope)
    return scope


def test_the_lightning_recipe_shards_by_the_data_parallel_rank():
    """Issue 36, item 12 (a): under ModelParallelStrategy(data_parallel_size=1,
    tensor_parallel_size=2) the two ranks are one tensor-parallel group, which must train
    on the same batches. The recipe's sampler took the global rank and world size, so rank
    1 drew the other half of the data; it takes Lightning's data-parallel rank and size
    (``trainer.distributed_sampler_kwargs``: the mesh's ``data_parallel`` dimension)."""
    from types import SimpleNamespace

    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    regressor = _recipe_module("lightning.md", "lightning")["Regressor"]
    drawn = []
    for rank in (0, 1):
        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
        strategy._device_mesh = _Mesh(dp_size=1, dp_rank=0)  # set up by Lightning's setup
        trainer = SimpleNamespace(strategy=strategy, world_size=2, global_rank=rank)
        trainer.distributed_sampler_kwargs = L.Trainer.distributed_sampler_kwargs.fget(trainer)
        module = regressor()
        module.trainer = trainer
        drawn.append(list(module.train_dataloader().sampler))
    assert drawn[0] == drawn[1] and sorted(drawn[0]) == list(range(256)), drawn
