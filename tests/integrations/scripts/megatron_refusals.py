"""What ``unbroken.integrations.megatron.checkpointer_for`` refuses, tried on 2 ranks with
TP=2 (CPU, gloo, through the test-only ``megatron_cpu``). Writes ``{case: error}`` as JSON
to the path given; an accepted case records None."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the CPU shim
import megatron_cpu  # noqa: F401  (before Megatron places anything)

# isort: split
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig

from unbroken.integrations.megatron import checkpointer_for


def model(**config_args):
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=2, **config_args,
    )  # fmt: skip
    gpt = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16)
    return config, gpt


def wrapped(distributed: bool = False, overlap: bool = False):
    config, gpt = model()
    ddp = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
    )
    chunk = DistributedDataParallel(config, ddp, gpt)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-2, clip_grad=0.0, use_distributed_optimizer=distributed
    )
    return chunk, get_megatron_optimizer(opt_config, [chunk])


def main() -> None:
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    folder = Path(sys.argv[1])
    chunk, opt = wrapped()
    _, swiglu = model(gated_linear_unit=True)
    cases = {
        "accepted": lambda: checkpointer_for(chunk, opt, str(folder / "ok")),
        "accepted_distributed": lambda: checkpointer_for(*wrapped(True), str(folder / "d")),
        "overlap_param_gather": lambda: checkpointer_for(
            *wrapped(True, overlap=True), str(folder / "p")
        ),
        "torch_optimizer": lambda: checkpointer_for(
            chunk, torch.optim.AdamW(chunk.parameters()), str(folder / "t")
        ),
        "two_chunks": lambda: checkpointer_for([chunk, chunk], opt, str(folder / "c")),
        "gated_linear_unit": lambda: checkpointer_for(swiglu, opt, str(folder / "g")),
        "other_model": lambda: checkpointer_for(model()[1], opt, str(folder / "o")),
        "other_model_distributed": lambda: checkpointer_for(
            model()[1], wrapped(True)[1], str(folder / "od")
        ),
    }
    out = {}
    for name, make in cases.items():
        try:
            make().close()
            out[name] = None
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    if dist.get_rank() == 0:
        (folder / "refusals.json").write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
