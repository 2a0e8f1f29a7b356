"""``PipelineStage``: ``torch.distributed.pipelining``'s stage for a zero3-sharded stage module.

torch's stage syncs the gradients of FSDP2 and DDP modules on each stage's last micro-batch only
(isinstance checks); any other module it runs as plain code, so a zero3 stage reduce-scatters on
every micro-batch: correct, ``n_microbatches`` times the gradient traffic. This stage does what
torch's does for FSDP2:

- micro-batches but the last run with gradient sync off (``set_requires_gradient_sync``, set
  at each micro-batch's forward, where zero3 decides what its backward does);
  with ``keep_gathered=True`` the parameters are gathered at the first micro-batch and kept until
  the schedule reduces (no collective of ours in between: DDP's memory for the stage);
- the reduction happens before the schedule scales the gradients (``scale_grads``), so each
  gradient is the mean over micro-batches exactly;
- the gradients and kept parameters the metadata inference's real forward and backward left
  behind are dropped.

Schedules that split backward into input and weight parts (ZeroBubble, DualPipeV) compute weight
gradients in a second ``torch.autograd.grad`` pass, after the micro-batch's sync point: refused
with an error naming the schedules that work (torch's own stage runs them over an uncompiled
zero3 stage module, syncing every micro-batch; torch refuses them for compiled modules), at the
start of ``step()`` on every rank (the schedule's action table is the same on all of them), so
no rank is left waiting in a receive for a stage that refused.
"""

from __future__ import annotations

import sys

import torch.nn as nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from .._torch.dynamo import uncompiled
from ..frontend.accumulation import discard_pending, set_requires_gradient_sync
from ..frontend.classes import is_sharded_module


class PipelineStage(_TorchPipelineStage):
    """``torch.distributed.pipelining.PipelineStage`` for a zero3-sharded ``submodule`` (or
    ``torch.compile(submodule, backend="zero3")``); the same arguments, and ``keep_gathered``.

    Example:
        ```python
        from zero3_compile.parallel import PipelineStage

        z3.shard(stage_module, mesh=mesh["dp"])
        compiled = torch.compile(stage_module, backend="zero3")
        stage = PipelineStage(compiled, stage_index, num_stages, device, group=mesh["pp"].get_group())
        schedule = Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn)
        ```
    """

    def __init__(self, submodule: nn.Module, *args, keep_gathered: bool = False, **kwargs):
        self._zero3_model = _sharded_root(submodule)
        self._zero3_keep_gathered = keep_gathered
        super().__init__(submodule, *args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        # A micro-batch's forward decides how its backward treats gradients (the graph reads the
        # sink or the kept parameter), so sync is set here. Every schedule this stage runs does
        # a stage's backwards in micro-batch order: the last forward's backward is the last.
        model = self._zero3_model
        if fwd_chunk_id < self.chunks - 1:
            set_requires_gradient_sync(model, False, keep_gathered=self._zero3_keep_gathered)
        elif not self._zero3_keep_gathered:
            # the last micro-batch's backward reduces the accumulated gradients with its own
            set_requires_gradient_sync(model, True)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def clear_runtime_states(self) -> None:
        # The schedule calls this on each of its stages at the start of step(), before any
        # send or receive: the one point every rank passes with the schedule in hand.
        caller = sys._getframe(1).f_locals.get("self")
        if _splits_backward(getattr(caller, "pipeline_order", None)):
            raise NotImplementedError(_SPLIT_BACKWARD)
        super().clear_runtime_states()

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward=False):
        if backward_type != "full":  # a schedule this stage did not see at step()'s start
            raise NotImplementedError(_SPLIT_BACKWARD)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def scale_grads(self, grad_scale_factor: int) -> None:
        # kept parameters' gradients are reduced into param.grad first
        set_requires_gradient_sync(self._zero3_model, True)
        super().scale_grads(grad_scale_factor)

    def perform_reduce_grad(self, grad_scale_factor: int):
        set_requires_gradient_sync(self._zero3_model, True)
        return super().perform_reduce_grad(grad_scale_factor)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        discard_pending(self._zero3_model)


_SPLIT_BACKWARD = (
    "zero3: this pipeline schedule splits backward into input and weight parts "
    "(ZeroBubble, DualPipeV), which zero3_compile.parallel.PipelineStage cannot sync once per "
    "step; use ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS, or "
    "torch.distributed.pipelining.PipelineStage over the uncompiled zero3 stage module "
    "(it runs these schedules, with a reduction per micro-batch)"
)


def _splits_backward(pipeline_order) -> bool:
    """Whether a schedule's action table (rank -> actions) has input- or weight-only backwards,
    alone or inside an overlapped forward-backward."""
    from .._torch.pipelining import split_backward_types

    split = split_backward_types()
    if not isinstance(pipeline_order, dict):
        return False
    pending = [a for actions in pipeline_order.values() for a in actions or () if a is not None]
    while pending:
        action = pending.pop()
        if action.computation_type in split:
            return True
        pending.extend(getattr(action, "sub_actions", None) or ())
    return False


def _sharded_root(submodule: nn.Module) -> nn.Module:
    module = uncompiled(submodule)
    if not is_sharded_module(module):
        raise ValueError(
            "zero3: zero3_compile.parallel.PipelineStage takes a stage module sharded with "
            "zero3_compile.shard (or torch.compile of one); for other modules use "
            "torch.distributed.pipelining.PipelineStage"
        )
    return module
