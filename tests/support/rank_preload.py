"""Imported once by the fork server the test ranks are forked from (``dist_utils.PRELOAD``):
what every rank compiling would otherwise compute again. Facts of the machine and the torch
install held in ``functools`` caches (about 1.2 s each with Inductor), and one small compile
with the ``aot_eager`` backend, its caches then reset: the one-time work of a process's first
compile (dynamo's and AOTAutograd's lazy setup, the decomposition tables: about 1 s of every
rank's first compile on this machine). No process group, no file caches, no thread left
running: each rank still starts with empty compile caches and frame counters.

The compile runs on torch 2.13 only, where it was checked to leave no thread behind: from torch
2.14 a compile starts autograd's and other native threads, and a rank forked after it cannot run
a backward ("Unable to handle autograd's threading in combination with fork-based
multiprocessing")."""

import torch
import tqdm
from torch import nn
from torch._inductor import codecache, cpu_vec_isa

cpu_vec_isa.valid_vec_isa_list()  # builds and runs a probe program per instruction set (~0.9 s)
codecache.torch_key()  # a hash of torch's sources (~0.2 s)


def _first_compile() -> None:
    # one intra-op thread (no OpenMP pool to inherit across fork); tqdm's monitor thread, which
    # the first compile would start, stays off (a forked rank must not inherit threads)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    interval = tqdm.tqdm.monitor_interval
    tqdm.tqdm.monitor_interval = 0
    try:
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        compiled = torch.compile(model, backend="aot_eager")
        compiled(torch.randn(2, 8, requires_grad=True)).sum().backward()
    finally:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        tqdm.tqdm.monitor_interval = interval
        torch.set_num_threads(threads)


if torch.__version__.startswith("2.13."):
    _first_compile()
