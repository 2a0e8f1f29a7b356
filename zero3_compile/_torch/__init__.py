"""Every private or version-dependent torch API this package uses, split by torch subsystem.

Nothing else lives here, and nothing outside this package names a private torch attribute or
module (``tests/unit/test_layers.py`` checks it). Supported: torch 2.11 through 2.14
(``pyproject.toml`` pins ``<2.15`` until a newer release passes the suite). Each entry says why it is needed, the
public alternative if there is one, and the versions it was checked on; each has a probe in
``tests/unit/test_torch_probes.py`` that states the assumption and names the entry when a torch
breaks it.

- ``c10d``: the graph-level functional collectives (the stable layer: their Python wrappers were
  renamed in 2.13, the ops were not), group lookup by name, side gloo groups, work registration.
- ``dtensor``: placements, mesh concatenation, the shard read with 2.13's missing-gradient rule,
  the held local tensor and the spec.
- ``dynamo``: backend registration, compile counters, the ``to_local`` rewrites of dynamo graphs.
- ``higher_order``: checkpoint / ``wrap`` / ``invoke_subgraph`` ops and their schema cache.
- ``aot_autograd``: the partitioner, the order of saved values, AOTAutograd's runtime metadata.
- ``inductor``: compile entry points, config patches, cache keys, the generated wrapper's shape.
- ``modules``: a module's own registries of parameters, buffers and children (read and written
  without ``nn.Module.__setattr__``), a recurrent module's weight names.
- ``fx``, ``tensors``, ``autograd``, ``pytree``, ``tracing``, ``checkpoint``, ``pipelining``:
  the smaller seams (op types, schemas and fake values, tensor subclasses, storages and version
  counters, the autograd engine, tree utilities, structured logs and profiler tags, distributed
  checkpoint, pipelining).
"""

from __future__ import annotations

import torch

# (major, minor) of the running torch: read once (version probes run on every shard read)
VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])
