"""What ``checkpointer_for`` refuses under Megatron-FSDP, one process: megatron-core's
vendored copy, and the package's ZeRO-2 (``optim_grads``). Writes DIR/refusals.json:
case -> the error message (None where nothing was refused)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the CPU shims
import megatron_fsdp_cpu  # noqa: F401  (before Megatron places anything)

# isort: split
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron_fsdp_train import build

from unbroken.integrations.megatron import checkpointer_for

CASES = {"vendored": {"own": True}, "zero2": {"own": False, "strategy": "optim_grads"}}


def main() -> None:
    folder = Path(sys.argv[1])
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    out = {}
    for case, how in CASES.items():
        model, optimizer = build(**how)
        try:
            checkpointer_for(model, optimizer, str(folder / case))
            out[case] = None
        except (TypeError, ValueError) as e:
            out[case] = f"{type(e).__name__}: {e}"
    (folder / "refusals.json").write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
