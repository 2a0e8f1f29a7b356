"""Model zoo: tiny Hugging Face models built from configs (no download), a torchvision-style CNN
with BatchNorm, recurrent layers and ``nn.TransformerEncoder``, each trained sharded on every
rank and as single-process eager training (the reference), for tests/distributed/test_model_zoo.py.

The contract compared: each rank r runs the sharded model on its own slice of a global batch and
gradients are averaged over ranks (DDP/FSDP2 semantics), so the reference is the unsharded
deepcopy (made before ``shard``) with loss = mean over r of loss(reference, slice r), each
rank's slice loss computed on its own (this matters for BatchNorm and for per-rank means such as
a masked-LM loss over a different number of masked tokens per rank).

Buffers stay replicated and are updated by each rank's own forward (BatchNorm's running
statistics follow that rank's batch), so the reference keeps one set of buffers per rank: before
it computes slice r, rank r's buffers are loaded into it, and saved back after. At the end rank
r's sharded model is compared with the reference holding rank r's buffers.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import zero3_compile as z3

VOCAB = 97
SEQ = 12
PER_RANK = 2  # sequences (or images) per rank per step


# --------------------------------------------------------------------- Hugging Face models


def _transformers():
    import transformers

    return transformers


def build_bert():
    t = _transformers()
    config = t.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = t.BertForMaskedLM(config)  # decoder tied to the word embeddings
    # The key bias has a zero gradient in exact arithmetic (softmax ignores a per-query constant):
    # it only moves by rounding noise. Initialised to zero (BERT's init) its trained value would
    # be that noise alone, which no relative comparison can check; non-zero, it is checked.
    with torch.no_grad():
        for layer in model.bert.encoder.layer:
            layer.attention.self.key.bias.normal_(std=0.02)
    return model


def build_t5():
    t = _transformers()
    config = t.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return t.T5ForConditionalGeneration(config)


def build_gpt2():
    t = _transformers()
    config = t.GPT2Config(
        vocab_size=VOCAB,
        n_positions=32,
        n_embd=24,
        n_layer=2,
        n_head=4,
        attn_pdrop=0.0,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
    )
    return t.GPT2LMHeadModel(config)


def build_llama():
    t = _transformers()
    config = t.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=24,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return t.LlamaForCausalLM(config)


def build_mixtral():
    t = _transformers()
    config = t.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )
    model = t.MixtralForCausalLM(config)
    model.set_experts_implementation("eager")  # the per-expert loop over the experts hit
    return model


def build_qwen2_moe():
    t = _transformers()
    config = t.Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        output_router_logits=False,
    )
    model = t.Qwen2MoeForCausalLM(config)
    model.set_experts_implementation("eager")
    return model


def _ids(step: int, rank: int, low: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(low, VOCAB, (PER_RANK, SEQ), generator=g)


def causal_lm_batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    ids = _ids(step, rank)
    return {"input_ids": ids, "labels": ids}


def moe_batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank 0's sequences repeat one token: every position has the same hidden state, so its
    tokens reach exactly top-k = 2 of the 4 experts in every layer; rank 1's random tokens reach
    more. The ranks' expert loops run different numbers of iterations."""
    ids = _ids(step, rank)
    if rank == 0:
        ids = torch.full_like(ids, 5 + step)
    return {"input_ids": ids, "labels": ids}


def bert_batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    """Masked LM with padding: a different number of masked tokens per rank and per sequence
    (the loss is a mean over each rank's masked tokens), token types, an attention mask."""
    g = torch.Generator().manual_seed(2000 * step + rank)
    ids = torch.randint(4, VOCAB, (PER_RANK, SEQ), generator=g)
    lengths = [SEQ, SEQ - 3 - 2 * rank - step]
    attention = torch.zeros(PER_RANK, SEQ, dtype=torch.long)
    for i, n in enumerate(lengths):
        attention[i, :n] = 1
    ids = ids.masked_fill(attention == 0, 0)  # [PAD] = 0
    masked = (torch.rand(PER_RANK, SEQ, generator=g) < 0.3 + 0.1 * rank) & (attention == 1)
    masked[:, 1] = True  # at least one per sequence
    labels = ids.masked_fill(~masked, -100)
    inputs = ids.masked_fill(masked, 3)  # [MASK] = 3
    token_types = torch.zeros_like(ids)
    token_types[:, SEQ // 2 :] = 1
    return {
        "input_ids": inputs,
        "attention_mask": attention,
        "token_type_ids": token_types,
        "labels": labels,
    }


def t5_batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3000 * step + rank)
    source = torch.randint(2, VOCAB, (PER_RANK, SEQ), generator=g)
    target = torch.randint(2, VOCAB, (PER_RANK, SEQ // 2), generator=g)
    target[:, -1] = 1  # </s>
    return {"input_ids": source, "labels": target}


def hf_loss(model, batch) -> torch.Tensor:
    return model(**batch).loss


# --------------------------------------------------------------------- CNN with BatchNorm


def conv_bn_relu(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, with a strided 1x1 projection shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
        )

    def forward(self, x):
        identity = self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class SmallResNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = conv_bn_relu(3, 8)
        self.layer1 = conv_bn_relu(8, 8)
        self.layer2 = BasicBlock(8, 16, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def image_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4000 * step + rank)
    # another mean and scale per rank: the per-rank batch statistics really differ
    x = torch.randn(PER_RANK, 3, 8, 8, generator=g) * (1.0 + rank) + 0.5 * rank
    return x, torch.randint(0, 10, (PER_RANK,), generator=g)


def classify_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


# --------------------------------------------------------------------- recurrent, TransformerEncoder


class RecurrentNet(nn.Module):
    def __init__(self, cell: str):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        if cell == "lstm":  # bidirectional, projected: 2 directions x proj_size 6
            self.rnn = nn.LSTM(
                8, 12, num_layers=2, batch_first=True, bidirectional=True, proj_size=6
            )
        else:
            self.rnn = nn.GRU(8, 12, num_layers=2, batch_first=True)
        width = 12
        self.head = nn.Linear(width, VOCAB)

    def forward(self, ids):
        out, _ = self.rnn(self.embed(ids))
        return self.head(out)


def token_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _ids(step, rank, low=0)
    return ids[:, :-1], ids[:, 1:]


def token_loss(model, batch) -> torch.Tensor:
    ids, targets = batch
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class EncoderNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 16)
        layer = nn.TransformerEncoderLayer(
            d_model=16, nhead=4, dim_feedforward=32, dropout=0.0, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.head = nn.Linear(16, 3)

    def forward(self, x, padding_mask=None):
        return self.head(self.encoder(self.inp(x), src_key_padding_mask=padding_mask))


def sequence_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5000 * step + rank)
    return torch.randn(PER_RANK, 8, 6, generator=g), torch.randn(PER_RANK, 8, 3, generator=g)


def regression_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


# --------------------------------------------------------------------- the zoo


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


@dataclass(frozen=True)
class Spec:
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    optimizer: Callable = sgd


MODELS: dict[str, Spec] = {
    "bert": Spec(build_bert, bert_batch, hf_loss),
    "t5": Spec(build_t5, t5_batch, hf_loss),
    "gpt2": Spec(build_gpt2, causal_lm_batch, hf_loss),
    "llama": Spec(build_llama, causal_lm_batch, hf_loss, adamw),
    "mixtral": Spec(build_mixtral, moe_batch, hf_loss),
    "qwen2_moe": Spec(build_qwen2_moe, moe_batch, hf_loss),
    "resnet": Spec(SmallResNet, image_batch, classify_loss),
    "lstm": Spec(lambda: RecurrentNet("lstm"), token_batch, token_loss),
    "gru": Spec(lambda: RecurrentNet("gru"), token_batch, token_loss),
    "transformer_encoder": Spec(EncoderNet, sequence_batch, regression_loss),
}

STEPS = 3


def compiled(model: nn.Module, codegen: str | None) -> nn.Module:
    if codegen is None:
        return model  # the sharded model called eagerly
    return torch.compile(model, backend="zero3", options={"codegen": codegen})


def grads_of(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is not None and hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        out[name] = None if grad is None else grad.detach().clone()
    return out


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _buffer_slots(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    return [
        (f"{prefix}.{key}" if prefix else key, module, key)
        for prefix, module in model.named_modules()
        for key, b in module._buffers.items()
        if b is not None
    ]


class PerRankReference:
    """The unsharded model with one set of buffers per rank (see the module docstring).

    The buffer tensors are swapped in, not copied in place: BatchNorm saves its running
    statistics for backward, so an in-place copy would break the pending backward of the rank
    computed before."""

    def __init__(self, model: nn.Module, world: int):
        self.model = model
        self.slots = _buffer_slots(model)
        self.buffers = [buffers_of(model) for _ in range(world)]

    def load(self, rank: int) -> None:
        for name, module, key in self.slots:
            module._buffers[key] = self.buffers[rank][name]

    def run(self, rank: int, fn: Callable[[nn.Module], Any]) -> Any:
        self.load(rank)
        return fn(self.model)  # updates rank's own buffer tensors in place

    def mean_loss(self, spec: Spec, step: int, world: int) -> torch.Tensor:
        losses = [
            self.run(r, lambda m, r=r: spec.loss(m, spec.batch(step, r))) for r in range(world)
        ]
        return sum(losses) / world


def mean_over_ranks(value: torch.Tensor) -> float:
    total = value.detach().clone().float()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _experts_hit(model: nn.Module, spec: Spec, step: int, rank: int) -> list[list[int]]:
    """The experts rank ``rank``'s tokens reach in each MoE layer (of the unsharded model)."""
    hits: list[list[int]] = []

    def record(module, args):
        hits.append(sorted(set(args[1].flatten().tolist())))

    handles = [
        m.experts.register_forward_pre_hook(record)
        for m in model.modules()
        if "experts" in m._modules
    ]
    try:
        with torch.no_grad():
            spec.loss(model, spec.batch(step, rank))
    finally:
        for h in handles:
            h.remove()
    return hits


def train(rank: int, world: int, name: str, codegen: str | None) -> dict[str, Any]:
    """Train ``name`` sharded (each rank its slice) and its reference for STEPS steps."""
    spec = MODELS[name]
    torch.manual_seed(0)
    model = spec.build()
    model.train()
    reference = PerRankReference(copy.deepcopy(model), world)
    z3.shard(model, sync_timeout_s=120)
    step_model = compiled(model, codegen)
    opt, ref_opt = spec.optimizer(model.parameters()), spec.optimizer(reference.model.parameters())
    out: dict[str, Any] = {"losses": [], "ref_losses": []}
    out["initial"] = {n: p.detach().clone() for n, p in reference.model.named_parameters()}
    if name in ("mixtral", "qwen2_moe"):
        out["experts_hit"] = [
            _experts_hit(copy.deepcopy(reference.model), spec, 0, r) for r in range(world)
        ]
    for step in range(STEPS):
        loss = spec.loss(step_model, spec.batch(step, rank))
        loss.backward()
        ref_loss = reference.mean_loss(spec, step, world)
        ref_loss.backward()
        if step == 0:
            out["grads"], out["ref_grads"] = grads_of(model), grads_of(reference.model)
        out["losses"].append(mean_over_ranks(loss))
        out["ref_losses"].append(ref_loss.item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    reference.load(rank)
    out["state"] = {k: v.clone() for k, v in z3.full_state_dict(model).items()}
    out["ref_state"] = {k: v.detach().clone() for k, v in reference.model.state_dict().items()}
    if name in ("resnet", "transformer_encoder"):
        out.update(_evaluate(rank, name, model, step_model, reference))
    return out


def _evaluate(rank, name, model, step_model, reference) -> dict[str, Any]:
    """Eval-mode inference under no_grad on this rank's batch: compiled, and the sharded model
    called eagerly, against the reference holding this rank's buffers."""
    spec = MODELS[name]
    x = spec.batch(STEPS, rank)[0]
    model.eval()
    reference.model.eval()
    reference.load(rank)
    args = [(x,)]
    if name == "transformer_encoder":  # with padding too: the nested-tensor fast path
        padding = torch.zeros(x.shape[:2], dtype=torch.bool)
        padding[1, 5:] = True
        args.append((x, padding))
    out: dict[str, Any] = {k: [] for k in ("eval", "eval_eager", "ref_eval", "ops", "ref_ops")}
    with torch.no_grad():
        for a in args:
            out["eval"].append(step_model(*a).clone())
            with _RecordOps() as recorded:
                out["eval_eager"].append(model(*a).clone())
            out["ops"].append(sorted(recorded.ops))
            with _RecordOps() as recorded:
                out["ref_eval"].append(reference.model(*a).clone())
            out["ref_ops"].append(sorted(recorded.ops))
    return out


def run_case(rank: int, world: int, name: str, codegen: str | None) -> dict[str, Any]:
    """One case; an unexpected error becomes its result (the other cases still run)."""
    torch._dynamo.reset()
    try:
        return train(rank, world, name, codegen)
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()[-4000:]}
