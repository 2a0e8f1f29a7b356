"""``state_dict()`` / ``load_state_dict()`` of a model with offloaded shards: ``state_dict()``
returns loaded copies (under ``offload.deferred.deferred_reads()``: tensors read when used), ``load_state_dict()`` loads the shards, copies in, and stores the new
values (DCP goes through both; under ``offload.incoming.incoming_loads()`` ``state_dict()``
returns tensors a checkpoint load writes straight to the store). What a running load holds is
the model runtime's own."""

from __future__ import annotations

import torch.nn as nn

from ..offload.deferred import StoredTensor, reads_deferred
from ..offload.grads import with_local
from ..offload.incoming import IncomingTensor, loads_incoming
from ..offload.params import load_shards, loaded, store_shards
from ..sharding.state import module_state


def install_offload_state_dict_hooks(model: nn.Module) -> None:
    for module in model.modules():
        state = module_state(module)
        if state is None or not state.params:
            continue
        module.register_state_dict_post_hook(_state_dict_copies)
        module.register_load_state_dict_pre_hook(_load_into_offloaded)
    model.register_load_state_dict_post_hook(_store_after_load)


def _state_dict_copies(module, state_dict, prefix, local_metadata) -> None:
    for attr, param_state in module_state(module).params.items():
        key = prefix + attr
        if param_state.offload is None or key not in state_dict:
            continue
        record = param_state.offload
        if reads_deferred() and record.evicted:  # a checkpoint save reads it when it writes it
            shard = param_state.local()
            local = StoredTensor(
                record.store, record.region, shard.shape, shard.dtype, shard.device
            )
        elif loads_incoming() and record.evicted:  # a checkpoint load writes it to the store
            shard = param_state.local()
            local = IncomingTensor(
                record.store, record.region, shard.shape, shard.dtype, shard.device
            )
        else:
            with loaded([param_state], write_back=False):
                local = param_state.local().clone()
        state_dict[key] = with_local(param_state.param, local)


def _load_into_offloaded(module, state_dict, prefix, *args) -> None:
    own = module_state(module)
    # only the shards this load changes are read and written back (a partial load, or one whose
    # offloaded values a checkpoint load wrote to the store already, leaves the others alone)
    states = [
        p for attr, p in own.params.items() if p.offload is not None and prefix + attr in state_dict
    ]
    load_shards(states)
    own.root.pending_loads.extend(states)


def _store_after_load(module, incompatible_keys) -> None:
    root = module_state(module).root
    states = list({id(s): s for s in root.pending_loads}.values())
    root.pending_loads.clear()
    store_shards(states)
