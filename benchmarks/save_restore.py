"""Save and restore, ours against the disk and every peer: the one benchmark suite.

    python benchmarks/save_restore.py                    # every CPU part; prints the tables
    python benchmarks/save_restore.py --quick            # tiny states, 1-2 runs: a smoke test
    python benchmarks/save_restore.py --batch 1 --write-docs --results docs/benchmarks.json
                                                         # make bench
    python benchmarks/save_restore.py --render docs/benchmarks.json --write-docs
                                                         # the pages again from kept figures
    python benchmarks/save_restore.py --parts single --sizes 4800 --ranks 4
    python benchmarks/save_restore.py --device cuda      # the GPU page (benchmarks/gpu.py)
    python benchmarks/save_restore.py --sizes 1200 --profile [--device cuda]

Every way to save and restore is a contender (``contenders.py``). The parts, each a
``measure`` and a ``render`` and the part of a page it owns:

- ``single`` (``part_single.py``, ``single_report.py``): every path in one process at
  each of ``--sizes``, and on ``--ranks`` FSDP2 ranks (``part_ranks.py``; 1: none), with
  the targets of issue 15: docs/benchmarks.md above the other sections.
- ``peers`` (``part_peers.py``): ours, DCP, ``torch.save`` and torch-checkpointing side by
  side at ``--peer-sizes``, restores in a fresh process: its section of that page.
- ``async`` (``part_async.py``): training blocked per ``async_save`` mode.
- ``store`` (``part_store.py``): S3 on loopback against local disk.
- ``tiers`` (``part_tiers.py``, ``tiers_worker.py``): the local tier over two torchrun
  agents: saves blocked, until replicated, resumes in a fresh launch from memory, a peer,
  the disk and DCP, and their floors: the ``Benchmark`` section of docs/tiers.md.
- ``frozen`` (``part_frozen.py``): trainable-only saves (``frozen="verify"``) against full
  ones, and the Hugging Face export and import against the disk floor: the ``Benchmark``
  section of docs/fine-tuning.md.
- ``device`` (``part_device.py``): one process on ``--device`` (a GPU), floors and every
  contender: docs/benchmarks-gpu.md (``benchmarks/gpu.py`` runs it).

On ``--device cpu`` the first four run by default (``tiers``: ``--parts tiers``, with
``--results docs/tiers.json``; ``frozen``: ``--parts frozen``); on ``--device cuda``, ``device``.
``--results FILE`` keeps every part's raw figures as JSON; ``--render FILE`` measures
nothing and renders the parts that FILE holds (also the JSON an older ``save_restore.py``
or ``gpu.py --results`` wrote). Never asserts timings.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import common
import part_async
import part_device
import part_frozen
import part_peers
import part_single
import part_store
import part_tiers
import profiling
import single_report
from report import DocsPart, Top, publish, shown_command


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of the suite: what it measures, how it renders, where its page part is."""

    # (args, log) -> the part's figures; the suite adds "command" and "elapsed" seconds
    measure: Callable[[argparse.Namespace, Callable[[str], None]], dict]
    render: Callable[..., str]  # (data, *, markdown) -> the report
    docs: DocsPart


PARTS = {
    "single": Part(part_single.measure, single_report.render, Top()),
    "peers": Part(part_peers.measure, part_peers.render, part_peers.SECTION),
    "async": Part(part_async.measure, part_async.render, part_async.SECTION),
    "store": Part(part_store.measure, part_store.render, part_store.SECTION),
    "device": Part(part_device.measure, part_device.render, part_device.PAGE),
    "tiers": Part(part_tiers.measure, part_tiers.render, part_tiers.SECTION),
    "frozen": Part(part_frozen.measure, part_frozen.render, part_frozen.SECTION),
}
CPU_PARTS = ["single", "peers", "async", "store"]


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def load_results(path: Path) -> dict[str, dict]:
    """Part -> its figures, from ``--results`` of this suite, or of the scripts before it
    (save_restore.py's figures are the part ``single``, gpu.py's the part ``device``)."""
    body = json.loads(path.read_text())
    if "results" in body:
        return {"single": body}
    if "figures" in body:
        return {"device": body}
    return body


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--device", choices=["cpu", "cuda"], default="cpu", help="where the state lives")
    add("--parts", nargs="+", choices=list(PARTS), help="default: the CPU parts; cuda: device")
    add("--quick", action="store_true", help="smoke test: tiny states, 1-2 runs of each")
    add("--sizes", type=float, nargs="+", metavar="MB", help="of single (or the one of device)")
    add("--ranks", type=int, default=2, help="FSDP2 ranks of single (1: one process only)")
    add("--peer-sizes", type=float, nargs="+", metavar="MB", help="of peers (default 300 1200)")
    add("--async-mb", type=float, default=part_async.MB, help="state size of async (MB)")
    add("--batch", type=int, default=part_async.BATCH, help="rows per training step of async")
    add("--store-mb", type=float, default=part_store.MB, help="state size of store (MB)")
    add("--tier-mb", type=float, default=part_tiers.MB, help="state size of tiers (MB)")
    add("--tier-nproc", type=int, default=part_tiers.NPROC, help="ranks per agent of tiers")
    add("--frozen-mb", type=float, default=part_frozen.MB, help="weights of frozen (MB)")
    add("--repeats", "--runs", type=int, help="runs per measurement (default 5; device 3)")
    add("--width", type=int, help="Linear layer width (default 2048; device 4096)")
    add("--tmpdir", default=tempfile.gettempdir(), help="where the checkpoints go (one disk)")
    add("--profile", action="store_true", help="instead: cProfile ours at each of --sizes")
    add("--top", type=int, default=25, help="functions listed by --profile")
    add("--results", metavar="JSON", help="also write every part's raw figures to JSON")
    add("--render", metavar="JSON", help="measure nothing: render the figures of --results")
    add("--markdown", action="store_true", help="also print the markdown")
    add(
        "--write-docs",
        nargs="?",
        const="",
        metavar="PATH",
        help="put each part's markdown in its part of its page (or of PATH)",
    )
    return parser


def main(argv: list[str] | None = None, command: str | None = None) -> None:
    """The suite; ``command``: the command line the pages show (default: this one's)."""
    parser = options()
    args = parser.parse_args(argv)
    command = command or shown_command("save_restore.py", sys.argv[1:])
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error(
            f"--device cuda: no CUDA device on this machine (torch {torch.__version__}, CUDA "
            f"build {torch.version.cuda or 'none'}); use --device cpu"
        )
    parts = args.parts or (["device"] if cuda else CPU_PARTS)
    if cuda and set(parts) - {"device"}:
        parser.error("on --device cuda only the part device runs (the others measure the CPU)")
    args.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP, 1 process
    if args.profile:
        sizes, width, _ = common.scale(args, [1200], part_single.WIDTH, 1)
        for mb in args.sizes or sizes:
            print("\n" + profiling.profile(mb, width, args.tmpdir, args.top, args.device))
        return
    if args.render:
        found = load_results(Path(args.render))
        figures = {name: found[name] for name in (args.parts or PARTS) if name in found}
    else:
        figures = {}
        for name in parts:
            started = time.perf_counter()
            figures[name] = {**PARTS[name].measure(args, log), "command": command}
            figures[name]["elapsed"] = time.perf_counter() - started
            log(f"part {name}: {figures[name]['elapsed']:.0f} s")
        if args.results:
            Path(args.results).write_text(json.dumps(figures, indent=1))
    for name, data in figures.items():
        part, page = PARTS[name], args.write_docs
        if name == "device" and page == "" and not data["cuda"]:
            log(f"not written: {part.docs.path} is a GPU's page (give --write-docs a PATH)")
            page = None
        publish(
            part.render(data, markdown=False),
            lambda part=part, data=data: part.render(data, markdown=True),
            part.docs,
            show=args.markdown,
            page=None if page is None else Path(page or part.docs.path),
        )


if __name__ == "__main__":
    main()
