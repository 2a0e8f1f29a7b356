"""The disk: its own sequential bandwidth, page-cache drops, the zero3 offload stores of a
model and a trace of their transfers that can be replayed on the same files.

Example:
    rates = disk_bandwidth("/scratch")          # {"write_gbps": ..., "read_gbps": ..., ...}
    drop_page_cache()                           # root: the next read is the disk's
    read = sum(s.bytes_read for s in offload_stores(model, opt))
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time

GiB = 2**30


def offload_stores(model, opt) -> list:
    """The offload stores a zero3 model and its optimizer read and write through (parameters,
    optimizer state, spooled gradients), each once; their counters: ``bytes_read``,
    ``bytes_written``, ``io_seconds`` (the I/O threads' busy time), ``wait_seconds`` (exposed)."""
    from zero3_compile.sharding.state import state_of

    stores = {}
    for p in model.parameters():
        state = state_of(p)
        if state is not None and state.offload is not None:
            stores[id(state.offload.store)] = state.offload.store
    offloaded = getattr(opt, "_zero3_offload", None)
    if offloaded is not None:
        stores[id(offloaded.store)] = offloaded.store
    spool = None
    for p in model.parameters():
        state = state_of(p)
        if state is not None and state.root.grad_spool is not None:
            spool = state.root.grad_spool
            break
    if spool is not None:
        stores[id(spool.store)] = spool.store
    return list(stores.values())


class IoTrace:
    """Every transfer of the offload stores while ``on`` (``--io-trace``: the steady steps):
    start and end times, the store's file, offset, bytes, direction. ``replay`` then moves the
    same requests on the same files again with nothing else running: the disk's time for the
    step's own pattern (sizes, offsets, concurrency), to set beside the step's and the
    sequential test's."""

    def __init__(self):
        from zero3_compile.offload.store import DiskStore

        self.on = False
        self.events: list[tuple] = []  # (start, end, path, offset, nbytes, write)
        self.marks: list[float] = []  # each traced step's start
        original = DiskStore._transfer
        trace = self

        def traced(store, tensor, offset, nbytes, write):
            start = time.perf_counter()
            try:
                return original(store, tensor, offset, nbytes, write)
            finally:
                if trace.on:  # list.append: atomic under the GIL, from any I/O thread
                    trace.events.append(
                        (start, time.perf_counter(), store.path, offset, nbytes, write)
                    )

        DiskStore._transfer = traced

    def save(self, path: str) -> None:
        """The transfers as JSON rows (start and end in seconds from the first one's start,
        the store's file name, offset, bytes, write), to study after the run."""
        events = sorted(self.events)
        first = events[0][0] if events else 0.0
        with open(path, "w") as f:
            json.dump(
                [
                    [round(a - first, 6), round(b - first, 6), os.path.basename(p), o, n, w]
                    for a, b, p, o, n, w in events
                ],
                f,
            )

    def summary(self) -> dict:
        """Bytes, the time at least one transfer was in flight (``busy_s``) and the mean number
        in flight then, and the transfers' sizes."""
        events = sorted(self.events)
        busy, end = 0.0, float("-inf")  # the union of the transfers' intervals
        for start, stop, *_ in events:
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
        inflight = sum(stop - start for start, stop, *_ in events)
        sizes = sorted(e[4] for e in events)
        return {
            "transfers": len(events),
            "read": sum(e[4] for e in events if not e[5]),
            "written": sum(e[4] for e in events if e[5]),
            "busy_s": busy,
            "mean_in_flight": inflight / busy if busy else 0.0,
            "median_bytes": sizes[len(sizes) // 2] if sizes else 0,
        }

    def last_step(self) -> list[tuple]:
        """The events of the last traced step (from its forward's start)."""
        since = self.marks[-1] if self.marks else 0.0
        return sorted(e for e in self.events if e[0] >= since)

    def replay(self, stores: list, events: list[tuple], order: str = "traced") -> dict:
        """``events`` again, on each store's file through a pool of that store's threads, as
        fast as they go (no compute, no waits between them). ``order``: "traced", in the order
        they started; "sorted", the same transfers with each store's reads and its writes in
        ascending offsets, reads and writes of every store interleaved in proportion to their
        bytes (the step's bytes moved as sequentially as they can be). The values are
        overwritten: only after the run is done with them."""
        from concurrent.futures import ThreadPoolExecutor

        by_path = {s.path: s for s in stores if hasattr(s, "fd")}
        events = [e for e in events if e[2] in by_path]
        if order == "sorted":
            streams: dict[tuple, list] = {}
            for e in events:
                streams.setdefault((e[2], e[5]), []).append(e)
            keyed = []
            for stream in streams.values():
                stream.sort(key=lambda e: e[3])
                total, done = sum(e[4] for e in stream), 0
                for e in stream:
                    keyed.append((done / total, e))
                    done += e[4]
            events = [e for _, e in sorted(keyed, key=lambda k: k[0])]
        largest = max((e[4] for e in events), default=0)
        local = threading.local()

        def move(fd: int, offset: int, nbytes: int, write: bool) -> None:
            buffer = getattr(local, "buffer", None)
            if buffer is None:  # page-aligned (O_DIRECT), one per thread
                buffer = local.buffer = mmap.mmap(-1, -(-largest // 4096) * 4096)
            view = memoryview(buffer)[: -(-nbytes // 4096) * 4096]  # O_DIRECT: whole blocks
            call = os.pwritev if write else os.preadv
            done = 0
            while done < len(view):
                n = call(fd, [view[done:]], offset + done)
                if n <= 0:  # a read past the file's end (a region's tail rounded up)
                    break
                done += n

        pools = {
            path: ThreadPoolExecutor(max_workers=store.pool._max_workers)
            for path, store in by_path.items()
        }
        start = time.perf_counter()
        futures = [pools[e[2]].submit(move, by_path[e[2]].fd, e[3], e[4], e[5]) for e in events]
        for future in futures:
            future.result()
        for store in by_path.values():
            os.fsync(store.fd)
        seconds = time.perf_counter() - start
        for pool in pools.values():
            pool.shutdown()
        return {"order": order, "seconds": seconds, "bytes": sum(e[4] for e in events)}


# --------------------------------------------------------------------------- the disk


STREAMS = (1, 2, 4)  # concurrent requests the disk test tries; the bound takes the best rate


def disk_bandwidth(folder: str, size: int = 2 * GiB, block: int = 16 * 2**20) -> dict:
    """Sequential write, read, and both at once with O_DIRECT, 16 MiB blocks (GB/s), each the
    best over 1, 2 and 4 streams (threads, each on its own contiguous part of the file): the
    offload stores keep many requests in flight, and a disk (a virtual one especially) may only
    reach its rate with several; a bound taken at one stream's rate could be beaten. Dirty pages
    (a checkpoint just written) are written back first, so they do not share the disk with it."""
    os.sync()
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "bandwidth.bin")
    other = os.path.join(folder, "bandwidth-mixed.bin")
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    fd, out = os.open(path, flags, 0o600), os.open(other, flags, 0o600)
    best = {"write_gbps": 0.0, "read_gbps": 0.0, "mixed_gbps": 0.0}
    streams = {}
    try:
        os.posix_fallocate(out, 0, size)
        for n in STREAMS:
            write_s = _streamed(n, [(fd, os.pwritev)], size, block)
            read_s = _streamed(n, [(fd, os.preadv)], size, block)
            # the traffic of an offloaded backward: it reads and writes state at once
            both_s = _streamed(n, [(fd, os.preadv), (out, os.pwritev)], size, block)
            rates = {
                "write_gbps": size / write_s / 1e9,
                "read_gbps": size / read_s / 1e9,
                "mixed_gbps": 2 * size / both_s / 1e9,
            }
            for key, rate in rates.items():
                if rate > best[key]:
                    best[key], streams[key] = rate, n
    finally:
        os.close(fd)
        os.close(out)
        os.remove(path)
        os.remove(other)
    return {**best, "streams": streams}


def _streamed(n: int, jobs: list, size: int, block: int) -> float:
    """Seconds for ``n`` threads per (fd, call) in ``jobs`` to move ``size`` bytes of each file in
    ``block``-byte calls, thread i over the i-th of ``n`` contiguous parts; writes are synced."""
    blocks = size // block
    parts = [(i * blocks // n, (i + 1) * blocks // n) for i in range(n)]

    def run(fd: int, call, first: int, last: int) -> None:
        buffer = mmap.mmap(-1, block)  # page-aligned, as O_DIRECT needs
        buffer.write(os.urandom(block))
        for index in range(first, last):
            call(fd, [buffer], index * block)

    threads = [
        threading.Thread(target=run, args=(fd, call, first, last))
        for fd, call in jobs
        for first, last in parts
    ]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for fd, call in jobs:
        if call is os.pwritev:
            os.fsync(fd)
    return time.perf_counter() - start


def drop_page_cache() -> None:
    """Write back and drop the page cache (root only), so the next read is the disk's."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError as error:
        raise SystemExit(f"--cold needs root to drop the page cache: {error}") from error
