"""A loader over a ``DistributedSampler`` resumed in a later epoch draws that epoch's order.

Bug class F2 (data position): ``restore()`` makes the resumed iterator of a
``StatefulDataLoader`` before the rng is put back (live/dataloader.py), so the sampler's
order was fixed then, with the sampler still at epoch 0 in a fresh process; the loop's
``sampler.set_epoch(epoch)`` after ``restore()`` came too late, and the rest of epoch 1
came in epoch 0's order (found by benchmarks/compared.py's DeepSpeed rows). The sampler's
epoch is saved with the loader's state and set before that iterator is made.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

import unbroken as ub

DATA = TensorDataset(torch.arange(48).float())


def _loader(kind: type) -> tuple[StatefulDataLoader, DistributedSampler]:
    sampler = kind(DATA, num_replicas=1, rank=0, shuffle=True, seed=3)
    return StatefulDataLoader(DATA, batch_size=4, sampler=sampler), sampler


@pytest.mark.parametrize("kind", [DistributedSampler, StatefulDistributedSampler])
def test_the_rest_of_a_later_epoch_comes_in_its_own_order(tmp_path, kind):
    loader, sampler = _loader(kind)
    ckpt = ub.Checkpointer(tmp_path, model=nn.Linear(1, 1), dataloader=loader)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = iter(loader)
        if epoch == 0:
            list(batches)
    drawn = [next(batches) for _ in range(5)]  # 5 of epoch 1's 12 batches
    ckpt.save(17)
    expected = [b[0].tolist() for b in batches]
    assert drawn and expected

    loader, sampler = _loader(kind)  # a fresh process: the sampler at epoch 0
    resumed = ub.Checkpointer(tmp_path, model=nn.Linear(1, 1), dataloader=loader)
    assert resumed.restore().step == 17
    sampler.set_epoch(1)  # the loop's own call, after restore(): the same epoch
    assert [b[0].tolist() for b in loader] == expected
    assert sampler.epoch == 1
