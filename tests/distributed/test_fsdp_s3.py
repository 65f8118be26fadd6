"""FSDP2 on two ranks saves to S3 (moto on loopback); restores bit-exactly on 1 and 3.

Every rank uploads its own shard object to the shared store and rank 0 commits the
manifest once all uploads are done: the multi-node layout of docs/storage.md, with
processes standing in for nodes.
"""

from __future__ import annotations

import pytest

from . import launcher, models
from .test_fsdp_reshard import restored_in_one_process, restored_on_three

pytestmark = pytest.mark.distributed
URL = "s3://fsdp/run"


@pytest.fixture(scope="module")
def saved_on_two(s3_server):
    s3_server.bucket("fsdp")
    with s3_server.environment():  # spawned ranks inherit it
        want = launcher.run(models.save_trained_fsdp, 2, URL)[0]
        yield s3_server, want


def test_each_rank_uploads_its_shard_rank0_commits(saved_on_two):
    """Guarantee: one shard object per rank, both of one save, and one manifest."""
    server, _ = saved_on_two
    got = server.client().list_objects_v2(Bucket="fsdp", Prefix="run/")
    names = sorted(o["Key"].removeprefix("run/step_00000003/") for o in got["Contents"])
    assert names[0] == "manifest.json" and len(names) == 3
    ids = {n.removesuffix(".bin").split("-")[1] for n in names[1:]}
    assert [n.split("-")[0] for n in names[1:]] == ["rank_00000", "rank_00001"] and len(ids) == 1


def test_two_ranks_to_three(saved_on_two):
    """Guarantee: bit-exact restore from S3 resharded onto 3 ranks."""
    _, want = saved_on_two
    restored_on_three(URL, want)


def test_two_ranks_to_one_process(saved_on_two):
    """Guarantee: bit-exact restore from S3 into one unsharded process."""
    _, want = saved_on_two
    restored_in_one_process(URL, want)
