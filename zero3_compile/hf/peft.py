"""peft adapters (LoRA) on a zero3 model: before or after sharding, saved as peft saves them.

```python
model = z3hf.from_pretrained(AutoModelForCausalLM, path, torch_dtype=torch.bfloat16,
                             offload=z3.Offload(params="disk", path="/nvme/z3"))
model = peft.get_peft_model(model, LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
trainer = z3hf.Trainer(model=model, args=args, train_dataset=ds)   # only the adapters train
trainer.train()
trainer.save_model(out)                              # adapter_config.json + adapter_model.safetensors
z3hf.save_pretrained(model, merged_out, merge_adapters=True)   # a plain Hugging Face folder
```
Either order works. ``get_peft_model`` on a sharded model replaces each target layer with peft's
wrapper; the wrapper is assigned into a sharded module, so its new adapter weights are sharded on
assignment (``frontend/assignment.py``) and every parameter of the ``PeftModel`` is a shard of the
one ``shard()`` call: ``sharded_runtime`` checks that. The frozen base (``requires_grad=False``)
is gathered in the compute dtype like any parameter but gets no gradient, so no reduce-scatter,
and no optimizer state (the ``Trainer`` gives the optimizer the trainable parameters only).

Saving:

- ``save_adapter``: what ``PeftModel.save_pretrained`` writes. Every rank gathers the adapter
  weights that peft selects (small) and calls peft's own ``save_pretrained`` with them as the
  state dict; rank 0 writes. The base is never gathered.
- merged: ``save_pretrained(..., merge_adapters=True)`` writes ``merge_and_unload()``'s model
  file by file (``saving.py``), each LoRA layer's weight merged when its file is written
  (``zero3_compile.rollout``'s plan: the base weight gathered, peft's ``get_delta_weight`` of the
  gathered adapters added); ``zero3_compile.rollout.iter_full_parameters`` streams the same
  tensors to a rollout engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from .._torch.dynamo import uncompiled
from .._torch.modules import non_persistent_buffer_names, own_buffers, own_parameters
from ..runtime.guard import DEFAULT_TIMEOUT_S
from ..sharding.state import ShardedParam, state_of
from .agreement import Agreement


def is_peft_model(model: nn.Module) -> bool:
    """``model`` (or the module a ``torch.compile`` wrapper holds) is a ``peft.PeftModel``."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(uncompiled(model), PeftModel)


def sharded_runtime(model: nn.Module):
    """The runtime of the ``shard()`` call every parameter of ``model`` belongs to; None when
    no parameter is sharded. Raises when only some are (a module added after ``shard()`` and not
    through a sharded parent), or when they belong to different ``shard()`` calls."""
    runtimes: dict[int, object] = {}
    plain: list[str] = []
    for name, param in model.named_parameters():
        state = state_of(param)
        if state is None:
            plain.append(name)
        else:
            runtimes.setdefault(id(state.root), state.root)
    if not runtimes:
        return None
    if plain:
        raise ValueError(
            f"zero3: {len(plain)} parameter(s) of the model are not sharded ({plain[:3]}...) while "
            "the others are: a module was added outside the sharded model (a wrapper with its own "
            "parameters). Add modules as attributes of a sharded module (they are sharded on "
            "assignment, as peft's adapters are), or wrap the model first and shard it then"
        )
    if len(runtimes) > 1:
        raise ValueError(
            "zero3: the model holds parameters of several zero3_compile.shard() calls; train one "
            "sharded model (shard the whole model once)"
        )
    return next(iter(runtimes.values()))


# --------------------------------------------------------------------------- the adapter


def save_adapter(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    selected_adapters: list[str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    **kwargs,
) -> None:
    """``model.save_pretrained(save_directory)`` of a sharded ``PeftModel``: adapter config and
    weights, loadable by ``PeftModel.from_pretrained``; every rank calls it, rank 0 writes.

    ``kwargs`` go to peft's ``save_pretrained`` (``safe_serialization``, ...).
    """
    from peft import get_peft_model_state_dict

    model = uncompiled(model)
    names = selected_adapters or list(model.peft_config)
    # which tensors peft saves, asked with stand-ins on the meta device (nothing gathered yet)
    values = dict(_named_tensors(model))
    stand_ins = {key: _stand_in(value) for key, value in values.items()}
    source = {id(stand_ins[key]): key for key in values}
    wanted: dict[str, object] = {}
    for adapter in names:
        chosen = get_peft_model_state_dict(
            model,
            state_dict=stand_ins,
            adapter_name=adapter,
            save_embedding_layers=kwargs.get("save_embedding_layers", "auto"),
        )
        for name, stand_in in chosen.items():
            key = source.get(id(stand_in))
            if key is None:
                raise NotImplementedError(
                    f"zero3: peft computes the adapter tensor {name!r} instead of selecting it; "
                    "saving it from a sharded model is not supported"
                )
            wanted[key] = values[key]
    rank = dist.get_rank()
    agreement = Agreement("zero3_compile.hf.save_pretrained (adapter)", timeout_s=timeout_s)
    try:
        full = {key: _full(value) for key, value in sorted(wanted.items())}
        model.save_pretrained(
            os.fspath(save_directory),
            state_dict=full,
            selected_adapters=names,
            is_main_process=rank == 0,
            **kwargs,
        )
        agreement.meet("writing the adapter")
    except BaseException as error:
        agreement.fail(error)
        raise


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, object]]:
    """``state_dict()``'s names with the sharded parameters themselves as values (nothing is
    gathered); a tied parameter under each of its names."""
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, param in own_parameters(module).items():
            if param is not None:
                yield dot + name, state_of(param) or param
        for name, buffer in own_buffers(module).items():
            if buffer is not None and name not in non_persistent_buffer_names(module):
                yield dot + name, buffer


def _stand_in(value) -> torch.Tensor:
    if isinstance(value, ShardedParam):
        return torch.empty(value.global_shape, dtype=value.local().dtype, device="meta")
    return torch.empty(value.shape, dtype=value.dtype, device="meta")


def _full(value) -> torch.Tensor:
    from .saving import full_tensor

    return full_tensor(value).detach().cpu()


__all__ = ["is_peft_model", "save_adapter", "sharded_runtime"]
