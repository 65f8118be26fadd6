"""The suite's part ``frozen``: trainable-only checkpoints (issue 38), the ``Benchmark``
section of docs/fine-tuning.md.

One process on the CPU. The state: Linear(width, width) layers (``--frozen-mb`` MB of
weights), all frozen but the last ~5% of them, which AdamW trains (one step taken). For
``frozen="save"`` (everything written) and ``frozen="verify"`` (the frozen base left out,
fingerprinted at every save and checked at every restore), after one warm-up save each:

1. seconds of ``save()`` and the bytes it wrote (the step folder's files);
2. seconds of ``restore()`` into the live model (warm page cache);
3. the floor: the bytes of the trainable-only save written to one file and fsynced.

The full checkpoint is also exported as sharded Hugging Face safetensors (``SHARD`` a
shard) and imported back into a fresh model (``import_checkpoint``, which saves it as an
unbroken checkpoint), each against its floor: the same bytes written to one file and
fsynced, and read back (warm).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import unbroken as ub
from common import ROOT, machine_info, scale
from report import PageSection, median, ratio, size_text, table

PAGE = ROOT / "docs" / "fine-tuning.md"
SECTION = PageSection("frozen-benchmark", PAGE, "# Fine-tuning")
MB, WIDTH, REPEATS, TRAINABLE = 1200, 2048, 5, 0.05
SHARD = "500MB"  # the export's --max-shard-size: several shards


def build(mb: float, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The layers, the last ``TRAINABLE`` share trainable, AdamW after one step."""
    torch.manual_seed(0)
    layers = max(2, round(mb * 1e6 / (width * width * 4)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    trainable = max(1, round(layers * TRAINABLE))
    for i, layer in enumerate(model):
        layer.requires_grad_(i >= layers - trainable)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _write_floor(nbytes: int, where: Path) -> float:
    data = os.urandom(min(nbytes, 64 << 20))
    start = time.perf_counter()
    with open(where, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(data[: min(left, len(data))])
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - start
    return took


def _read_floor(where: Path) -> float:
    start = time.perf_counter()
    with open(where, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - start


def bench_mode(model, opt, mode: str, root: Path, repeats: int) -> dict:
    """Saves and restores under ``frozen=mode``: seconds, and the bytes of the last save."""
    path = root / mode
    saves, restores = [], []
    with ub.Checkpointer(path, model=model, optimizer=opt, frozen=mode, keep_last=1) as ck:
        ck.save(0)  # warm-up: the first save allocates what later ones reuse
        for step in range(1, repeats + 1):
            start = time.perf_counter()
            ck.save(step)
            saves.append(time.perf_counter() - start)
    nbytes = _folder_bytes(path / f"step_{repeats:08d}")
    for _ in range(repeats):
        with ub.Checkpointer(path, model=model, optimizer=opt, frozen=mode) as ck:
            start = time.perf_counter()
            report = ck.restore()
            restores.append(time.perf_counter() - start)
        assert report.verified and (mode == "save" or report.frozen_verified > 0)
    return {"save": saves, "restore": restores, "bytes": nbytes}


def bench_formats(model, root: Path, repeats: int) -> dict:
    """Export of the full checkpoint as sharded HF safetensors and import back, each with
    its floor."""
    source = root / "save"
    exports, imports, writes, reads = [], [], [], []
    nbytes = 0
    for i in range(repeats):
        out = root / f"hf-{i}"
        start = time.perf_counter()
        ub.export_checkpoint(source, out, format="hf", max_shard_size=SHARD)
        exports.append(time.perf_counter() - start)
        nbytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        writes.append(_write_floor(nbytes, root / "floor.bin"))
        reads.append(_read_floor(root / "floor.bin"))
        dest = root / f"imported-{i}"
        start = time.perf_counter()
        ub.import_checkpoint(out, dest, _fresh(model), step=0)
        imports.append(time.perf_counter() - start)
        shutil.rmtree(out)
        shutil.rmtree(dest)
    return {"export": exports, "import": imports, "write": writes, "read": reads, "bytes": nbytes}


def _fresh(model: torch.nn.Module) -> torch.nn.Module:
    width = model[0].in_features
    with torch.device("meta"):
        fresh = torch.nn.Sequential(
            *(torch.nn.Linear(width, width, bias=False) for _ in range(len(model)))
        )
    return fresh.to_empty(device="cpu")


def measure(args: argparse.Namespace, log) -> dict:
    """The part's figures, as ``--results`` keeps them (and ``--render`` reads)."""
    (mb,), width, repeats = scale(args, [args.frozen_mb], WIDTH, REPEATS, 2)
    info = machine_info(args.tmpdir)
    model, opt = build(mb, width)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    log(f"frozen: {params / 1e9:.2f} GB of weights, {trainable / params:.1%} trainable")
    modes = {}
    with tempfile.TemporaryDirectory(prefix="ub-frozen-", dir=args.tmpdir) as tmp:
        root = Path(tmp)
        for mode in ("save", "verify"):
            log(f"  frozen={mode!r} ...")
            modes[mode] = bench_mode(model, opt, mode, root, repeats)
        floor = [_write_floor(modes["verify"]["bytes"], root / "floor.bin") for _ in range(repeats)]
        formats = bench_formats(model, root, max(2, repeats // 2))
    return {"info": info, "params": params, "trainable": trainable, "width": width,
            "modes": modes, "floor": floor, "formats": formats}  # fmt: skip


def _secs(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f})"


def _rate(gb: float, xs: list[float]) -> str:
    return f"{gb / statistics.median(xs):.2f}"


def render(data: dict, *, markdown: bool) -> str:
    full, mine = data["modes"]["save"], data["modes"]["verify"]
    rows = [
        ["`frozen=\"save\"`", _secs(full["save"]), size_text(full["bytes"]), "1.00x",
         _secs(full["restore"]), "1.00x"],
        ["`frozen=\"verify\"`", _secs(mine["save"]), size_text(mine["bytes"]),
         ratio(mine["bytes"], full["bytes"]), _secs(mine["restore"]),
         ratio(median(mine["restore"]), median(full["restore"]))],
        ["floor: its bytes written, fsynced", _secs(data["floor"]), size_text(mine["bytes"]),
         "-", "-", "-"],
    ]  # fmt: skip
    text = table(["save", "save() s, median (min)", "bytes", "bytes / full",
                  "restore() s, median (min)", "restore / full"], rows)  # fmt: skip
    formats = data.get("formats")
    if formats:
        gb = formats["bytes"] / 1e9
        both = [r + w for r, w in zip(formats["read"], formats["write"], strict=True)]
        frows = [
            ["export --format hf", _secs(formats["export"]), _rate(gb, formats["export"]),
             ratio(median(formats["export"]), median(formats["write"]))],
            ["import (HF folder -> unbroken checkpoint)", _secs(formats["import"]),
             _rate(gb, formats["import"]), ratio(median(formats["import"]), median(both))],
            ["floor: write + fsync", _secs(formats["write"]), _rate(gb, formats["write"]), "-"],
            ["floor: read (warm)", _secs(formats["read"]), _rate(gb, formats["read"]), "-"],
            ["floor: read + write + fsync", _secs(both), _rate(gb, both), "-"],
        ]  # fmt: skip
        text += "\n\n" + table(["conversion", "s, median (min)", "GB/s", "/ its floor"], frows)
    if not markdown:
        return text
    share = data["trainable"] / data["params"]
    saved = (median(full["save"]) or 0) / (median(mine["save"]) or 1)
    return (
        f"## Benchmark: trainable-only checkpoints, {data['params'] / 1e9:.2f} GB of weights, "
        f"{share:.1%} trainable\n\n"
        f"Generated by `{data['command']}`; only this section. Linear({data['width']}, "
        f"{data['width']}) layers without bias, the last {share:.0%} trained by AdamW (one "
        "step taken), the rest frozen; one process, after one warm-up save per mode. "
        'Median of the runs (min). `frozen="verify"` fingerprints the whole frozen base at '
        "every save and checks it at every restore: that is in its times. The export's "
        "floor is writing its bytes (fsynced); the import reads the folder and saves an "
        "unbroken checkpoint of it, so its floor is a read and a write.\n\n"
        f"{text}\n\n"
        f"The trainable-only save is {saved:.1f}x faster than the full one and writes "
        f"{ratio(mine['bytes'], full['bytes'])} of its bytes.\n\n"
        f"Machine: {', '.join(f'{k}: {v}' for k, v in data['info'].items())}.\n"
    )
