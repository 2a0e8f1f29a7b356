"""The ``zero3`` training engine for verl: ``engine.strategy=zero3``.

Importing this module registers, in verl's registries:

- the engines ``Zero3EngineWithLMHead`` (``language_model``) and ``Zero3EngineWithValueHead``
  (``value_model``) under the backend name ``zero3``, for the devices ``cpu`` and ``cuda``
  (``engine.py``);
- a ``cpu`` platform (``platform.py``): verl 0.9 knows accelerators only.

The package's ``verl.plugins`` entry point imports it whenever ``import verl`` runs (verl loads
every installed plugin then), so a verl job selects the engine by configuration alone
(``engine._target_=zero3_compile.verl.Zero3EngineConfig engine.strategy=zero3``; see
``docs/guides/verl.md``). ``VERL_USE_EXTERNAL_MODULES=zero3_compile.verl`` does the same where
entry points are turned off. Needs ``verl`` (0.9); ``import zero3_compile`` never imports this.
"""

from . import platform  # noqa: F401  (first: verl's engine modules ask for the platform on import)
from .config import Zero3EngineConfig
from .engine import Zero3EngineWithLMHead, Zero3EngineWithValueHead

__all__ = ["Zero3EngineConfig", "Zero3EngineWithLMHead", "Zero3EngineWithValueHead"]
