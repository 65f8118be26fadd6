"""The manifest's torch-free dtype and device tables agree with torch.

A manifest is read and checked without torch (`format/schema.py` holds each dtype's
element size and the common device types as plain tables); these tests hold those
tables to what torch says, and `manifest.DTYPES` to the torch dtypes it names.
"""

from __future__ import annotations

import pytest
import torch

from unbroken.format import manifest, schema


@pytest.mark.parametrize("name", sorted(schema.ITEMSIZES))
def test_itemsizes_are_torchs_element_sizes(name):
    dtype = manifest.DTYPES[name]
    assert isinstance(dtype, torch.dtype) and str(dtype) == f"torch.{name}"
    assert schema.ITEMSIZES[name] == torch.empty(0, dtype=dtype).element_size()
    assert manifest.dtype_name(dtype) == name


def test_dtypes_is_a_mapping_of_exactly_those_names():
    assert list(manifest.DTYPES) == list(schema.ITEMSIZES)
    assert len(manifest.DTYPES) == len(schema.ITEMSIZES)
    assert "float32" in manifest.DTYPES and "float4" not in manifest.DTYPES
    with pytest.raises(KeyError):
        manifest.DTYPES["Tensor"]  # a torch attribute, but not a dtype a checkpoint holds
    with pytest.raises(TypeError, match="cannot be checkpointed"):
        manifest.dtype_name(torch.quint8)


def test_tensor_nbytes():
    entry = {"shape": [3, 5], "dtype": "bfloat16"}
    assert manifest.tensor_nbytes(entry) == 30
    assert manifest.tensor_nbytes({"shape": [], "dtype": "complex128"}) == 16


@pytest.mark.parametrize("device", sorted(schema.COMMON_DEVICES))
def test_common_devices_are_device_types_torch_knows(device):
    assert torch.device(device).type == device
