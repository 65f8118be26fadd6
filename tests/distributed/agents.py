"""Several torchrun agents of one job on this machine, meeting through a c10d rendezvous
on loopback as agents on separate hosts would (tests/distributed/test_many_nodes.py,
test_local_tier.py). Every launch runs under a timeout; whatever still runs then (agents
and their workers) is killed, so nothing is left waiting."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from processes import descendants, free_port

TIMEOUT_S = 120  # per launch, all agents together


def launch(
    script: Path,
    nodes: int,
    args: list[str],
    logs: Path,
    env: dict[str, str] | None = None,
    *,
    nproc: int = 1,
    check: bool = True,
) -> list[int]:
    """``nodes`` torchrun agents of ``nproc`` processes each running ``script``; returns
    the agents' exit codes. ``check``: raise with every agent's log unless all exit 0
    within ``TIMEOUT_S``."""
    endpoint, job = f"127.0.0.1:{free_port()}", uuid.uuid4().hex
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("UNBROKEN_")}
    full_env.update(OMP_NUM_THREADS="1", **(env or {}))
    logs.mkdir(parents=True, exist_ok=True)
    agents: list[tuple[subprocess.Popen, Path]] = []
    late = ""
    try:
        for node in range(nodes):
            log = logs / f"node_{node}.log"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes)]
            cmd += ["--nproc-per-node", str(nproc), "--rdzv-backend", "c10d"]
            cmd += ["--rdzv-endpoint", endpoint, "--rdzv-id", job]
            # node 0 hosts the rendezvous store; the others connect to it
            cmd += ["--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", "127.0.0.1"]
            cmd += ["--max-restarts", "0", "--monitor-interval", "0.1", str(script), *args]
            with log.open("w") as out:
                agent = subprocess.Popen(
                    cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            agents.append((agent, log))
        deadline = time.monotonic() + TIMEOUT_S
        for agent, _ in agents:
            agent.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # reported below, with every agent's log
        late = f" (still running after {TIMEOUT_S}s: killed)"
    finally:
        running = [a.pid for a, _ in agents if a.poll() is None]
        # Each worker is in a session of its own (torchrun starts it so): kill them by
        # id, found before their agent dies, then each agent's group.
        for pid in [p for agent in running for p in descendants(agent)] + running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for agent, _ in agents:
            agent.wait()
    codes = [a.returncode for a, _ in agents]
    failed = [(n, a.returncode, log) for n, (a, log) in enumerate(agents) if a.returncode != 0]
    if check and (failed or late):
        shown = "\n".join(
            f"--- node {n} exited with {rc} ---\n{log.read_text()[-4000:]}" for n, rc, log in failed
        )
        raise AssertionError(f"{nodes} node(s) running {args}{late}:\n{shown}")
    return codes
