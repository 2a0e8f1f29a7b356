"""Tensor subclass and storage internals."""

from __future__ import annotations

import torch


def make_wrapper_subclass(cls, shape, **kwargs) -> torch.Tensor:
    """``torch.Tensor._make_wrapper_subclass``: an instance of a tensor subclass ``cls`` with the
    given metadata and no storage of its own (how DTensor and torch's other wrapper subclasses
    are made; private name, no public alternative), 2.11-2.14."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, **kwargs)


def disable_torch_function_subclass():
    """``torch._C.DisableTorchFunctionSubclass``: run an op below a ``__torch_function__``
    subclass (what torch's own subclasses use; private, 2.11-2.14)."""
    return torch._C.DisableTorchFunctionSubclass()


def storage_key(tensor: torch.Tensor):
    """A hashable handle of a tensor's storage (``StorageWeakRef``, private, 2.11-2.14)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(tensor.untyped_storage())


def allow_foreach(cls: type) -> None:
    """Let optimizers and ``clip_grad_norm_`` take their foreach paths over ``cls`` (a DTensor
    subclass) as over DTensor: the lists DTensor adds itself to (private
    ``torch.optim.optimizer._foreach_supported_types`` and ``torch.utils._foreach_utils``'s;
    no public registration), 2.11-2.14."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for supported in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if cls not in supported:
            supported.append(cls)


def version(tensor: torch.Tensor) -> int:
    """The tensor's in-place write counter (private ``Tensor._version``, shared by the views of
    one storage; autograd's saved-tensor check reads it): a changed value means the tensor was
    written in place since it was last read. No public alternative; checked 2.13-2.14."""
    return tensor._version
