"""Decisions shared by every rank in as few rounds as possible (issue 15): rank 0's
answer in one broadcast, and the checks after install agreed in one round, with the probe
still run by every rank (a forward of a sharded model is collective)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from . import launcher, models

pytestmark = pytest.mark.distributed


def _rank0_answers(rank: int) -> dict:
    from unbroken.core import collective

    calls = []

    def answer() -> dict:
        calls.append(rank)
        return {"steps": [3, 1], "from": rank}

    def refuse() -> None:
        calls.append(rank)
        raise FileNotFoundError("no such checkpoint folder: /x (on rank 0)")

    got = collective.on_rank0(answer)
    try:
        collective.on_rank0(refuse)
        refused = "nothing raised"
    except FileNotFoundError as exc:
        refused = str(exc)
    return {"got": got, "refused": refused, "calls": calls}


def _agreeing(rank: int, failing: int | None, agree) -> dict:
    def check() -> str:
        if rank == failing:
            raise ValueError(f"rank {rank}: a chunk fails its checksum")
        return f"ok on {rank}"

    try:
        result, values = agree(check)
        return {"result": result, "values": values}
    except ValueError as exc:
        return {"error": str(exc)}


_TOP = (1 << 64) - 1  # a share near 2**64: the sums over ranks wrap


def _primitives(rank: int, world: int) -> dict:
    """Worker: each collective primitive on its own, ending in agreement every time, so
    that one job serves every test below (and a failure leaves the ranks in step)."""
    from unbroken.core import collective

    def sharing(check):
        return collective.agree_sharing(check, {"partial": 10 * rank})

    def summing(check):
        return collective.agree_summing(check, [_TOP - rank, rank, 1 << 63])

    return {
        "on_rank0": _rank0_answers(rank),
        "gathered": collective.gather_to_rank0({"rank": rank, "file": f"rank_{rank:05d}.bin"}),
        "sharing": [_agreeing(rank, failing, sharing) for failing in (None, 1)],
        "summing": [_agreeing(rank, failing, summing) for failing in (None, 2)],
    }


@pytest.fixture(scope="module")
def primitives() -> list[dict]:
    return launcher.run(_primitives, 3)


def test_rank0_answer_reaches_every_rank_and_so_does_its_error(primitives):
    """Only rank 0 runs the function; its value, or its error (same type), reaches every
    rank in one broadcast: no rank goes on alone while another raises."""
    for rank, got in enumerate(primitives):
        r = got["on_rank0"]
        assert r["got"] == {"steps": [3, 1], "from": 0}, r
        assert "no such checkpoint folder" in r["refused"], r
        assert r["calls"] == ([0, 0] if rank == 0 else []), r
        assert ("[rank 0]" in r["refused"]) == (rank != 0), r


def test_a_save_gathers_its_records_on_rank0_only(primitives):
    """Only rank 0 writes the manifest: every rank's records reach it, in rank order, and
    no other rank receives them (at a thousand ranks, a thousand times the bytes)."""
    assert primitives[0]["gathered"] == [{"rank": r, "file": f"rank_{r:05d}.bin"} for r in range(3)]
    assert [got["gathered"] for got in primitives[1:]] == [None, None]


def test_agree_sharing_hands_every_rank_all_values_or_the_first_error(primitives):
    """Values shared in the agreeing round arrive in rank order; a failure on one rank is
    raised on all of them."""
    for rank, got in enumerate(primitives):
        ok, failed = got["sharing"]
        want = [{"partial": p} for p in (0, 10, 20)]
        assert ok == {"result": f"ok on {rank}", "values": want}, ok
        assert "rank 1: a chunk fails its checksum" in failed["error"], failed


def test_agree_summing_adds_64_bit_shares_exactly_or_raises_the_first_error(primitives):
    """The shares of a sharded tensor's fingerprint add up modulo 2**64 over the ranks in
    one small all-reduce (not a gather of every rank's shares on every rank); a failure
    on one rank is still raised, with its message, on every rank."""
    want = [(3 * _TOP - 3) % (1 << 64), 3, (3 << 63) % (1 << 64)]
    for rank, got in enumerate(primitives):
        ok, failed = got["summing"]
        assert ok == {"result": f"ok on {rank}", "values": want}, ok
        assert "rank 2: a chunk fails its checksum" in failed["error"], failed


def _local_state(model) -> dict[str, torch.Tensor]:
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


def _restore_with_probe(rank: int, world: int, path: str, fault: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub
    from unbroken.live import exchange, probe

    mesh = init_device_mesh("cpu", (world,))
    model, opt = models.build(fsdp_mesh=mesh)
    models.train_steps(model, opt, 2, rank=rank)
    x = torch.ones(2, 13)
    ub.Checkpointer(path, model=model, optimizer=opt, probe=lambda m: m(x).sum()).save(2)
    dist.barrier()

    forwards = []

    def counted(m):
        forwards.append(rank)
        return m(x).sum()

    if fault == "install" and rank == 1:  # rank 1 leaves its weights as they were
        exchange.Exchange.install = lambda self: None
    if fault == "probe" and rank == 1:  # rank 1's probe sees other weights
        real = probe.record
        probe.record = lambda fn, m: {**real(fn, m), "values": [-1.0]}
    fresh, fresh_opt = models.build(seed=1, fsdp_mesh=mesh)
    before = _local_state(fresh)
    try:
        ub.Checkpointer(path, model=fresh, optimizer=fresh_opt, probe=counted).restore()
        outcome = "restored"
    except ub.StateMismatchError as exc:
        outcome = str(exc)
    now = _local_state(fresh)
    return {
        "outcome": outcome,
        "forwards": forwards,
        "put_back": all(torch.equal(now[k], before[k]) for k in now),
    }


@pytest.mark.parametrize("fault", ["install", "probe"])
def test_a_failed_check_on_one_rank_fails_every_rank_after_every_rank_probed(tmp_path, fault):
    """F4 on one rank (its install skipped, or its probe sees other weights): the checks
    and the probe are agreed in one round, and every rank runs the probe's forward even
    when its own check already failed (FSDP2's forward all-gathers: a rank that skipped it
    would leave the others waiting). Every rank refuses and puts its model back."""
    got = launcher.run(_restore_with_probe, 2, str(tmp_path / "c"), fault, timeout=180)
    for r in got:
        assert len(r["forwards"]) == 1, r  # the probe's forward ran once on every rank
        if fault == "install":
            assert "differs from the loaded one" in r["outcome"], r
        else:
            assert "the probe differs after restore" in r["outcome"], r
        assert r["put_back"], r


def _fsdp1_install_missed_on_rank1(rank: int, world: int, path: str) -> dict:
    import torch.distributed as dist

    import unbroken as ub
    from unbroken.live.state import ModelComponent

    model, opt = models.build_fsdp1(use_orig_params=True)
    models.train_steps(model, opt, 2, rank=rank)
    ub.Checkpointer(path, model=model, optimizer=opt).save(2)
    dist.barrier()
    if rank == 1:  # rank 1's model is installed (collectively), then one value is wrong
        real = ModelComponent.install

        def install_then_spoil(self, state):
            real(self, state)
            with torch.no_grad():
                next(p for p in fresh.parameters() if p.numel()).view(-1)[0] += 1

        ModelComponent.install = install_then_spoil
    fresh, fresh_opt = models.build_fsdp1(seed=1, use_orig_params=True)
    try:
        ub.Checkpointer(path, model=fresh, optimizer=fresh_opt).restore()
        return {"outcome": "restored"}
    except ub.CheckpointError as exc:
        return {"outcome": str(exc)}


def test_fsdp1_a_check_failed_on_one_rank_still_lets_every_rank_run_the_next(tmp_path):
    """F5 on one FSDP1 rank: its model check fails, and it still captures its optimizer's
    state for that check, which FSDP1 does collectively; a rank that skipped it would
    leave the other waiting. Every rank refuses, naming the model. Rank 1's rollback goes
    through the same spoiling install, so it says its model could not be put back as it
    was (issue 36, item 4), never that nothing was changed."""
    got = launcher.run(_fsdp1_install_missed_on_rank1, 2, str(tmp_path / "c"), timeout=120)
    for r in got:
        assert "'model' failed verification" in r["outcome"], r
    assert "could not be put back as it was" in got[1]["outcome"], got[1]
    assert "nothing was changed" not in got[1]["outcome"], got[1]


def _save_fsdp2(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub

    model, opt = models.build(fsdp_mesh=init_device_mesh("cpu", (world,)))
    models.train_steps(model, opt, 2, rank=rank)
    ub.Checkpointer(path, model=model, optimizer=opt).save(2)


def _restore_fsdp2(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import unbroken as ub

    fresh, fresh_opt = models.build(seed=1, fsdp_mesh=init_device_mesh("cpu", (world,)))
    before = _local_state(fresh)
    try:
        ub.Checkpointer(path, model=fresh, optimizer=fresh_opt).restore(
            reset={"rng"} if world != 2 else set()
        )
        outcome = "restored"
    except ub.CheckpointError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    now = _local_state(fresh)
    return {"outcome": outcome, "untouched": all(torch.equal(now[k], before[k]) for k in now)}


@pytest.fixture(scope="module")
def fsdp2_saved(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fsdp2") / "c"
    launcher.run(_save_fsdp2, 2, str(path))
    return path


@pytest.mark.parametrize("world", [2, 3], ids=["same-world", "resharded-2-to-3"])
def test_a_sharded_value_that_misses_its_fingerprint_is_refused_on_every_rank(
    tmp_path, fsdp2_saved, world
):
    """Every rank's share of a sharded tensor's fingerprint adds up to the saved one, or
    the restore is refused on every rank before anything live changes. The manifest's
    fingerprint of one sharded weight is altered (and the manifest re-sealed), its bytes
    and checksums left intact: what a read into the wrong place would look like."""
    import tamper

    path = tmp_path / "c"
    shutil.copytree(fsdp2_saved, path)
    folder = path / "step_00000002"
    doc = tamper.read(folder)
    key = next(k for k, e in doc["tensors"].items() if k.endswith("weight") and "stride" not in e)
    doc["tensors"][key]["fingerprint"] = "0123456789abcdef"
    tamper.write(folder, doc)
    for r in launcher.run(_restore_fsdp2, world, str(path)):
        assert "CorruptCheckpointError" in r["outcome"], r
        assert f"{key}: the loaded value does not match its saved fingerprint" in r["outcome"], r
        assert r["untouched"], r
