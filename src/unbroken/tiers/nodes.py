"""Which ranks share a node, and where each rank's replicas go.

A node is the set of ranks of one torchrun agent (``GROUP_RANK``), or of one host where
no agent says. Nodes are numbered by their lowest rank. Replicas follow a ring: the
``k``-th copy of the shards of node ``n`` goes to node ``(n + k) % N``, each rank's to
the rank at the same place there (wrapping where that node has fewer ranks). The rule
is recorded in every local manifest (``tier``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

from ..core import collective

PLACEMENT = "ring"  # the rule above, as manifests name it


def node_key() -> str:
    """This process's node: its torchrun agent, else its host."""
    agent = os.environ.get("GROUP_RANK")
    return f"agent {agent}" if agent not in (None, "") else f"host {socket.gethostname()}"


@dataclasses.dataclass(frozen=True)
class Nodes:
    """The job's nodes: the ranks of each, nodes ordered by their lowest rank."""

    ranks: tuple[tuple[int, ...], ...]

    @classmethod
    def discover(cls) -> Nodes:
        """Every rank's node, agreed in one round. Collective."""
        keys = collective.gather_all(node_key())
        order: dict[str, list[int]] = {}
        for r, key in enumerate(keys):
            order.setdefault(key, []).append(r)
        return cls(tuple(tuple(rs) for rs in order.values()))

    @property
    def count(self) -> int:
        return len(self.ranks)

    def node_of(self, rank: int) -> int:
        return next(n for n, rs in enumerate(self.ranks) if rank in rs)

    def leader(self, node: int) -> int:
        """The rank that acts for its node (lists, commits, checks its folder)."""
        return self.ranks[node][0]

    def is_leader(self, rank: int) -> bool:
        return self.leader(self.node_of(rank)) == rank

    def placed(self, replicas: int) -> int:
        """How many replicas can be placed: at most one per other node."""
        return min(replicas, self.count - 1)

    def targets(self, rank: int, replicas: int) -> list[int]:
        """The ranks that keep ``rank``'s replicas (one per other node, ring order)."""
        n = self.node_of(rank)
        place = self.ranks[n].index(rank)
        out = []
        for k in range(1, self.placed(replicas) + 1):
            there = self.ranks[(n + k) % self.count]
            out.append(there[place % len(there)])
        return out

    def sources(self, rank: int, replicas: int) -> list[int]:
        """The ranks whose replicas ``rank`` keeps."""
        every = (r for rs in self.ranks for r in rs)
        return [r for r in every if rank in self.targets(r, replicas)]

    def record(self, replicas: int) -> dict[str, Any]:
        """The placement as a local manifest records it."""
        return {
            "nodes": [list(rs) for rs in self.ranks],
            "replicas": self.placed(replicas),
            "placement": PLACEMENT,
        }
