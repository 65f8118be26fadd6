"""Nested state splits into JSON and tensors and comes back with the same types."""

from __future__ import annotations

import enum
import json
from collections import Counter, OrderedDict, defaultdict, namedtuple

import numpy as np
import pytest
import torch

from conftest import assert_identical
from unbroken.format import manifest, state_compare, tree

NAN, INF = float("nan"), float("inf")


def test_round_trip_keeps_types_and_values():
    value = {
        "a": 1, "b": 2.5, "c": None, "d": True, "e": "s", "f": (1, (2.0, "x")),
        "g": [torch.arange(3), {"h": torch.ones(2, dtype=torch.bfloat16)}],
        3: "int key", "nan": float("nan"), "inf": float("-inf"), "dt": torch.float16,
        "np": np.arange(4, dtype=np.uint32), "npf": np.float32(1.5),
    }  # fmt: skip
    tensors: dict = {}
    skeleton = tree.encode(value, "comp", tensors)
    skeleton = json.loads(json.dumps(skeleton, allow_nan=False))
    assert sorted(tensors) == ["comp/g/0", "comp/g/1/h"]
    assert tree.tensor_keys(skeleton) == ["comp/g/0", "comp/g/1/h"]
    back = tree.decode(skeleton, tensors)
    assert back["f"] == (1, (2.0, "x")) and isinstance(back["f"], tuple)
    assert back[3] == "int key" and back["dt"] is torch.float16
    assert np.isnan(back["nan"]) and back["inf"] == float("-inf")
    assert back["np"].dtype == np.uint32 and back["np"].tolist() == [0, 1, 2, 3]
    assert type(back["npf"]) is np.float32
    assert back["g"][0] is tensors["comp/g/0"]


def test_slashes_in_keys_are_escaped():
    tensors: dict = {}
    tree.encode({"a/b": torch.zeros(1), "a%2Fb": torch.ones(1)}, "x", tensors)
    assert sorted(tensors) == ["x/a%252Fb", "x/a%2Fb"]


def test_unsupported_values_are_named_by_path():
    with pytest.raises(TypeError, match="comp/list/1"):
        tree.encode({"list": [1, object()]}, "comp", {})


def _through_manifest(value, tmp_path):
    """Encode, write and read back a manifest holding the skeleton (the real JSON path of
    a save and a restore), decode."""
    tensors: dict = {}
    skeleton = tree.encode(value, "comp", tensors)
    body = {"step": 1, "world_size": 1, "tensors": {}, "files": {}, "lineage": []}
    manifest.write(tmp_path, dict(body, components={"comp": {"state": skeleton}}))
    return tree.decode(manifest.read(tmp_path)["components"]["comp"]["state"], tensors)


ROUND_TRIPS = {
    "counter int keys (MultiStepLR milestones)": Counter([8, 3, 6, 6]),
    "counter str keys": Counter("abracadabra"),
    "counter empty": Counter(),
    "ordereddict str keys": OrderedDict([("b", 1), ("a", 2.0), ("c", None)]),
    "ordereddict int keys": OrderedDict([(2, "x"), (1, "y")]),
    "ordereddict of tensors (module state_dict)": OrderedDict(w=torch.ones(2), b=torch.zeros(1)),
    "ordereddict empty": OrderedDict(),
    "defaultdict list": defaultdict(list, {"z": [1], "a": []}),
    "defaultdict int, int keys": defaultdict(int, {5: 2, 1: 0}),
    "defaultdict no factory": defaultdict(None, {"k": (1,)}),
    "defaultdict set": defaultdict(set, {"s": {1, 2}}),
    "dict str keys out of order": {"zeta": 1, "alpha": 2, "mid": 3},
    "dict int keys out of order": {3: "a", 1: "b", 2: "c"},
    "dict mixed key types": {"x": 1, 2: 2, 1.5: 3, False: 4, None: 5, "2": 6},
    "dict tuple keys": {(1, "a"): 1, (0, (2.5,)): 2, (): 3},
    "dict non-finite float keys": {INF: 1, -INF: 2, NAN: 3},
    "dict numpy scalar keys": {np.int64(3): "a", np.str_("k"): "b"},
    "dict holding the tag key": {"__ub__": "tensor", "key": "x"},
    "tuple vs list": ([1, (2, [3])], (), [()], ((),), [[]]),
    "set": {3, 1, 2},
    "frozenset": frozenset({"a", (1, 2), None}),
    "set empty": set(),
    "ints": [0, 1, -1, 2**53 + 1, -(2**63) - 1, 2**100],
    "floats": [1.0, -0.0, 0.0, 0.1, 5e-324, 1.7976931348623157e308, NAN, INF, -INF],
    "bools vs ints vs floats": [True, False, 1, 0, 1.0, 0.0],
    "numpy scalars": [
        np.float64(1.5), np.float64(NAN), np.float32(-INF), np.float16(-0.0),
        np.int64(-(2**62)), np.uint64(2**64 - 1), np.bool_(True), np.str_("s"),
    ],
    "numpy arrays": [
        np.arange(4, dtype=np.uint32), np.array([[1.5, NAN]], dtype=np.float32),
        np.zeros((0, 2)),
    ],
    "nested containers": OrderedDict(
        outer=defaultdict(list, {"k": [(1, 2.0)], 3: [Counter(a=2)]}),
        inner={"t": (OrderedDict(z=1, a=-0.0), {frozenset({1})})},
    ),
}  # fmt: skip


@pytest.mark.parametrize("value", list(ROUND_TRIPS.values()), ids=list(ROUND_TRIPS))
def test_round_trip_keeps_container_types_key_order_and_scalars(value, tmp_path):
    """Each case of ROUND_TRIPS (its id names it) comes back through encode, the manifest's
    JSON and decode with the same type at every level, the same key order and the same
    values, bit for bit."""
    back = _through_manifest(value, tmp_path)
    assert type(back) is type(value)
    if isinstance(value, dict):
        assert len(list(back)) == len(list(value))
        assert [type(k) for k in back] == [type(k) for k in value]
    assert_identical(back, value)


def test_tensors_inside_new_containers_keep_their_keys():
    """Tensors inside an OrderedDict, a Counter and a defaultdict are keyed by their path,
    as in a plain dict, and come back as the very tensors inside the same container types."""
    value = {
        "od": OrderedDict(w=torch.ones(2)),
        "dd": defaultdict(list, {"k": [torch.zeros(1)]}),
        "c": Counter({"n": torch.arange(2)}),
    }
    tensors: dict = {}
    skeleton = json.loads(json.dumps(tree.encode(value, "comp", tensors), allow_nan=False))
    assert list(tensors) == ["comp/od/w", "comp/dd/k/0", "comp/c/n"]
    assert tree.tensor_keys(skeleton) == list(tensors)
    back = tree.decode(skeleton, tensors)
    assert [type(back[k]) for k in value] == [OrderedDict, defaultdict, Counter]
    assert back["od"]["w"] is tensors["comp/od/w"]
    assert back["dd"]["k"][0] is tensors["comp/dd/k/0"]
    assert back["c"]["n"] is tensors["comp/c/n"]


@pytest.mark.parametrize(
    "factory",
    [lambda: 0, Counter, defaultdict, object, np.float32],
    ids=["lambda", "Counter", "defaultdict", "object", "numpy type"],
)
def test_defaultdict_with_unsafe_factory_is_refused_naming_the_path(factory):
    """A defaultdict whose default_factory is not an allowlisted builtin cannot be saved
    without pickling it: a TypeError names the path and the fix."""
    value = {"stats": {"per_key": defaultdict(factory)}}
    with pytest.raises(TypeError, match=r"comp/stats/per_key.*default_factory.*plain dict"):
        tree.encode(value, "comp", {})


class _Color(enum.IntEnum):
    RED = 1


class _Flag(enum.IntFlag):
    A = 1


class _Name(enum.StrEnum):
    X = "x"


class _Attrs(dict):
    pass


class _Ordered(OrderedDict):
    pass


class _Items(list):
    pass


_Pair = namedtuple("_Pair", "a b")


@pytest.mark.parametrize(
    ("value", "path", "kind", "base"),
    [
        ({"mode": _Color.RED}, "comp/mode", "_Color", "int"),
        ({"flags": [1, _Flag.A]}, "comp/flags/1", "_Flag", "int"),
        ({"name": _Name.X}, "comp/name", "_Name", "str"),
        ({"pos": _Pair(1, 2)}, "comp/pos", "_Pair", "tuple"),
        ({"shape": torch.Size([2, 3])}, "comp/shape", "Size", "tuple"),
        ({"hp": _Attrs(lr=0.1)}, "comp/hp", "_Attrs", "dict"),
        ({"od": _Ordered(a=1)}, "comp/od", "_Ordered", "dict"),
        ({"xs": _Items([1])}, "comp/xs", "_Items", "list"),
        ({"by": {_Color.RED: 1}}, "comp/by", "_Color", "int"),
    ],
    ids=[
        "IntEnum",
        "IntFlag in a list",
        "str Enum",
        "namedtuple",
        "torch.Size",
        "dict subclass",
        "OrderedDict subclass",
        "list subclass",
        "IntEnum key",
    ],
)
def test_subclasses_of_plain_types_are_refused_naming_path_and_type(value, path, kind, base):
    """Issue 36, item 9: an IntEnum, a namedtuple, a dict subclass... came back as the
    plain int, tuple or dict with verified=True. A restore never imports a class named in
    a file, so they are refused at save, naming the path, the type and the fix."""
    pattern = rf"cannot save {path}: a {kind} \(a subclass of {base}\) would come back as a plain"
    with pytest.raises(TypeError, match=pattern):
        tree.encode(value, "comp", {})


@pytest.mark.parametrize(
    ("bad", "path"),
    [
        ({"s": {torch.zeros(1)}}, "comp/s"),
        ({"d": {(1, b"x"): 3}}, "comp/d"),
        ({"d": {(1, 2): 3, object(): 4}}, "comp/d"),
    ],
    ids=["tensor in a set", "bytes inside a tuple key", "object key"],
)
def test_keys_and_set_members_are_hashable_plain_values(bad, path):
    """Set members and dict keys may be scalars, numpy scalars and tuples of them (these
    save); anything else (a tensor in a set, bytes, an object) is refused with a TypeError
    naming its path."""
    good = {"s": {1, (2, "a"), np.int8(3)}, "d": {(1, ("a", 2.5)): 3}}
    assert tree.decode(tree.encode(good, "comp", {}), {}) == good
    with pytest.raises(TypeError, match=path):
        tree.encode(bad, "comp", {})


OLD_SKELETONS = [
    ({"a": 1, "b": 2.5, "c": [1, None, True, "s"]}, {"a": 1, "b": 2.5, "c": [1, None, True, "s"]}),
    ({"__ub__": "tuple", "items": [1, {"__ub__": "tuple", "items": []}]}, (1, ())),
    ({"__ub__": "dict", "items": [[3, "x"], ["a", 1.0], [True, None]]}, {3: "x", "a": 1.0, True: None}),
    ({"__ub__": "float", "repr": "-inf"}, -INF),
    ({"__ub__": "dtype", "name": "bfloat16"}, torch.bfloat16),
    ({"__ub__": "npscalar", "dtype": "<f4", "value": 1.5}, np.float32(1.5)),
    ({"__ub__": "ndarray", "dtype": "<i8", "shape": [2], "data": [1, 2]}, np.array([1, 2])),
]  # fmt: skip


@pytest.mark.parametrize(("skeleton", "expected"), OLD_SKELETONS)
def test_skeletons_written_before_container_tags_decode_as_before(skeleton, expected):
    """Back-compat guard: every tag format_version 1 wrote before the container tags
    decodes to the same value and type as it always did."""
    assert_identical(tree.decode(skeleton, {}), expected)


def _items(*pairs):
    return {"__ub__": "dict", "items": [list(p) for p in pairs]}


@pytest.mark.parametrize(
    ("a", "b", "where"),
    [
        ({"x": 1}, {"x": 1.0}, "c/x"),
        ({"x": [True]}, {"x": [1]}, "c/x/0"),
        ({"x": 0.0}, {"x": -0.0}, "c/x"),
        ({"x": "1"}, {"x": 1}, "c/x"),
        ({"x": _items((1, 0), (2, 0))}, {"x": _items((2, 0), (1, 0))}, "c/x/items/0/0"),
        ({"x": [1, 2]}, {"x": [1]}, "c/x"),
        ({"x": {"__ub__": "counter", "items": []}}, {"x": _items()}, "c/x/__ub__"),
    ],
    ids=["int vs float", "bool vs int", "0.0 vs -0.0", "str vs int", "key order", "length", "tag"],
)
def test_skeleton_difference_is_exact(a, b, where):
    """Verification compares non-tensor state exactly: int vs float, bool vs int, the sign
    of zero, the key order of tagged mappings, lengths and tags are differences, named by
    path; a skeleton and its JSON round trip have none."""
    assert state_compare.difference(a, b, "c").startswith(where + " (")
    assert state_compare.difference(a, json.loads(json.dumps(a)), "c") is None
