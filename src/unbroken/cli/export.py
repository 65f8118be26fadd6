"""``unbroken export DIR --to FILE.safetensors``: ship consolidated model weights (or an
HF model folder, ``--format hf``, or a PEFT adapter, ``--format peft``)."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..errors import CheckpointError
from ._common import (
    Command,
    JsonOption,
    StepOption,
    emit_json,
    guard,
    human_bytes,
    progress,
    stdout,
    usage_error,
)
from ._safe import shown

HELP = """Write a checkpoint's model weights for other tools.

--format safetensors (default): one consolidated .safetensors file. Keys are the model's
parameter and buffer FQNs (no `model/` prefix); shards of any world size are assembled
into whole tensors.

--format hf: a folder transformers loads with from_pretrained: the tensors split into
model-0000K-of-0000N.safetensors shards of at most --max-shard-size (default 50GB, as
transformers' save_pretrained; a larger tensor gets a shard of its own) with
model.safetensors.index.json, or model.safetensors alone when one shard holds all;
--config copies a config.json (or a folder's) beside them.

--format peft: a PEFT LoRA adapter folder (adapter_model.safetensors under PEFT's names,
adapter_config.json) that PeftModel.from_pretrained loads; --adapter picks the adapter,
--config gives its adapter_config.json (default: the one the checkpoint records).

A tied weight is written once (as save_pretrained does). --dtype casts floating-point
tensors (integer and bool buffers keep their dtype). Model files' metadata records step,
source path and unbroken version. Memory stays bounded by the largest tensor: headers
are computed from the manifest, then tensors are streamed one at a time, each verified
(checksums and fingerprint) before it is written. Nothing appears at --to until all is
written; a folder --to must not exist (or be empty).

A checkpoint saved with frozen="verify" stores no frozen parameter: --base names the base
model to take them from (an HF folder, a .safetensors file, or a folder of them), each
checked against the fingerprint recorded at save. --format peft never needs it.

Exit 0 on success, 1 if the checkpoint (or the base) is damaged or does not fit, 2 if
DIR is not a checkpoint or an option is malformed."""


class ExportFormat(enum.StrEnum):
    safetensors = "safetensors"
    hf = "hf"
    peft = "peft"


class ExportDtype(enum.StrEnum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


def register(app: typer.Typer) -> None:
    app.command("export", help=HELP, cls=Command)(export_command)


def export_command(
    path: Annotated[
        str, typer.Argument(metavar="DIR", help="A run folder or one step folder (or URL).")
    ],
    to: Annotated[
        Path, typer.Option("--to", help="The .safetensors file, or the folder, to write.")
    ],
    format: Annotated[
        ExportFormat, typer.Option("--format", help="safetensors (one file), hf or peft.")
    ] = ExportFormat.safetensors,
    max_shard_size: Annotated[
        str,
        typer.Option(
            "--max-shard-size", help="hf: bytes per shard at most: 5GB, 500MB, 2KB or bytes."
        ),
    ] = "50GB",
    dtype: Annotated[
        ExportDtype | None, typer.Option("--dtype", help="Cast floating-point weights.")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", help="hf: config.json to copy; peft: adapter_config.json (or folders)."
        ),
    ] = None,
    base: Annotated[
        Path | None,
        typer.Option("--base", help="The base model of a frozen='verify' checkpoint."),
    ] = None,
    adapter: Annotated[
        str, typer.Option("--adapter", help="peft: the adapter to export.")
    ] = "default",
    step: StepOption = None,
    as_json: JsonOption = False,
) -> None:
    from ..tools.exporting import export_checkpoint
    from ..tools.hf_export import parse_shard_size

    try:
        shard_size = parse_shard_size(max_shard_size)
    except ValueError as exc:
        raise usage_error(exc) from None
    with guard(), progress("exporting") as advance:
        cast = dtype.value if dtype is not None else None
        try:
            result = export_checkpoint(
                path,
                to,
                format=format.value,
                max_shard_size=shard_size,
                dtype=cast,
                step=step,
                config=config,
                base=base,
                adapter=adapter,
                progress=advance,
            )
        except CheckpointError:
            raise
        except ValueError as exc:  # a malformed --config
            raise usage_error(exc) from None
    if as_json:
        emit_json(result.to_dict())
        return
    console = stdout()
    files = f" ({len(result.files)} file(s))" if result.format != "safetensors" else ""
    console.print(
        f"wrote {escape(result.path)}{files}: {result.tensors} tensor(s), "
        f"{human_bytes(result.bytes)}, step {result.step}"
        + (f", {dtype.value}" if dtype is not None else "")
    )
    for alias, target in result.tied.items():
        console.print(f"tied: {shown(alias)} = {shown(target)}, written once (as {shown(target)})")
    if result.from_base:
        console.print(
            f"from the base, checked by fingerprint: {len(result.from_base)} frozen tensor(s)"
        )
    if result.skipped:
        console.print(
            f"[yellow]not exported (not tensors):[/yellow] {', '.join(map(shown, result.skipped))}"
        )
