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
- ``merged_tensors``: ``(name, full tensor)`` of the merged model (``merge_and_unload``'s state
  dict under the base model's names), one tensor gathered at a time: a LoRA layer's weight is its
  full base weight plus ``get_delta_weight`` computed from the full adapter weights, all in the
  shards' own dtype. ``save_pretrained(..., merge_adapters=True)`` writes them file by file
  (``saving.py``); rollout engines can consume the generator directly.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from ..frontend.loading import loading
from ..runtime.guard import DEFAULT_TIMEOUT_S
from ..sharding.state import ShardedParam, module_state, state_of
from .agreement import Agreement


def is_peft_model(model: nn.Module) -> bool:
    """``model`` (or the module a ``torch.compile`` wrapper holds) is a ``peft.PeftModel``."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(getattr(model, "_orig_mod", model), PeftModel)


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

    model = getattr(model, "_orig_mod", model)
    names = selected_adapters or list(model.peft_config)
    entries = dict(_named_tensors(model))
    wanted: dict[str, object] = {}
    for adapter in names:  # which tensors peft saves, by identity (nothing gathered yet)
        chosen = get_peft_model_state_dict(
            model,
            state_dict=entries,
            adapter_name=adapter,
            save_embedding_layers=kwargs.get("save_embedding_layers", "auto"),
        )
        chosen_ids = {id(v) for v in chosen.values()}
        wanted.update({k: v for k, v in entries.items() if id(v) in chosen_ids})
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
        for name, param in module._parameters.items():
            if param is not None:
                yield dot + name, state_of(param) or param
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield dot + name, buffer


def _full(value) -> torch.Tensor:
    from .saving import full_tensor

    return full_tensor(value).detach().cpu()


# --------------------------------------------------------------------------- merged


class MergedWeight:
    """A LoRA layer's base weight with its active adapters merged, gathered when asked
    (``full()``); the shapes and dtype of the base weight."""

    def __init__(self, base: ShardedParam | torch.Tensor, layer: nn.Module, adapters: list[str]):
        self.base = base
        self.layer = layer
        self.adapters = adapters

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(
            self.base.spec.shape if isinstance(self.base, ShardedParam) else self.base.shape
        )

    def nbytes(self) -> int:
        if isinstance(self.base, ShardedParam):
            return self.base.spec.full_numel * self.base.local().element_size()
        return self.base.numel() * self.base.element_size()

    @torch.no_grad()
    def full(self) -> torch.Tensor:
        from .saving import full_tensor

        weight = full_tensor(self.base).clone()
        with _adapters_in_full(self.layer, self.adapters):
            for adapter in self.adapters:
                weight += self.layer.get_delta_weight(adapter).to(weight.dtype)
        return weight


@contextlib.contextmanager
def _adapters_in_full(layer: nn.Module, adapters: list[str]) -> Iterator[None]:
    """The layer's adapter weights read in full, in their shards' dtype, for the block: gathered
    once each (collectives, every rank in the same order) and put where reading the attribute
    finds them (``ShardState.LOADING`` returns ``module._parameters``)."""
    from .saving import full_tensor

    modules = []
    for attr in layer.adapter_layer_names:
        container = getattr(layer, attr, None)
        if isinstance(container, nn.ModuleDict):
            modules += [container[a] for a in adapters if a in container]
    with contextlib.ExitStack() as stack:
        for module in modules:
            state = module_state(module)
            if state is None:
                continue
            full = {attr: full_tensor(s) for attr, s in state.params.items()}
            stack.enter_context(loading(module))
            saved = {attr: module._parameters[attr] for attr in full}
            module._parameters.update(full)
            stack.callback(module._parameters.update, saved)
        yield


def merged_entries(model: nn.Module) -> tuple[nn.Module, dict[str, object]]:
    """The base model of a ``PeftModel`` and what ``merge_and_unload().state_dict()`` would hold,
    lazily: names of the base model, values a ``ShardedParam`` (a base weight unchanged), a
    ``MergedWeight`` (a LoRA layer's weight) or a tensor (a buffer). Raises for adapters that
    cannot be merged this way (other tuners than LoRA, LoRA variants such as DoRA)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    model = getattr(model, "_orig_mod", model)
    base = model.get_base_model()
    entries: dict[str, object] = {}

    def visit(module: nn.Module, prefix: str) -> None:
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, ModulesToSaveWrapper):  # the trained copy, under the plain names
            active = module.active_adapters
            source = module.modules_to_save[active[0]] if active else module.original_module
            visit(source, prefix)
            return
        if isinstance(module, BaseTunerLayer):
            inner = module.get_base_layer()
            adapters = _mergeable(module, prefix)
            for name, value in _own_tensors(inner):
                if name == "weight" and adapters:
                    value = MergedWeight(value, module, adapters)
                entries[dot + name] = value
            for name, child in inner.named_children():
                visit(child, dot + name)
            return
        for name, value in _own_tensors(module):
            entries[dot + name] = value
        for name, child in module.named_children():
            visit(child, dot + name)

    visit(base, "")
    return base, entries


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, object]]:
    for name, param in module._parameters.items():
        if param is not None:
            yield name, state_of(param) or param
    for name, buffer in module._buffers.items():
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield name, buffer


def _mergeable(layer: nn.Module, prefix: str) -> list[str]:
    """The layer's active adapters, each one plain LoRA (``get_delta_weight`` is its merge)."""
    if getattr(layer, "merged", False):
        raise ValueError(
            f"zero3: the adapters of {prefix!r} are merged into its weight already "
            "(merge_adapter()); unmerge them first"
        )
    active = [a for a in layer.active_adapters if a in getattr(layer, "lora_A", {})]
    if not hasattr(layer, "lora_A") or (not active and layer.active_adapters):
        raise ValueError(
            f"zero3: {prefix!r} holds a {type(layer).__name__} adapter; merging supports LoRA "
            "only: save the adapter instead (save_pretrained without merge_adapters)"
        )
    for adapter in active:
        if adapter in getattr(layer, "lora_variant", {}) or layer.lora_bias.get(adapter, False):
            raise ValueError(
                f"zero3: {prefix!r}: adapter {adapter!r} is a LoRA variant (DoRA, lora_bias, ...) "
                "that cannot be merged by zero3 yet; save the adapter instead"
            )
    return [] if getattr(layer, "disable_adapters", False) else active


def merged_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, full tensor)`` of ``model`` with its LoRA adapters merged (a plain
    model's own tensors if it has none), one gathered at a time, in the base model's
    ``state_dict`` order (tied parameters under each of their names). Every rank iterates it to
    the end (each sharded tensor is a collective); each gets the full tensors.

    ```python
    for name, tensor in z3hf.merged_tensors(peft_model):
        engine.load_weights([(name, tensor)])      # a rollout engine, a layer at a time
    ```
    """
    from .saving import full_tensor

    if is_peft_model(model):
        _, entries = merged_entries(model)
    else:
        entries = dict(_named_tensors(getattr(model, "_orig_mod", model)))
    for name, value in entries.items():
        yield name, value.full() if isinstance(value, MergedWeight) else full_tensor(value)


__all__ = ["is_peft_model", "merged_tensors", "save_adapter", "sharded_runtime"]
