"""The offload host cache (``zero3_compile.offload.host_cache``) as torch's CPU allocator: what it
hands out is what the profiler, and so ``z3 inspect``'s measured peak, sees. Each check runs in a
fresh process: installing the cache changes the process's allocator for good."""

from __future__ import annotations

import json

from .test_errors import run_python


def test_the_profiler_sees_the_blocks_of_the_host_cache():
    done = run_python(
        """
        import json, torch
        from torch.profiler import ProfilerActivity, profile
        from zero3_compile._torch.tracing import cpu_allocations
        from zero3_compile.offload import host_cache
        from zero3_compile.tools.inspect.measure import measure_peak_bytes

        assert host_cache.install(64 << 20, 1 << 20), "the host cache did not install"
        def step():
            kept = torch.ones(4 << 20)  # 16 MiB, from the cache
            spare = torch.ones(2 << 20)  # 8 MiB, freed inside
            del spare
            return kept.sum()
        step()  # the cache now keeps blocks of these sizes: the measured run reuses them
        peak, _ = measure_peak_bytes(step)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            x = torch.empty(3 << 20)  # 12 MiB, a new block
            del x
        sizes = [size for _, size in cpu_allocations(prof)]
        print(json.dumps({"sizes": sizes, "peak": peak, "hits": host_cache.stats()["hits"]}))
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["hits"] > 0, out  # the measured run was served by kept blocks
    assert 12 << 20 in out["sizes"] and -(12 << 20) in out["sizes"], out
    assert out["peak"] >= 24 << 20, out  # both blocks live at once inside step()
