"""zero3_compile for the Hugging Face stack: ``from zero3_compile import hf as z3hf``.

- ``z3hf.from_pretrained(AutoModelForCausalLM, path, ...)``: sharded as it loads, each rank
  reading only its rows of the safetensors files (``loading.py``);
- ``z3hf.save_pretrained(model, folder)``: a normal Hugging Face folder, a file at a time
  (``saving.py``);
- ``z3hf.Trainer``: a drop-in ``transformers.Trainer`` (``trainer.py``), configured by
  ``zero3_options`` or a DeepSpeed ZeRO-3 config (``deepspeed_config.py``);
- ``z3hf.Accelerator``: accelerate's ``Accelerator`` for your own loop, unchanged otherwise
  (also under ``accelerate launch --use_deepspeed``); ``z3hf.prepare(accelerator, model, ...)``
  does the same with a plain one (``accelerate.py``);
- peft models (LoRA) before or after sharding, saved as peft saves them or merged (``peft.py``);
- ``z3hf.trl.SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ``RewardTrainer``: TRL's trainers
  on zero3 (``trl.py``; TRL is imported on first use).

Needs the ``hf`` extra (``pip install zero3_compile[hf]``: transformers, accelerate, safetensors);
the core package never imports this one.
"""

from . import trl  # noqa: F401  (z3hf.trl.DPOTrainer...; imports TRL on first use only)
from .accelerate import Accelerator, accumulate, prepare
from .deepspeed_config import translate as translate_deepspeed_config
from .loading import from_pretrained
from .saving import save_pretrained
from .trainer import Trainer

__all__ = [
    "Accelerator",
    "Trainer",
    "accumulate",
    "from_pretrained",
    "prepare",
    "save_pretrained",
    "translate_deepspeed_config",
]
