"""Imported once by the fork server the test ranks are forked from (``dist_utils.PRELOAD``):
what every rank compiling with Inductor would otherwise compute again, about 1.2 s each on this
machine. Pure facts of the machine and the torch install, held in ``functools`` caches; no thread
is started and nothing is compiled."""

from torch._inductor import codecache, cpu_vec_isa

cpu_vec_isa.valid_vec_isa_list()  # builds and runs a probe program per instruction set (~0.9 s)
codecache.torch_key()  # a hash of torch's sources (~0.2 s)
