"""What the FSDP-in-a-framework tests share: the scripts under ``scripts/`` loaded as
modules, a torchrun command for one of them, and the state dumps they write."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPTS = Path(__file__).parent / "scripts"


def load_script(name: str) -> ModuleType:
    """A module of ``scripts/`` (which import each other by name)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(SCRIPTS))
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


def torchrun(script: Path, processes: int) -> list[str]:
    """``script`` under torchrun on ``processes`` local ranks, on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
            "--master_port", port, str(script)]  # fmt: skip


def load_dump(path: Path) -> dict:
    """A state dump the scripts wrote (our own test output, so a full load is fine)."""
    return torch.load(path, weights_only=False)
