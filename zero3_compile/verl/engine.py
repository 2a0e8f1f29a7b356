"""The ``zero3`` training engine for verl (``EngineRegistry``: language and value models, on
``cpu`` and ``cuda``).

It is verl's own FSDP engine (``FSDPEngineWithLMHead`` / ``FSDPEngineWithValueHead``) with the
model built and kept by zero3 instead of FSDP: the batch preparation, the micro-batching, the
log-prob / entropy / value computation and the loss functions are verl's, unchanged. What
differs:

- the model: sharded as Hugging Face's ``from_pretrained`` reads it (``z3hf.from_pretrained``),
  peft's LoRA applied to the sharded model (its adapters are sharded on assignment),
  ``model.compile(backend="zero3", options=zero3_options)``; mixed precision from
  ``mixed_precision`` (default bf16 compute, fp32 reduction, like FSDP's);
- gradient accumulation without a reduce-scatter per micro-batch
  (``use_no_sync_for_gradient_accumulation``): ``z3.set_requires_gradient_sync``;
- ``get_per_tensor_param``: ``zero3_compile.rollout.iter_full_parameters`` (one tensor gathered
  at a time; LoRA merged, adapter-only or base-only as verl asks);
- ``to(device, model, optimizer, grad)``: ``z3.offload_states`` / ``z3.reload_states`` (the
  shards, their gradients and the optimizer state to host memory and back, bit-identical; on a
  CPU machine they are in host memory already, and nothing moves);
- checkpoints: ``z3.save_checkpoint`` / ``z3.load_checkpoint`` (sealed, any world size) with the
  LR scheduler and RNG states as each rank's state; ``hf_model`` in ``save_contents`` adds a
  Hugging Face folder (``z3hf.save_pretrained``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings

import torch
import torch.distributed as dist
from verl.utils.device import get_device_name
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import (
    FSDPEngineWithLMHead,
    FSDPEngineWithValueHead,
)

log = logging.getLogger(__name__)

CHECKPOINT = "zero3"  # the sealed sharded checkpoint inside verl's global_step_N folder
HF_FOLDER = "huggingface"


class _Zero3Methods:
    """The zero3 parts of the engine (mixed in front of verl's FSDP engine classes)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        if getattr(engine_config, "strategy", None) != "zero3":
            raise ValueError(
                "zero3: the zero3 engine reads a Zero3EngineConfig; set "
                "engine._target_=zero3_compile.verl.Zero3EngineConfig and engine.strategy=zero3"
            )
        if getattr(model_config, "enable_activation_offload", False):
            raise ValueError(
                "zero3: activation offload is FSDP's; set model.enable_activation_offload=false"
            )
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self._saved_paths: list[str] = []

    # ------------------------------------------------------------------ building

    def initialize(self):
        self._build_model_optimizer()
        self.to(
            device="cpu",
            model=self._is_offload_param,
            optimizer=self._is_offload_optimizer,
            grad=self._is_offload_param,
        )

    def _build_model_optimizer(self):
        module = self._build_module()
        try:
            import inspect

            self.pass_packed_cu_seqlens = (
                "cu_seqlens" in inspect.signature(module.forward).parameters
            )
        except (TypeError, ValueError):
            self.pass_packed_cu_seqlens = False
        if self._is_lora:  # verl's own: peft on the sharded model (adapters sharded on assignment)
            module = self._build_lora_module(module)
        dist.barrier()
        if self.engine_config.compile_model:
            options = {"sync_timeout_s": 1800, **dict(self.engine_config.zero3_options)}
            module.compile(backend="zero3", options=options)
        self.module = module
        if self.engine_config.forward_only:
            self.optimizer = self.lr_scheduler = None
        else:
            self.optimizer = self._build_optimizer(module)
            self.lr_scheduler = self._build_lr_scheduler(self.optimizer)

    def _build_module(self):
        """The Hugging Face model, sharded as it loads."""
        import transformers
        from verl.models.transformers.monkey_patch import apply_monkey_patch
        from verl.utils.model import get_hf_auto_model_class
        from verl.utils.torch_dtypes import PrecisionType

        from ..hf import from_pretrained

        dtype = self.engine_config.model_dtype
        if dtype is None:
            dtype = torch.float32 if not self.engine_config.forward_only else torch.bfloat16
        dtype = PrecisionType.to_dtype(dtype)
        hf_config = self.model_config.hf_config
        if self.model_config.model_type == "language_model":
            model_class = get_hf_auto_model_class(hf_config=hf_config)
        elif self.model_config.model_type == "value_model":
            hf_config.num_labels = 1
            hf_config.classifier_dropout = 0.0
            model_class = transformers.AutoModelForTokenClassification
        else:
            raise ValueError(f"zero3: unknown model_type {self.model_config.model_type!r}")
        # sharded as it loads: no rank holds more than its shards and one whole tensor
        # (transformers 5.10, verl's pin, reads whole tensors; each is cut to its rows)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = from_pretrained(
                model_class,
                self.model_config.local_path,
                torch_dtype=dtype,
                config=hf_config,
                trust_remote_code=self.model_config.trust_remote_code,
                **self._shard_arguments(),
            )
        fused = self.model_config.fused_kernel_options
        apply_monkey_patch(
            model=module,
            use_remove_padding=self.use_remove_padding,
            ulysses_sp_size=1,
            use_fused_kernels=self.model_config.use_fused_kernels,
            fused_kernels_backend=fused.get("impl_backend", None) if fused is not None else None,
        )
        module.to(dtype)
        if self.model_config.enable_gradient_checkpointing:
            module.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        return module

    def _shard_arguments(self) -> dict:
        """``z3.shard``'s arguments from verl's FSDP settings."""
        from torch.distributed.device_mesh import init_device_mesh
        from verl.utils.torch_dtypes import PrecisionType

        from .. import MixedPrecision, Offload

        mixed = self.engine_config.mixed_precision or {}
        # bf16 compute by default, as verl's FSDP engine; fp32 on a CPU, where bf16 matmuls
        # take torch's reference kernels unless the CPU has AMX or AVX512-BF16 (0.2 against
        # 78 GFLOPS in fp32 on the AVX2 machine of bench/RESULTS.md)
        on_cpu = get_device_name() == "cpu"
        param_dtype = PrecisionType.to_dtype(mixed.get("param_dtype", "fp32" if on_cpu else "bf16"))
        reduce_dtype = PrecisionType.to_dtype(mixed.get("reduce_dtype", "fp32"))
        if on_cpu and param_dtype in (torch.bfloat16, torch.float16):
            _warn_half_on_cpu(param_dtype)
        self._autocast_dtype = param_dtype  # verl's forward_step autocasts unless fp32
        self.scaler = None
        if param_dtype == torch.float16:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(growth_interval=400)  # found_inf agreed by all ranks
        device = get_device_name()
        if device == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        world = dist.get_world_size()
        size = self.engine_config.fsdp_size
        if size < 0 or size >= world:
            mesh = self.device_mesh  # verl's, over every rank
        else:  # hybrid: replicas of fsdp_size ranks each
            mesh = init_device_mesh(
                get_device_name(), (world // size, size), mesh_dim_names=("replicate", "shard")
            )
        arguments = {"mesh": mesh, "device": device}
        if param_dtype != torch.float32 or reduce_dtype != torch.float32:
            arguments["mp_policy"] = MixedPrecision(param_dtype, reduce_dtype)
        offload = self.engine_config.offload_policy or self.engine_config.forward_only
        if offload and get_device_name() != "cpu":  # FSDP2's CPUOffloadPolicy: shards on the host
            arguments["offload"] = Offload(params="cpu")
            self._is_offload_param = False
        return arguments

    # ------------------------------------------------------------------ training

    @contextlib.contextmanager
    def _gradient_sync_context(self, *, is_last_micro_batch: bool):
        """Micro-batches before the last accumulate full gradients without a reduce-scatter;
        the last one's backward reduces them all (``z3.set_requires_gradient_sync``)."""
        if not getattr(self.engine_config, "use_no_sync_for_gradient_accumulation", True):
            yield
            return
        from .. import set_requires_gradient_sync

        set_requires_gradient_sync(self.module, is_last_micro_batch)
        try:
            yield
        except BaseException:
            set_requires_gradient_sync(self.module, True)
            raise

    def optimizer_zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def disable_adapter(self):
        disable = getattr(self.module, "disable_adapter", None)
        return disable() if disable is not None else contextlib.nullcontext()

    # ------------------------------------------------------------------ weights out

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """(generator of (HF name, full tensor), peft config dict or None), as verl's FSDP
        engine returns them; every rank must consume the generator (it gathers)."""
        from verl.utils.fsdp_utils import replace_lora_wrapper
        from verl.utils.model import convert_weight_keys
        from verl.workers.engine.fsdp.utils import unfuse_moe_params

        from ..rollout import iter_full_parameters

        peft_config = getattr(self.module, "peft_config", None)
        merge = self.model_config.lora.get("merge", False) if self._is_lora else True
        if peft_config is None or merge:
            lora, config = "merged", None
        else:
            config = peft_config.get("default", None)
            lora = "adapter" if base_sync_done else "base"

        def named():
            for name, tensor in iter_full_parameters(self.module, lora=lora):
                if lora == "base":  # vLLM's LoRA layers hold the base weight under base_layer
                    name = replace_lora_wrapper(name, config)
                (name,) = convert_weight_keys({name: None}, self.module)
                yield name, tensor

        per_tensor = named()
        if lora != "adapter":
            per_tensor = unfuse_moe_params(per_tensor, self.model_config.hf_config.model_type)
        return per_tensor, (config.to_dict() if config is not None else None)

    def get_per_tensor_param_shard(self, **kwargs):
        raise NotImplementedError(
            "zero3: the zero3 engine exports full tensors only (get_per_tensor_param); use a "
            "checkpoint engine that consumes them"
        )

    # ------------------------------------------------------------------ offload between phases

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """Between rollout and training: ``"cpu"`` moves the shards (``model``), their gradients
        (``grad``) and the optimizer state (``optimizer``) to host memory and gives the
        accelerator's memory back (``z3.offload_states``); the accelerator's name brings back
        everything moved (``z3.reload_states``, bit-identical). On a CPU machine the shards are
        in host memory already, and the accelerator's name is ``"cpu"`` too: nothing moves."""
        if grad and not model:
            raise ValueError("zero3: gradients move with the parameters: pass model=True")
        accelerator = get_device_name()
        if device not in (accelerator, "cpu"):
            raise ValueError(f"zero3: engine.to({device!r}): the device is {accelerator} or cpu")
        if accelerator == "cpu" or self.engine_config.forward_only:
            return  # forward_only: the reference model's shards live in host memory already
        if device == "cpu":
            self._offload("cpu", model=model, optimizer=optimizer, grad=grad)
        else:
            self._reload()

    def _offload(self, tier: str, *, model: bool, optimizer: bool, grad: bool) -> None:
        from .. import offload_states

        wanted = (("params", model), ("grads", grad), ("optim_states", optimizer))
        kinds = [kind for kind, on in wanted if on]
        if kinds:
            offload_states(self.module, self.optimizer, include=kinds, device=tier)

    def _reload(self) -> None:
        from .. import reload_states

        reload_states(self.module, self.optimizer)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs
    ):
        """The sealed zero3 checkpoint in ``local_path/zero3`` (model, optimizer, LR scheduler,
        RNG); config and tokenizer in ``local_path/huggingface`` (the whole model too with
        ``hf_model`` in ``checkpoint.save_contents``)."""
        from .. import save_checkpoint

        if local_path is None:
            return
        contents = set(self.checkpoint_config.get("save_contents", ["model", "optimizer", "extra"]))
        rank = dist.get_rank()
        if rank == 0:
            os.makedirs(local_path, exist_ok=True)
        dist.barrier()
        optimizer = self.optimizer if "optimizer" in contents else None
        save_checkpoint(
            os.path.join(local_path, CHECKPOINT),
            self.module,
            optimizer,
            rank_state=self._rank_state() if "extra" in contents else None,
        )
        folder = os.path.join(local_path, HF_FOLDER)
        if "hf_model" in contents:
            from ..hf import save_pretrained

            save_pretrained(self.module, folder, merge_adapters=self._is_lora)
        if rank == 0:
            self._save_config_and_tokenizer(folder)
        dist.barrier()
        if rank == 0 and hdfs_path is not None:
            from verl.utils import hdfs_io

            hdfs_io.makedirs(hdfs_path, exist_ok=True)
            hdfs_io.copy(src=local_path, dst=hdfs_path, dirs_exist_ok=True)
        self._keep_latest(local_path, max_ckpt_to_keep)

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False, **kwargs):
        from .. import load_checkpoint

        contents = set(self.checkpoint_config.get("load_contents", ["model", "optimizer", "extra"]))
        optimizer = self.optimizer if "optimizer" in contents else None
        was_offloaded = self._is_offload_param or self._is_offload_optimizer
        if was_offloaded:
            self.to(get_device_name(), model=True, optimizer=True, grad=True)
        state = load_checkpoint(os.path.join(local_path, CHECKPOINT), self.module, optimizer)
        if state is not None and "extra" in contents:
            self._restore_rank_state(state)
        dist.barrier()
        if was_offloaded:
            self.to(
                "cpu",
                model=self._is_offload_param,
                optimizer=self._is_offload_optimizer,
                grad=self._is_offload_param,
            )
        if del_local_after_load and dist.get_rank() == 0:
            shutil.rmtree(local_path, ignore_errors=True)

    def _rank_state(self) -> dict:
        state = {"rng_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["rng_cuda"] = torch.cuda.get_rng_state()
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = _plain(self.lr_scheduler.state_dict())
        return state

    def _restore_rank_state(self, state: dict) -> None:
        torch.set_rng_state(state["rng_cpu"])
        if "rng_cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng_cuda"])
        if self.lr_scheduler is not None and "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def _save_config_and_tokenizer(self, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        self.model_config.hf_config.save_pretrained(folder)
        processor = self.model_config.get_processor()
        if processor is not None:
            processor.save_pretrained(folder)

    def _keep_latest(self, local_path: str, max_ckpt_to_keep) -> None:
        self._saved_paths.append(local_path)
        if not (isinstance(max_ckpt_to_keep, int) and max_ckpt_to_keep > 0):
            return
        while len(self._saved_paths) > max_ckpt_to_keep:
            old = self._saved_paths.pop(0)
            if dist.get_rank() == 0:
                shutil.rmtree(old, ignore_errors=True)


def _warn_half_on_cpu(dtype: torch.dtype) -> None:
    capability = torch.backends.cpu.get_cpu_capability()
    if dist.get_rank() == 0 and "AMX" not in capability.upper():
        log.warning(
            "zero3: mixed_precision.param_dtype=%s on a CPU (%s): without AMX or AVX512-BF16 "
            "torch computes its matmuls with reference kernels, two orders of magnitude slower "
            "than fp32; set engine.mixed_precision.param_dtype=fp32 unless the CPU has them",
            dtype,
            capability,
        )


def _plain(value):
    """A scheduler's state as the checkpoint's rank state holds it (no functions: verl's
    schedulers are ``LambdaLR``s, whose lambdas are not saved)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if not callable(v)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@EngineRegistry.register(model_type="language_model", backend="zero3", device=["cpu", "cuda"])
class Zero3EngineWithLMHead(_Zero3Methods, FSDPEngineWithLMHead):
    """verl's language-model engine on a zero3-sharded, ``torch.compile(backend="zero3")`` model."""


@EngineRegistry.register(model_type="value_model", backend="zero3", device=["cpu", "cuda"])
class Zero3EngineWithValueHead(_Zero3Methods, FSDPEngineWithValueHead):
    """verl's value-model (critic) engine on a zero3-sharded model."""
