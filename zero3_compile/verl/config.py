"""``Zero3EngineConfig``: verl's FSDP engine configuration, read by the zero3 engine.

Every key of verl's ``engine/fsdp.yaml`` keeps its meaning where zero3 has one (see
``docs/guides/verl.md`` for the table); two keys are added:

- ``compile_model`` (default True): compile the model with ``torch.compile(backend="zero3")``;
  False runs it eagerly (every parameter gathered as it is read: correct, slow);
- ``zero3_options``: the backend's options (``zero3_compile.Options``), e.g.
  ``{"bucket_mb": 25, "codegen": "eager"}``.

Selected with ``engine._target_=zero3_compile.verl.Zero3EngineConfig`` (SFT) or
``actor_rollout_ref.actor.fsdp_config._target_=...`` (PPO) next to ``strategy=zero3``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from verl.workers.config import FSDPEngineConfig
from verl.workers.config.engine import EngineConfig


@dataclass
class Zero3EngineConfig(FSDPEngineConfig):
    """verl's ``FSDPEngineConfig`` with ``strategy="zero3"`` and the zero3 backend's options."""

    strategy: str = "zero3"
    compile_model: bool = True
    zero3_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        EngineConfig.__post_init__(self)  # FSDPEngineConfig's own check admits fsdp* only
        if self.strategy in ("fsdp", "fsdp2"):  # the fsdp yaml's value, under this _target_
            object.__setattr__(self, "strategy", "zero3")
        if self.strategy != "zero3":
            raise ValueError(
                f"zero3: Zero3EngineConfig with strategy={self.strategy!r}; set strategy=zero3"
            )
        if self.ulysses_sequence_parallel_size > 1:
            raise ValueError(
                "zero3: the zero3 engine has no Ulysses sequence parallelism; set "
                "ulysses_sequence_parallel_size=1"
            )
        if self.qat is not None and getattr(self.qat, "enable", False):
            raise ValueError("zero3: the zero3 engine does not implement QAT; set qat.enable=false")
        from ..compiler.options import Options

        Options.from_dict(dict(self.zero3_options))  # unknown keys: an error listing the valid ones
