"""``unbroken import SRC DIR --model module:factory``: bring in another tool's checkpoint."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..errors import CheckpointError
from ._common import Command, JsonOption, emit_json, guard, stdout, usage_error
from ._safe import shown

HELP = """Convert a checkpoint written by other code into an unbroken checkpoint.

SECURITY: the files read are pickles underneath, and unpickling a crafted one can run
code. They are read safely: a torch.save file and DCP's non-tensor entries with
torch.load(weights_only=True), a DCP directory's .metadata with an unpickler that knows
only the classes DCP metadata is made of. Anything else is refused, naming the file or
entry (exit 1). --trust-pickle reads them with plain pickle instead, for files from a
source you trust only; it prints a warning. (Our own checkpoints are never unpickled.)

SRC is a torch.save file holding {"model": state_dict, "optimizer":
optimizer.state_dict(), "scheduler"?: state_dict, "step"?: int} (a bare model
state_dict also works), a DCP directory (torchtitan-style keys `model.<fqn>`,
`optimizer.state.<fqn>.exp_avg`, `optimizer.param_groups...`, or keys without prefix),
a Hugging Face model folder (model.safetensors.index.json and its shards, or
model.safetensors alone; a tied weight written once fills both names), or a PEFT
adapter folder (adapter_model.safetensors and adapter_config.json). Safetensors files
are not pickles; their index and headers are checked against the files first (a tensor
the index names but no shard holds, one held by two shards or by none the index names,
byte ranges outside the file or of the wrong size, an unknown dtype: exit 1, naming the
file and the tensor). An HF folder records no step: pass --step. For a PEFT adapter the
factory builds the PeftModel on its base model (loaded by the factory), and every
adapter tensor is loaded into adapter --adapter (default "default") or named in an
error; the base's tensors stay as the factory built them. A DeepSpeed checkpoint folder
(engine.save_checkpoint's DIR, or DIR/global_stepN; ZeRO 1-3, bf16 or fp32, Adam-type
torch optimizers) is saved as integrations.deepspeed.checkpointer_for(engine) saves:
the factory returns the module as built before deepspeed.initialize (and optionally the
torch optimizer); each client_state entry needs --ignore NAME; Muon, fp16, frozen or
shared parameters and a missing rank's file are refused by name.

--model names a zero-argument callable, `package.module:function` (importable from the
current directory), returning the model or a (model, optimizer) tuple built exactly as
in training. Positional optimizer state is matched to parameters through the returned
optimizer's param groups, or, with a model alone, through model.parameters() order and
an AdamW is built from the imported param groups. Every entry must find its place:
an optimizer entry with no parameter, a count or shape mismatch, or an unknown
top-level entry is an error naming it (--ignore NAME leaves a top-level entry out on
purpose). The result is saved with Checkpointer into DIR as step --step (default: the
step recorded in SRC).

Exit 0 on success, 1 if SRC does not fit the model, 2 for a usage error (missing SRC,
bad --model, no step, DIR already holds the step)."""


def register(app: typer.Typer) -> None:
    app.command("import", help=HELP, cls=Command)(import_command)


def import_command(
    source: Annotated[
        Path,
        typer.Argument(
            metavar="SRC",
            help="A torch.save file, a DCP directory, an HF model folder, a PEFT adapter or a "
            "DeepSpeed checkpoint folder.",
        ),
    ],
    dest: Annotated[
        str, typer.Argument(metavar="DIR", help="The run folder (or URL) to save it in.")
    ],
    model: Annotated[
        str, typer.Option("--model", help="package.module:factory building the live objects.")
    ],
    step: Annotated[
        int | None, typer.Option("--step", min=0, help="Step to save as (default: SRC's).")
    ] = None,
    ignore: Annotated[
        list[str] | None,
        typer.Option("--ignore", help="A top-level SRC entry to leave out (repeatable)."),
    ] = None,
    trust_pickle: Annotated[
        bool,
        typer.Option(
            "--trust-pickle",
            help="Unpickle SRC with plain pickle (can run code): only for files you trust.",
        ),
    ] = False,
    adapter: Annotated[
        str, typer.Option("--adapter", help="PEFT SRC: the model's adapter to load it into.")
    ] = "default",
    frozen: Annotated[
        str | None,
        typer.Option("--frozen", help="Passed to the Checkpointer saving DIR: save or verify."),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    from ..tools.importing import build, import_checkpoint, load_factory

    if trust_pickle:
        print(
            "WARNING: --trust-pickle: SRC is unpickled with plain pickle, which can run code "
            "it names; import only files from a source you trust.",
            file=sys.stderr,
        )
    if os.getcwd() not in sys.path:  # like `python -m`: the factory's module may be local
        sys.path.insert(0, os.getcwd())
    try:
        live_model, live_optimizer = build(load_factory(model))
    except (ValueError, TypeError) as exc:
        raise usage_error(exc) from None
    with guard():
        try:
            result = import_checkpoint(
                source,
                dest,
                live_model,
                live_optimizer,
                step=step,
                ignore=ignore or (),
                trust_pickle=trust_pickle,
                adapter=adapter,
                frozen=frozen,
            )
        except CheckpointError:
            raise  # some are also ValueErrors; guard() maps them
        except ValueError as exc:  # no step known, DIR already holds it, bad --frozen
            raise usage_error(exc) from None
    if as_json:
        emit_json(result.to_dict())
        return
    stdout().print(
        f"imported {escape(str(source))} ({result.source_kind}) as step {result.step}: "
        f"{result.model_tensors} model tensor(s)"
        + (f" (+{result.from_factory} as the factory built them)" if result.from_factory else "")
        + f", optimizer: {result.optimizer} "
        f"({result.optimizer_params} parameter(s)), scheduler: "
        f"{'yes' if result.scheduler else 'no'}\n  -> {escape(result.path)}"
        + (
            f"\n  left out on request: {', '.join(map(shown, result.ignored))}"
            if result.ignored
            else ""
        )
    )
