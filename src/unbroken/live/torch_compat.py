"""The private PyTorch internals unbroken relies on, all in this one module.

Each function below reads or sets something torch does not promise to keep (a leading
underscore, or where torch defines its own hooks). ``tests/distributed/test_fsdp1.py``
(for hybrid sharding, ``test_fsdp1_hybrid.py``; for FSDP2's hooks,
``test_exchange_distributed.py``) checks each behaviour on every
torch version CI runs, so a change in torch fails there, by name, instead of writing or
restoring a wrong checkpoint.

- :func:`normalized_fqns`: torch's FQN normalization (``_get_fqns``), which drops the
  prefixes of ``torch.compile``, activation checkpointing, DDP and FSDP wrappers; and
  :func:`is_unwrapped`, which tells when that normalization has nothing to do (no
  wrapper, no ``_fqn_modifiers``), so that a module's own ``state_dict()`` is what
  torch's model state-dict API would return.
- :func:`is_fsdp2_load_hook`: the load-state-dict hooks FSDP2 registers itself (resharding
  before a load, re-padding after one), recognized by the module that defines them
  (``torch.distributed.fsdp._fully_shard``).
- :func:`fsdp1_originals`: the original parameters an FSDP1 module manages
  (``FlatParameter._fqns``, ``_shapes``, ``_param_infos``, through FSDP's own
  ``_get_fqn_to_fsdp_param_info``, so the FQNs are the ones FSDP keys optimizer state by).
- :func:`fsdp1_uses_orig_params`: an FSDP1 module's ``use_orig_params`` (``_use_orig_params``).
- :func:`fsdp1_dtensor_state` (and :func:`fsdp1_mesh`, :func:`fsdp1_placements`): FSDP1
  gives its sharded state as DTensors, not ShardedTensors, when its modules carry a device
  mesh (``_device_mesh``; one is built from the module's ``process_group`` and
  ``compute_device``), placed as ``_shard_utils._create_chunk_dtensor`` places them.
- :func:`unmaterialize`: a lazy module's parameter or buffer that ``load_state_dict``
  materialized made uninitialized again (the undo of a failed restore), inverting what
  ``UninitializedTensorMixin.materialize`` does (new data, then a class switch);
  ``tests/unit/test_resume_shapes.py`` checks it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import _get_fqns
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp._optim_utils import _get_fqn_to_fsdp_param_info
from torch.distributed.tensor import Placement, Replicate, Shard


def normalized_fqns(module: nn.Module, name: str) -> set[str]:
    """The normalized FQNs of ``module``'s parameter or buffer ``name``.

    One FQN, except for an FSDP1 flat parameter (``use_orig_params=False``): the FQNs of
    the original parameters it holds.
    """
    return set(_get_fqns(module, name))


# The submodule names by which torch.compile, activation checkpointing and FSDP1 wrap a
# module: each one's prefix is dropped by _get_fqns.
_WRAPPED_NAMES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def is_unwrapped(module: nn.Module) -> bool:
    """Whether no FQN in ``module`` is normalized: no DDP, FSDP1, FSDP2, ``torch.compile``
    or activation-checkpointing wrapper and no ``_fqn_modifiers`` anywhere in it. Then
    ``get_model_state_dict`` returns ``module.state_dict()`` as it is, after work that
    grows with the number of parameters (it maps every name first)."""
    for m in module.modules():
        if isinstance(m, nn.parallel.DistributedDataParallel | FSDP | FSDPModule):
            return False
        if any(name in m._modules for name in _WRAPPED_NAMES):
            return False
        if getattr(type(m), "_fqn_modifiers", None) is not None:
            return False
    return True


_FSDP2_PACKAGE = "torch.distributed.fsdp._fully_shard"


def is_fsdp2_load_hook(hook: object) -> bool:
    """Whether a module's load-state-dict pre or post hook is one FSDP2 registers itself
    (``torch.nn.Module`` wraps some hooks, keeping the wrapped function's ``__module__``)."""
    defined_in = getattr(getattr(hook, "hook", hook), "__module__", None) or ""
    return defined_in == _FSDP2_PACKAGE or defined_in.startswith(_FSDP2_PACKAGE + ".")


@dataclasses.dataclass(frozen=True)
class Original:
    """An original parameter managed by an FSDP1 module."""

    shape: torch.Size  # unsharded
    owner: nn.Module  # the module that registered it
    index: int  # its position in its flat parameter (the owner's registration order)
    fsdp: FSDP  # the FSDP1 module that manages it


def fsdp1_originals(model: nn.Module) -> dict[str, Original]:
    """FQN -> :class:`Original` for every parameter an FSDP1 module of ``model`` manages,
    in either ``use_orig_params`` mode; the FQNs are those FSDP keys optimizer state by."""
    out: dict[str, Original] = {}
    for fqn, info in _get_fqn_to_fsdp_param_info(model).items():
        flat = info.handle.flat_param
        i = info.param_indices[fqn]
        out[fqn] = Original(torch.Size(flat._shapes[i]), flat._param_infos[i].module, i, info.state)
    return out


def fsdp1_uses_orig_params(module: FSDP) -> bool:
    """The ``use_orig_params`` an FSDP1 module was built with."""
    return bool(module._use_orig_params)


def fsdp1_mesh(module: FSDP) -> DeviceMesh:
    """The device mesh FSDP1 builds DTensors on: the one the module was given (2-D,
    (replicate, shard), under hybrid sharding), or else a one-dimensional mesh over its
    process group (structurally equal on every call). Under hybrid sharding given
    ``process_group=(intra, inter)`` that is the shard group: one such mesh per replica."""
    mesh = module._device_mesh
    if mesh is None:
        mesh = DeviceMesh.from_group(module.process_group, module.compute_device.type)
    return mesh


def fsdp1_placements(mesh: DeviceMesh) -> list[Placement]:
    """How FSDP1 places its sharded state on ``mesh`` (``_create_chunk_dtensor``): dim 0
    sharded over the last mesh dimension, replicated over any before it (hybrid sharding:
    ``[Replicate(), Shard(0)]``)."""
    return [*(Replicate() for _ in range(mesh.ndim - 1)), Shard(0)]


@contextlib.contextmanager
def fsdp1_dtensor_state(model: nn.Module) -> Iterator[None]:
    """Within: the FSDP1 modules of ``model`` give and take sharded state (model and
    optimizer, ``SHARDED_STATE_DICT``) as DTensors sharded on dim 0, not ShardedTensors
    (placed as :func:`fsdp1_placements` says).

    torch switches to DTensors when a module carries a device mesh; a module built
    without one gets a mesh over its process group for the duration, then none again,
    so the user's own ``state_dict()`` calls are unchanged.
    """
    lent = []
    for module in FSDP.fsdp_modules(model):
        if module._device_mesh is None:
            module._device_mesh = fsdp1_mesh(module)
            lent.append(module)
    try:
        yield
    finally:
        for module in lent:
            module._device_mesh = None


def is_uninitialized(t: torch.Tensor) -> bool:
    """Whether ``t`` is a lazy module's parameter or buffer before its first forward (an
    ``UninitializedParameter`` or ``UninitializedBuffer``: no shape, no values yet)."""
    return bool(nn.parameter.is_lazy(t))


def unmaterialize(t: torch.Tensor, uninitialized: type) -> None:
    """Make ``t``, materialized in place since it was an instance of ``uninitialized``
    (``UninitializedParameter`` or ``UninitializedBuffer``), uninitialized again: its
    module's next forward (or load) initializes it, as before the materialization."""
    with torch.no_grad():
        t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    t.__class__ = uninitialized
