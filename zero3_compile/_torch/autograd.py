"""Autograd engine internals."""

from __future__ import annotations

from collections.abc import Callable

import torch


def queue_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the backward pass in progress ends (the engine's private
    ``Variable._execution_engine.queue_callback``, what FSDP uses; no public alternative; only
    valid during a backward), 2.11-2.14."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
