"""``unbroken export DIR --to FILE.safetensors``: ship consolidated model weights."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ._common import (
    Command,
    JsonOption,
    StepOption,
    emit_json,
    guard,
    human_bytes,
    progress,
    stdout,
)
from ._safe import shown

HELP = """Write a checkpoint's model weights as one consolidated .safetensors file.

Keys are the model's parameter and buffer FQNs (no `model/` prefix); shards of any world
size are assembled into whole tensors. --dtype casts floating-point tensors (integer and
bool buffers keep their dtype). The file's metadata records step, source path and
unbroken version. Memory stays bounded by the largest tensor: the header is computed
from the manifest, then tensors are streamed one at a time, each verified (checksums and
fingerprint) before it is written. The file appears only when complete.

Exit 0 on success, 1 if the checkpoint is damaged, 2 if DIR is not a checkpoint."""


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
    to: Annotated[Path, typer.Option("--to", help="The .safetensors file to write.")],
    dtype: Annotated[
        ExportDtype | None, typer.Option("--dtype", help="Cast floating-point weights.")
    ] = None,
    step: StepOption = None,
    as_json: JsonOption = False,
) -> None:
    from ..tools.exporting import export_checkpoint

    with guard(), progress("exporting") as advance:
        cast = dtype.value if dtype is not None else None
        result = export_checkpoint(path, to, dtype=cast, step=step, progress=advance)
    if as_json:
        emit_json(result.to_dict())
        return
    console = stdout()
    console.print(
        f"wrote {escape(result.path)}: {result.tensors} tensor(s), "
        f"{human_bytes(result.bytes)}, step {result.step}"
        + (f", {dtype.value}" if dtype is not None else "")
    )
    for alias, target in result.tied.items():
        console.print(f"tied: {shown(alias)} = {shown(target)}, written once (as {shown(target)})")
    if result.skipped:
        console.print(
            f"[yellow]not exported (not tensors):[/yellow] {', '.join(map(shown, result.skipped))}"
        )
