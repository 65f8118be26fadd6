"""Installing a model by exchanging bytes with the live tensors (issue 15, restore speed and
memory) must be exactly what ``load_state_dict`` would have done, undoable at any point,
and still proven by the comparison after install; models it cannot serve faithfully go
through ``load_state_dict`` as before."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from torch import nn

import unbroken as ub
from conftest import Problem, TinyNet, assert_same_training_state
from unbroken.core import verify
from unbroken.live import exchange


def _trained(tmp_path, steps: int = 4) -> Problem:
    p = Problem()
    for _ in range(steps):
        p.step()
    p.checkpointer(tmp_path).save(steps)
    return p


@pytest.fixture
def plans(monkeypatch):
    """Records whether each restore's model was planned for an exchange."""
    seen: list[bool] = []
    real = exchange.plan

    def spy(*args, **kwargs):
        got = real(*args, **kwargs)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(exchange, "plan", spy)
    return seen


def test_exchange_installs_exactly_in_the_same_objects(tmp_path, plans):
    """F1/F4: the resumed run continues bit for bit; the parameters stay the same objects at
    the same addresses (a view taken before restore sees the restored weights)."""
    saved = _trained(tmp_path)
    at_save = {k: v.clone() for k, v in saved.model.state_dict().items()}
    going_on = [saved.step() for _ in range(3)]
    live = Problem(seed=3)
    params = list(live.model.parameters())
    addresses = [p.data_ptr() for p in params]
    view = live.model.inp.weight.detach()[0]
    report = live.checkpointer(tmp_path).restore()  # puts the global RNG back, too
    assert report.verified and plans == [True]
    assert list(live.model.parameters()) == params
    assert [p.data_ptr() for p in params] == addresses
    assert torch.equal(view, at_save["inp.weight"][0])
    for k, v in live.model.state_dict().items():
        assert torch.equal(v, at_save[k]), k
    assert [live.step() for _ in range(3)] == going_on
    assert_same_training_state(saved, live)


def test_a_broken_exchange_is_caught_by_the_check_after_install(tmp_path, plans, monkeypatch):
    """F4 (weights not installed): an install that leaves the live weights as they were
    fails verification, and the model is put back."""
    _trained(tmp_path)
    live = Problem(seed=3)
    before = {k: v.clone() for k, v in live.model.state_dict().items()}
    monkeypatch.setattr(exchange.Exchange, "install", lambda self: None)
    with pytest.raises(ub.StateMismatchError, match="differs from the loaded one"):
        live.checkpointer(tmp_path).restore()
    assert plans == [True]
    for k, v in live.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_failed_check_is_reported_before_the_probe_and_the_probe_still_runs(
    tmp_path, plans, monkeypatch
):
    """F4 (weights not installed) with a probe: the probe differs too, but the check that
    names the tensor is what the error reports; the probe still ran (in a sharded model
    its forward is collective, so every rank runs it whatever its own check found), and
    the model is put back."""
    x = torch.ones(2, 8)  # into the last layer: TinyNet's forward counts what it sees
    saved = Problem()
    saved.step()
    saved.checkpointer(tmp_path, probe=lambda m: m.out(x).sum()).save(1)
    live = Problem(seed=3)
    before = {k: v.clone() for k, v in live.model.state_dict().items()}
    probed = []

    def probe(m):
        probed.append(1)
        return m.out(x).sum()

    monkeypatch.setattr(exchange.Exchange, "install", lambda self: None)
    with pytest.raises(ub.StateMismatchError, match="differs from the loaded one") as raised:
        live.checkpointer(tmp_path, probe=probe).restore()
    assert "probe" not in str(raised.value).split("(nothing was changed")[0]
    assert probed == [1]
    for k, v in live.model.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("by", ["checksum", "fingerprint"])
def test_an_exchange_that_installs_one_wrong_bit_is_caught(tmp_path, plans, monkeypatch, by):
    """F4/F5 (a value not installed as saved): one flipped bit in a live weight after the
    exchange fails the check after install, whether it compares the live bytes with the
    checksum of the one chunk read straight into the loaded tensor (same layout) or, for a
    tensor read in pieces (resharded), the live fingerprint with the loaded one; the model
    is put back."""
    _trained(tmp_path)
    live = Problem(seed=3)
    before = {k: v.clone() for k, v in live.model.state_dict().items()}
    real_install, real_compare = exchange.Exchange.install, verify.compare_exchanged
    paths: list[bool] = []

    def install_then_flip(self):
        real_install(self)
        live.model.inp.weight.detach().view(-1).view(torch.int32)[5] ^= 1

    def compare(keys, loaded, live_tensors, algorithm, read_whole):
        keys = list(keys)
        if by == "fingerprint":
            read_whole = {}  # as if every tensor had been read in pieces
        paths.append(all(k in read_whole for k in keys if k.endswith("inp.weight")))
        return real_compare(keys, loaded, live_tensors, algorithm, read_whole)

    monkeypatch.setattr(exchange.Exchange, "install", install_then_flip)
    monkeypatch.setattr(verify, "compare_exchanged", compare)
    with pytest.raises(ub.StateMismatchError, match=r"inp\.weight: the live value differs"):
        live.checkpointer(tmp_path).restore()
    assert plans == [True] and paths == [by == "checksum"]
    for k, v in live.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def _exchange_for(model: nn.Module, source: nn.Module) -> tuple[exchange.Exchange, dict]:
    live = dict(model.state_dict())
    targets = {k: v.clone() for k, v in source.state_dict().items()}
    plan = exchange.plan({None: model}, live, targets)
    assert plan is not None
    return plan, targets


@pytest.mark.parametrize("chunk", [64, 1 << 20])
def test_an_interrupt_anywhere_in_the_exchange_is_undone(monkeypatch, chunk):
    """All or nothing (issue 10): a Ctrl-C between any two statements of the exchange (tried
    at every one of them) leaves the model exactly as it was after undo."""
    monkeypatch.setattr(exchange, "_CHUNK", chunk)
    torch.manual_seed(0)
    model, source = TinyNet(width=40), TinyNet(width=40)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    code = exchange.Exchange.install.__code__
    events = 1
    while True:
        plan, _ = _exchange_for(model, source)
        seen = 0

        def tracer(frame, event, arg, stop_at=events):
            nonlocal seen
            if frame.f_code is code and event == "line":
                seen += 1
                if seen == stop_at:
                    raise KeyboardInterrupt
            return tracer

        sys.settrace(tracer)
        try:
            plan.install()
            finished = True
        except KeyboardInterrupt:
            finished = False
        finally:
            sys.settrace(None)
        if finished:
            assert all(
                torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items()
            )
        plan.undo()
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), (events, k)
        if finished:
            break
        events += 1
    assert events > 10  # every statement of several chunks was interrupted once


class Odd(nn.Module):
    """Tensors of every size a chunk of 64 bytes meets: none, under one chunk, exactly one,
    one and a byte, several and a remainder; in several dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(7, 5))  # 140 bytes: 2 chunks and 12
        self.bias = nn.Parameter(torch.randn(16))  # 64 bytes: one chunk exactly
        self.low = nn.Parameter(torch.randn(10, 13).half())  # 260 bytes
        self.register_buffer("count", torch.randint(0, 1 << 40, (3,)))  # 24 bytes
        self.register_buffer("empty", torch.zeros(0))
        self.register_buffer("raw", torch.randint(0, 256, (129,), dtype=torch.uint8))


def _interrupted(fn, code, at: int) -> bool:
    """Run ``fn`` with a KeyboardInterrupt raised at the ``at``-th line run in ``code``
    (not at all where ``at`` is 0); whether it finished."""
    seen = 0

    def tracer(frame, event, arg):
        nonlocal seen
        if frame.f_code is code and event == "line":
            seen += 1
            if seen == at:
                raise KeyboardInterrupt
        return tracer

    sys.settrace(tracer if at else None)
    try:
        fn()
        return True
    except KeyboardInterrupt:
        return False
    finally:
        sys.settrace(None)


def _two_threads(monkeypatch) -> None:
    """Plans hand about half of the host bytes to a second thread, however few."""
    monkeypatch.setattr(exchange, "_SIDE_MIN", 0)
    monkeypatch.setattr(exchange.shard_reader, "cpu_share", lambda: 2)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_undo_puts_back_every_byte_after_an_interrupt_in_the_exchange_or_in_the_undo(
    monkeypatch, threads
):
    """All or nothing (issues 10, 29, 35): the exchange keeps the previous bytes in the
    loaded tensors rotated by one chunk (two copies a byte, not three), so a Ctrl-C at any
    line of the install, then another at any line of the undo (run again, as a rollback
    does), must still put every byte of every tensor back, whatever its size against the
    chunk; and an install that finished leaves exactly the loaded values. With a second
    thread exchanging part of the tensors (it cannot be interrupted: Python delivers
    Ctrl-C to the main thread), the undo waits for it, however far it got."""
    monkeypatch.setattr(exchange, "_CHUNK", 64)
    if threads == 2:
        _two_threads(monkeypatch)
    torch.manual_seed(0)
    model, source = Odd(), Odd()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wanted = {k: v.clone() for k, v in source.state_dict().items()}
    install, undo = exchange.Exchange.install.__code__, exchange.Exchange.undo.__code__
    stop = 1
    while True:
        finished_undo, undo_stop = False, 1
        while not finished_undo:
            plan, _ = _exchange_for(model, source)
            assert (plan._side is not None) is (threads == 2)
            finished = _interrupted(plan.install, install, stop)
            if finished:
                for k, v in model.state_dict().items():
                    assert torch.equal(v, wanted[k]), (stop, k)
            finished_undo = _interrupted(plan.undo, undo, undo_stop)
            if not finished_undo:
                plan.undo()  # the rollback runs it again
            for k, v in model.state_dict().items():
                assert torch.equal(v, before[k]), (stop, undo_stop, k)
            plan.undo()  # once more: it copies nothing wrong
            assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
            undo_stop += 1
        if finished:
            break
        stop += 1
    assert stop > 30  # every line of many chunks was interrupted once


def test_the_exchange_on_the_cpu_copies_without_torchs_copy(monkeypatch):
    """Issue 35 (a restore into existing objects 2.6-6.4x raw DCP's time on busy cores):
    torch's ``copy_`` of each chunk on the CPU waits for all of its intra-op threads, a
    scheduler time slice each where other work holds the cores; the exchange and its undo
    copy CPU bytes without it (no timing asserted: the mechanism is)."""
    torch.manual_seed(0)
    model, source = Odd(), Odd()
    plan, _ = _exchange_for(model, source)
    calls = []
    real = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor, "copy_", lambda t, *a, **k: calls.append(1) or real(t, *a, **k)
    )
    plan.install()
    plan.undo()
    monkeypatch.undo()
    assert calls == []


def test_a_restore_exchanging_on_two_threads_is_exact_and_rolls_back(tmp_path, monkeypatch):
    """F1/F4 and all or nothing (issue 35): with about half of the tensors exchanged on a
    second thread, a restore is bit for bit, into the same objects at the same
    addresses; and one whose probe then differs puts every tensor back."""
    _two_threads(monkeypatch)
    seen: list[bool] = []
    real = exchange.plan
    monkeypatch.setattr(exchange, "plan", lambda *a: seen.append(real(*a)._side is not None)
                        or real(*a))  # fmt: skip
    saved = Problem()
    saved.step()
    saved.checkpointer(tmp_path, probe=lambda m: m.out.bias.sum()).save(1)
    live = Problem(seed=3)
    params = list(live.model.parameters())
    addresses = [p.data_ptr() for p in params]
    assert live.checkpointer(tmp_path, probe=lambda m: m.out.bias.sum()).restore().verified
    assert seen == [True] and [p.data_ptr() for p in params] == addresses
    assert_same_training_state(saved, live)
    other = Problem(seed=4)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(ub.StateMismatchError, match="probe"):
        other.checkpointer(tmp_path, probe=lambda m: m.out.bias.sum() + 1).restore()
    assert seen == [True, True]
    for k, v in other.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_failure_on_the_second_thread_reaches_the_caller_and_is_undone(monkeypatch):
    """All or nothing (issue 35): an error while the second thread exchanges its tensors
    is raised by install() on the calling thread (so the restore rolls back), and the
    undo puts back every byte of both threads' tensors."""
    monkeypatch.setattr(exchange, "_CHUNK", 64)
    _two_threads(monkeypatch)
    torch.manual_seed(0)
    model, source = Odd(), Odd()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan, _ = _exchange_for(model, source)
    side, real = plan._side, exchange._copy
    copies = 0

    def failing(dst, src):
        nonlocal copies
        if threading.current_thread() is not threading.main_thread():
            copies += 1
            if copies == 3:
                raise MemoryError("planted")
        real(dst, src)

    monkeypatch.setattr(exchange, "_copy", failing)
    with pytest.raises(MemoryError, match="planted"):
        plan.install()
    assert side is not None and side._at != (0, 0)  # it stopped midway
    monkeypatch.setattr(exchange, "_copy", real)
    plan.undo()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_second_thread_that_starts_after_the_undo_leaves_everything_alone(monkeypatch):
    """All or nothing (issue 35): a Ctrl-C can reach install() after it started the second
    thread but before that thread ran; the undo, coming first, claims its tensors, and
    the thread, starting late, does not touch them."""
    _two_threads(monkeypatch)
    torch.manual_seed(0)
    model, source = Odd(), Odd()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan, _ = _exchange_for(model, source)
    plan.undo()
    plan._run_side()  # what the late thread runs
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


class Transforming(nn.Linear):
    """Loads a scaled copy of what it is given: only load_state_dict does that."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 1
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _with_hook() -> nn.Module:
    m = TinyNet()
    m.inp.register_load_state_dict_post_hook(lambda module, keys: None)
    return m


def _with_extra_state() -> nn.Module:
    class Extra(TinyNet):
        def get_extra_state(self):
            return {"n": 1}

        def set_extra_state(self, state):
            pass

    return Extra()


def _with_alias() -> nn.Module:
    m = TinyNet()
    m.register_buffer("alias", m.inp.weight.detach()[1:])  # overlaps, is not the same tensor
    return m


def _with_sparse_buffer() -> nn.Module:
    m = TinyNet()
    m.register_buffer("mask", torch.eye(3).to_sparse())
    return m


@pytest.mark.parametrize(
    "build",
    [
        lambda: nn.Sequential(Transforming(4, 2)),
        _with_hook,
        _with_extra_state,
        _with_alias,
        _with_sparse_buffer,
    ],
    ids=["own-load-from-state-dict", "load-hook", "extra-state", "overlapping-views", "sparse"],
)
def test_models_only_load_state_dict_serves_are_not_exchanged(build):
    """F4: modules with their own loading, load hooks, extra state, partly overlapping
    tensors or tensors whose bytes are not their values install through load_state_dict,
    as before."""
    model = build()
    live = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    targets = {k: v.clone() for k, v in live.items()}
    assert exchange.plan({None: model}, live, targets) is None


def test_a_model_with_a_load_hook_restores_through_it(tmp_path, plans):
    """F4: a post-load hook runs on restore (the model is not exchanged) and the state is
    exact."""
    saved = _trained(tmp_path)
    live = Problem(seed=3)
    ran = []
    live.model.out.register_load_state_dict_post_hook(lambda module, keys: ran.append(1))
    assert live.checkpointer(tmp_path).restore().verified
    assert plans == [False] and ran == [1]
    assert_same_training_state(saved, live)


class Tied(nn.Module):
    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x))


def test_tied_weights_exchange_once(tmp_path, plans):
    """Tied weights (one tensor, two names) are exchanged once and restore exactly."""
    torch.manual_seed(0)
    saved = Tied()
    ub.Checkpointer(tmp_path, model=saved).save(1)
    torch.manual_seed(1)
    live = Tied()
    assert ub.Checkpointer(tmp_path, model=live).restore().verified
    assert plans == [True]
    assert live.head.weight is live.emb.weight
    assert torch.equal(live.emb.weight, saved.emb.weight)


def test_tied_names_with_different_saved_values_are_refused_before_anything_changes(
    tmp_path, plans
):
    """Exact or loud: a checkpoint of an untied model holds two values for what the live
    model ties; nothing is installed and the error names both."""
    torch.manual_seed(0)
    ub.Checkpointer(tmp_path, model=Tied(tie=False)).save(1)
    torch.manual_seed(1)
    live = Tied()
    before = live.emb.weight.detach().clone()
    with pytest.raises(
        ub.StateMismatchError, match=r"'model/head\.weight' and 'model/emb\.weight'"
    ):
        ub.Checkpointer(tmp_path, model=live).restore()
    assert plans == [True]
    assert torch.equal(live.emb.weight, before)


def test_channels_last_model_exchanges_exactly(tmp_path, plans):
    """A dense non-contiguous layout (channels-last) is exchanged as one block of bytes."""
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Conv2d(3, 8, 3)).to(memory_format=torch.channels_last)
    ub.Checkpointer(tmp_path, model=saved).save(1)
    torch.manual_seed(1)
    live = nn.Sequential(nn.Conv2d(3, 8, 3)).to(memory_format=torch.channels_last)
    assert ub.Checkpointer(tmp_path, model=live).restore().verified
    assert plans == [True]
    assert live[0].weight.stride() == saved[0].weight.stride()
    assert torch.equal(live[0].weight, saved[0].weight)
