"""Per-block compile (issue 23): ``for b in blocks: b.compile(backend="zero3")``, FSDP2's and
torchtitan's habit, compiles each distinct block once, past dynamo's recompile limit of 8, and
trains like eager; so does the whole-model compile at that depth.

The getters of a sharded module trace to unbound markers (``frontend/classes.py``), so the
blocks' modules share their classes and their traced graphs; the backend binds each marker to
the parameter it reads (``compiler/passes/bind.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import zero3_compile as z3
from zero3_compile._torch.dynamo import nested_regions_take_dtensor_inputs
from zero3_compile.compiler.recording import record_graphs

from ..support.dist_utils import run_scenarios
from ..support.graph_checks import analyze, inductor_gather_report
from ..support.models import GPT, GPTConfig, GraphBreakGPT, gpt_batch, gpt_loss
from ..support.training import PER_RANK_BATCH, rel_diff

DEPTH = 10  # past dynamo's recompile limit (8): blocks 9 and 10 would run uncompiled
STEPS = 3
TOLERANCE = {"eager": 1e-5, "inductor": 1e-4}


def _llama():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=DEPTH,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(config)

    def loss(model, batch):
        tokens, _ = batch
        return model(input_ids=tokens, labels=tokens, use_cache=False).loss

    return model, model.model.layers, loss


def build(kind: str):
    """(model, a function giving its blocks, loss function) at DEPTH blocks."""
    torch.manual_seed(1234)
    if kind == "gpt":
        model = GPT(GPTConfig(n_layer=DEPTH))
        return model, lambda m: m.transformer.h, gpt_loss
    model, _, loss = _llama()
    return model, lambda m: m.model.layers, loss


def train(rank: int, world: int, kind: str, how: str, codegen: str) -> dict:
    """STEPS SGD steps of the sharded model compiled ``how`` ("whole", "regions": whole with
    ``z3.compile_once(blocks)``, "per_block", or "per_block_handoff": with
    ``cross_graph_prefetch``) on each rank's slice, and of the unsharded twin on the whole
    batch."""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    from zero3_compile.collectives.handoff import HANDOFF

    counters.clear()
    HANDOFF.reset()
    HANDOFF.taken = HANDOFF.discarded = 0
    model, blocks_of, loss_fn = build(kind)
    reference = copy.deepcopy(model)
    z3.shard(model)
    options = {"codegen": codegen, "cross_graph_prefetch": how == "per_block_handoff"}
    if how in ("whole", "regions"):
        if how == "regions":
            z3.compile_once(blocks_of(model))
        step_model = torch.compile(model, backend="zero3", options=options)
    else:
        for block in blocks_of(model):
            block.compile(backend="zero3", options=options)
        step_model = model
    calls = _count_compiled_calls()
    eager = _count_eager_collectives()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    losses, ref_losses = [], []
    with record_graphs() as records:
        for _ in range(STEPS):
            eager.clear()
            inputs, targets = gpt_batch(world * PER_RANK_BATCH, seed=0)
            mine = slice(rank * PER_RANK_BATCH, (rank + 1) * PER_RANK_BATCH)
            loss = loss_fn(step_model, (inputs[mine], targets[mine]))
            loss.backward()
            ref_loss = loss_fn(reference, (inputs, targets))
            ref_loss.backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item() / world)
            ref_losses.append(ref_loss.item())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "params": z3.full_state_dict(model),
        "ref_params": {k: v.detach().clone() for k, v in reference.state_dict().items()},
        "unique_graphs": counters["stats"]["unique_graphs"],
        "compiled_calls": calls[0],
        "graphs": [r.kind for r in records],
        "regions": [_region_calls(r.gm) for r in records],
        "handoff": (HANDOFF.taken, HANDOFF.discarded),
        "eager_collectives": dict(eager),
        "code": [r.source_code for r in records if r.source_code is not None],
        "overlapped": [
            g["overlapped"]
            for r in records
            if r.source_code is not None
            for g in inductor_gather_report(r.source_code)
        ],
    }


def _region_calls(gm) -> dict[str, int]:
    """Calls of nested compile regions in a scheduled graph, by the body they call."""
    calls: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.target is getattr(torch.ops.higher_order, "invoke_subgraph", None):
            body = str(node.args[0].target)
            calls[body] = calls.get(body, 0) + 1
    return calls


def _count_eager_collectives() -> dict[str, int]:
    """Counts the cross-rank checks of eager gathers and reductions (one per collective) from now
    on (in this rank's process)."""
    from zero3_compile.runtime import guard, root

    kinds = {guard.KIND_EAGER_GATHER: "gather", guard.KIND_EAGER_REDUCE: "reduce"}
    count: dict[str, int] = {}
    check = guard.run_check

    def counted(channel, kind, *args, **kwargs):
        if kind in kinds:
            count[kinds[kind]] = count.get(kinds[kind], 0) + 1
        return check(channel, kind, *args, **kwargs)

    guard.run_check = root.run_check = counted
    return count


def _count_compiled_calls() -> list[int]:
    """Counts the calls of compiled graphs from now on (in this rank's process)."""
    from zero3_compile.runtime.gate import GatedCall

    count = [0]
    call = GatedCall.__call__

    def counted(self, *args):
        count[0] += 1
        return call(self, *args)

    GatedCall.__call__ = counted
    return count


# compile_once needs torch >= 2.13 (_torch.dynamo.nested_regions_take_dtensor_inputs); on older torch
# it refuses with an error naming the fix (tested below on every version)
REGIONS = nested_regions_take_dtensor_inputs()
needs_regions = pytest.mark.skipif(not REGIONS, reason="compile_once needs torch >= 2.13")

# the whole Llama with Inductor, inlined or in regions, is left to tests/distributed/test_hf.py (compile time)
CASES = [
    (kind, how, codegen)
    for kind in ("gpt", "llama")
    for how in ("whole", "regions", "per_block", "per_block_handoff")
    for codegen in ("eager", "inductor")
    if (kind, how, codegen)
    not in (
        ("llama", "whole", "inductor"),
        ("llama", "regions", "inductor"),
        ("llama", "per_block_handoff", "inductor"),
    )
    and (REGIONS or how != "regions")
]


def _scenario(rank, world, *case):
    return train(rank, world, *case)


@functools.cache
def results():
    return run_scenarios(_scenario, 2, CASES, timeout=1500)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_trains_like_eager_past_the_recompile_limit(case):
    tol = TOLERANCE[case[2]]
    for r in results()[case]:
        for got, ref in zip(r["losses"], r["ref_losses"]):
            assert abs(got - ref) <= tol * abs(ref), (r["losses"], r["ref_losses"])
        assert r["ref_losses"][-1] < r["ref_losses"][0]
        for name, ref in r["ref_params"].items():
            assert rel_diff(r["params"][name], ref) <= tol, name


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_each_distinct_block_compiles_once(case):
    """One dynamo graph, one forward and one backward graph compiled: the whole model's, or the
    block's that every block runs (a recompile per block would count DEPTH graphs, or 8 and then
    leave the blocks past dynamo's limit uncompiled)."""
    per_step = DEPTH if case[1].startswith("per_block") else 1
    for r in results()[case]:
        assert r["unique_graphs"] == 1, r["unique_graphs"]
        assert sorted(r["graphs"]) == ["backward", "forward"], r["graphs"]
        assert r["compiled_calls"] == STEPS * per_step, r["compiled_calls"]
        if case[1] == "regions":
            # every block runs the one body of its kind, compiled once, forward and backward
            assert [list(calls.values()) for calls in r["regions"]] == [[DEPTH], [DEPTH]], r[
                "regions"
            ]
        else:
            assert r["regions"] == [{}, {}], r["regions"]


@pytest.mark.parametrize("how", ["whole", pytest.param("regions", marks=needs_regions)])
def test_whole_model_gathers_overlap_compute_across_block_boundaries(how):
    """Inductor's code at DEPTH blocks: every all-gather of the forward and backward graphs but
    each graph's first runs while compute does (the next block's gathers are issued during the
    previous block's compute), with the blocks inlined or called as one compiled region."""
    for r in results()[("gpt", how, "inductor")]:
        overlapped = r["overlapped"]
        assert len(overlapped) >= 2 * DEPTH, overlapped
        assert sum(overlapped) >= len(overlapped) - 2, overlapped


@pytest.mark.parametrize("codegen", ["eager", "inductor"])
def test_per_block_graphs_hand_the_next_blocks_first_gather_over(codegen):
    """With ``cross_graph_prefetch``, from the second step on every block's first all-gather
    but the first block's (forward) and the last block's (backward) was issued by the graph
    before it and taken over unchanged (none discarded); the losses are the eager ones (above).
    Inductor's code calls the take and the handoff in the scheduled order (the backend checks
    the generated order, ``signature.check_generated_order``)."""
    for r in results()[("gpt", "per_block_handoff", codegen)]:
        taken, discarded = r["handoff"]
        assert taken == (STEPS - 1) * 2 * (DEPTH - 1), r["handoff"]
        assert discarded == 0, r["handoff"]
        if codegen == "inductor":
            assert all("zero3.take_gather" in c and "zero3.handoff_gather" in c for c in r["code"])
    plain = results()[("gpt", "per_block", codegen)]
    for r, p in zip(results()[("gpt", "per_block_handoff", codegen)], plain):
        assert p["handoff"] == (0, 0), p["handoff"]  # off by default
        assert r["losses"] == p["losses"]  # the same values gathered: bit-identical
        for name, value in p["params"].items():
            assert torch.equal(r["params"][name], value), name


@pytest.mark.parametrize("case", [c for c in CASES if c[1].startswith("per_block")], ids="-".join)
def test_per_block_gathers_the_parameters_outside_the_blocks_together(case):
    """The model's eager forward gathers its parameters outside the compiled blocks (embeddings,
    final norm, head) with one all-gather, and backward reduces them with one reduce-scatter
    (``frontend/root_unit.py``), not one of each per parameter; the losses are eager's (above)."""
    for r in results()[case]:
        assert r["eager_collectives"] == {"gather": 1, "reduce": 1}, r["eager_collectives"]
    whole = results()[(case[0], "whole", "eager")]
    assert all(r["eager_collectives"] == {} for r in whole), whole[0]["eager_collectives"]


def test_root_unit_members_are_the_parameters_outside_compiled_modules(fake_pg):
    """Nothing compiled: no unit (each parameter is gathered when read). Blocks compiled with
    ``Module.compile`` or replaced by ``torch.compile`` wrappers: everything else."""
    from zero3_compile.frontend.root_unit import unit_members

    def names(model):
        return sorted(
            f"{state.prefix}.{attr}".lstrip(".") for state, attr, _ in unit_members(model)
        )

    model = z3.shard(GPT(GPTConfig(n_layer=3)))
    assert names(model) == []
    for block in model.transformer.h[:2]:
        block.compile(backend="zero3")
    outside = {n for n in names(model)}
    assert not any(n.startswith(("transformer.h.0.", "transformer.h.1.")) for n in outside)
    assert any(n.startswith("transformer.h.2.") for n in outside)  # not compiled: a member
    assert {"transformer.wte.weight", "transformer.ln_f.weight"} <= outside
    model.transformer.h[2] = torch.compile(model.transformer.h[2], backend="zero3")
    assert not any(n.startswith("transformer.h.") for n in names(model))


class TaggedBlock(nn.Module):
    def __init__(self, tag: str):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.tag = tag  # read in forward: dynamo guards on its value

    def forward(self, x):
        return torch.relu(self.fc(x)) * (2.0 if self.tag == "block3" else 1.0)


def test_blocks_that_must_recompile_get_our_warning_naming_the_fix(fake_pg, caplog):
    blocks = nn.Sequential(*[TaggedBlock(f"block{i}") for i in range(DEPTH)])
    z3.shard(blocks)
    for block in blocks:
        block.compile(backend="zero3", options={"codegen": "eager"})
    with caplog.at_level(logging.WARNING, logger="zero3_compile"):
        blocks(torch.randn(2, 8)).sum().backward()
    (warning,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("zero3:")]
    assert "recompile_limit" in warning and "TORCH_LOGS=recompiles" in warning
    assert "torch.compile(model, backend='zero3')" in warning
    assert "test_per_block.py" in warning  # where the frame is


# ------------------------------------------------------------------ nested compile regions


def _regions_step(depth: int = 3) -> list:
    """One step of a GPT of ``depth`` blocks compiled whole with ``z3.compile_once`` (fake
    process group, eager codegen): the recorded graphs."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=depth))
    z3.shard(model)
    z3.compile_once(model.transformer.h)
    compiled = torch.compile(model, backend="zero3", options={"codegen": "eager"})
    with record_graphs() as records:
        gpt_loss(compiled, gpt_batch(2)).backward()
    return records


@needs_regions
def test_region_blocks_are_gathered_again_in_backward_not_saved(fake_pg):
    """A region body's own partition returns its parameters (and ``t(w)``) for its backward;
    ``recompute_region_saves`` computes them again in the model's graph from the gathered
    operands, so the forward saves shards and activations only and backward gathers every
    block's parameters again (as for inlined blocks)."""
    from zero3_compile.compiler.graph_facts import region_calls

    records = _regions_step()
    facts = analyze(records)
    for kind in ("forward", "backward"):
        (record,) = [r for r in records if r.kind == kind]
        assert len(region_calls(record.gm.graph)) == 3, kind
    for i in range(3):
        for name in (f"transformer.h.{i}.attn.c_attn.weight", f"transformer.h.{i}.ln_2.bias"):
            assert name in facts["forward"]["gathered_params"], name
            assert name in facts["backward"]["gathered_params"], name
            assert name in facts["backward"]["reduced_params"], name
    assert facts["forward"]["saved_gathered"] == []


@needs_regions
def test_without_recomputing_region_saves_the_partition_check_refuses(fake_pg, monkeypatch):
    """The check that runs after every partition sees through region calls: left to the
    body's own partition, the gathered parameters saved for backward are refused by name."""
    from zero3_compile.compiler import pipeline
    from zero3_compile.compiler.passes.regions import recompute_region_saves
    from zero3_compile.compiler.passes.verify import ScheduleError

    stages = tuple(
        dataclasses.replace(s, passes=tuple(p for p in s.passes if p is not recompute_region_saves))
        for s in pipeline.PIPELINE
    )
    assert len(pipeline.passes_for("joint")) - 1 == sum(
        len(s.passes) for s in stages if s.graph == "joint"
    )
    monkeypatch.setattr(pipeline, "PIPELINE", stages)
    with pytest.raises(Exception) as failure:
        _regions_step()
    error = failure.value
    while error is not None and not isinstance(error, ScheduleError):
        error = error.__cause__ or error.__context__
    assert isinstance(error, ScheduleError), failure.value
    assert "saved gathered parameters" in str(error)


def test_compile_once_on_a_torch_without_sharded_regions_names_the_fix(fake_pg, monkeypatch):
    """Where dynamo's nested compile regions cannot take sharded parameters (torch 2.11), the
    blocks are left unmarked and the error names the alternatives, instead of dynamo's internal
    assertion at the first step."""
    from zero3_compile.frontend import regions

    monkeypatch.setattr(regions, "nested_regions_take_dtensor_inputs", lambda: False)

    class Fresh(nn.Module):  # a block class of its own: no other test marked its generated class
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

    model = z3.shard(nn.Sequential(Fresh(), Fresh()))
    with pytest.raises(RuntimeError, match=r"torch >= 2.13.*block.compile"):
        z3.compile_once(list(model))
    assert not any(type(block).__dict__.get(regions._MARK) for block in model)


@needs_regions
def test_compile_once_refuses_modules_that_are_not_sharded_and_is_idempotent(fake_pg):
    model = GPT(GPTConfig(n_layer=2))
    with pytest.raises(ValueError, match=r"zero3_compile.shard\(model\) first"):
        z3.compile_once(model.transformer.h)
    with pytest.raises(TypeError, match="takes modules"):
        z3.compile_once([1])
    z3.shard(model)
    blocks = model.transformer.h
    z3.compile_once(blocks)
    forward = type(blocks[0]).forward
    z3.compile_once(blocks[1])
    assert type(blocks[1]).forward is forward  # marked once
    # only the generated class is marked: the user's class and unsharded models are unchanged
    from ..support.models import Block

    assert not hasattr(Block.forward, "__marked_compile_region_fn__")
    assert hasattr(forward, "__marked_compile_region_fn__")


class ReadsTwice(nn.Module):
    """Reads its weight twice in one forward (two gathers of one parameter when traced)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x)) + x * self.fc.weight.mean()


class CheckpointedGPT(GPT):
    """The GPT with every block under activation checkpointing (a region inside a
    checkpointed region)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = checkpoint(block, x, use_reentrant=False)
        return self.lm_head(self.transformer.ln_f(x))


def _regions_model(mode: str):
    """(model, its blocks, loss on a fixed batch) for ``mode``."""
    if mode == "read_twice":
        model = nn.Sequential(*[ReadsTwice() for _ in range(3)])
        batch = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
        return model, list(model), lambda m, step: m(batch).square().mean()
    kind = {"graph_break": GraphBreakGPT, "checkpointed": CheckpointedGPT}.get(mode, GPT)
    model = kind(GPTConfig(n_layer=3))
    return model, model.transformer.h, lambda m, step: gpt_loss(m, gpt_batch(4, seed=step))


def _regions_against_inline(rank, world, mode):
    """Three steps of a model compiled whole, with and without ``compile_once``, in ``mode``:
    bf16 parameters; a micro-batch accumulated without gradient sync before each step; a graph
    break between blocks (two graphs calling the region); a block reading its weight twice; every
    block under activation checkpointing; each block's MLP a region inside the block's region.
    The losses and the final parameters of both."""
    runs = {}
    for regions in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, blocks, loss_of = _regions_model(mode)
        z3.shard(model, **({"param_dtype": torch.bfloat16} if mode == "bf16" else {}))
        if regions:
            z3.compile_once(blocks)
            if mode == "nested":  # each block's MLP a region inside the block's region
                z3.compile_once([block.mlp for block in blocks])
        compiled = torch.compile(model, backend="zero3", options={"codegen": "eager"})
        opt = torch.optim.SGD(model.parameters(), lr=0.02)
        losses = []
        for step in range(3):
            if mode == "accumulate":
                z3.set_requires_gradient_sync(model, False)
                loss_of(compiled, 10 + step).backward()
                z3.set_requires_gradient_sync(model, True)
            loss = loss_of(compiled, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[regions] = (losses, z3.full_state_dict(model))
    return runs


MODES = [
    ("bf16",),
    ("accumulate",),
    ("graph_break",),
    ("read_twice",),
    ("checkpointed",),
    ("nested",),
]


@functools.cache
def inline_comparison():
    return run_scenarios(_regions_against_inline, 2, MODES, timeout=900)


@needs_regions
@pytest.mark.parametrize("mode", [m for (m,) in MODES])
def test_regions_train_bit_identically_to_the_inlined_model(mode):
    """The region's body computes what the inlined blocks compute, on the same gathered
    values: mixed precision (bf16 gathers into the body), gradient accumulation (the gradient
    sinks lifted with the markers), a graph break between blocks, a parameter read twice in a
    block (one gather serves both reads), blocks under activation checkpointing and a region in
    a region (reads lifted out of the inner body into the enclosing one, then out of it) give
    the inline compile's losses and parameters to the bit."""
    for r in inline_comparison()[(mode,)]:
        (losses, params), (inline_losses, inline_params) = r[True], r[False]
        assert losses == inline_losses
        assert losses[-1] < losses[0]
        for name, value in inline_params.items():
            assert torch.equal(params[name], value), name
