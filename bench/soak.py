"""Soak: many fresh multi-rank training jobs; count aborts, hangs and results that differ.

    python -m bench.soak --runs 300 --world 2
    python -m bench.soak --runs 24 --pythons .ci-venv/bin/python,.ci-venv-newest/bin/python
    python -m bench.soak --runs 40 --configs eager,inductor --env MALLOC_CHECK_=3 --env MALLOC_PERTURB_=165

Each job is ``bench/soak_job.py`` on every rank, in processes of its own (a new session each),
cycling through the configurations below and the given Python interpreters (one per torch
version). Every rank runs under ``faulthandler`` with core dumps on (they land in the job's
folder), each job is bounded by ``--timeout``; a job still running then counts as a hang: its
ranks get SIGUSR1 (faulthandler prints every thread's stack) and are killed. A job is:

- an abort, when a rank died of a signal (exit -6 for glibc's heap-corruption abort, -11...);
- a hang, when it ran past the timeout;
- an error, when a rank exited non-zero;
- different, when its losses or parameter digest are not bit-identical to the first run of the
  same configuration and interpreter (the seed is fixed; nothing may depend on timing).

Failures keep their folder (each rank's stdout/stderr, the command, core files) under
``--out/failures``; passing jobs' folders are deleted. ``--out/summary.json`` is rewritten after
every job, ``--out/jobs.jsonl`` gets one line per job.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict

from bench.harness.paths import results_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # on the jobs' PYTHONPATH

# name -> job description (bench/soak_job.py reads it); "world" overrides --world
CONFIGS: dict[str, dict] = {
    "eager": {"codegen": "eager"},
    "inductor": {"codegen": "inductor"},
    "eager-no-prefetch-small-buckets": {
        "codegen": "eager",
        "options": {"prefetch_depth": 0, "bucket_mb": 0.02},
    },
    "eager-deep-prefetch": {
        "codegen": "eager",
        "options": {"prefetch_depth": 3, "reduce_scatter_depth": 2, "bucket_mb": 0.05},
    },
    "inductor-bf16": {"codegen": "inductor", "mixed_precision": True},
    "eager-accumulate-keep-gathered": {
        "codegen": "eager",
        "accumulation": 2,
        "keep_gathered": True,
    },
    "eager-accumulate": {"codegen": "eager", "accumulation": 2},
    "eager-budget": {"codegen": "eager", "options": {"memory_budget_mb": 4096}},
    "eager-offload": {"codegen": "eager", "offload": True},
    "eager-hybrid-4": {"codegen": "eager", "hybrid": True, "world": 4},
    "eager-resume": {"codegen": "eager", "resume": True},
    "inductor-fused-copies": {"codegen": "inductor", "options": {"fused_copies": True}},
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    parser.add_argument(
        "--pythons",
        default=sys.executable,
        help="comma-separated interpreters to cycle through (one per torch version)",
    )
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for every rank")
    parser.add_argument(
        "--option",
        action="append",
        default=[],
        help="KEY=JSON: a backend option for every job (e.g. serial_collectives=false)",
    )
    parser.add_argument(
        "--cold-cache",
        action="store_true",
        help="an empty Inductor/AOTAutograd cache per job (every compile cold, as a fresh machine)",
    )
    parser.add_argument("--out", default=results_dir("soak"))
    return parser.parse_args(argv)


def backend_options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--option {pair!r}: use KEY=JSON, e.g. serial_collectives=false")
        options[key] = json.loads(value)
    return options


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_setup() -> None:
    os.setsid()  # a process group of its own: the driver kills it as a whole
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def torch_version(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    )
    return out.stdout.strip() or "unknown"


def run_job(index: int, name: str, python: str, args, extra_env: dict, folder: str) -> dict:
    job = dict(CONFIGS[name])
    world = job.pop("world", args.world)
    job["options"] = {**job.get("options", {}), **backend_options(args.option)}
    os.makedirs(folder, exist_ok=True)
    result_path = os.path.join(folder, "result.json")
    command = [
        python,
        "-m",
        "bench.soak_job",
        "--job",
        json.dumps(job),
        "--steps",
        str(args.steps),
        "--result",
        result_path,
        "--scratch",
        os.path.join(folder, "scratch"),
    ]
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "PYTHONFAULTHANDLER": "1",
            "PYTHONPATH": ROOT,
            **extra_env,
        }
        if args.cold_cache:
            env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(folder, "scratch", "inductor-cache")
        out = open(os.path.join(folder, f"rank{rank}.log"), "w")
        logs.append(out)
        procs.append(
            subprocess.Popen(
                command,
                env=env,
                cwd=folder,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=_child_setup,
            )
        )
    with open(os.path.join(folder, "command.txt"), "w") as f:
        cold = " cold-cache" if args.cold_cache else ""
        f.write(f"world={world}{cold} env={json.dumps(extra_env)}\n{' '.join(command)}\n")
    start = time.monotonic()
    deadline = start + args.timeout
    hung = False
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            hung = True
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGUSR1)  # faulthandler: every thread's stack
            time.sleep(3.0)
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        # one rank died: give the others a moment to fail on their own, then stop them
        if any(p.poll() not in (None, 0) for p in procs):
            grace = time.monotonic() + 30.0
            while any(p.poll() is None for p in procs) and time.monotonic() < grace:
                time.sleep(0.2)
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    for out in logs:
        out.close()
    codes = [p.returncode for p in procs]
    record = {
        "index": index,
        "config": name,
        "python": python,
        "world": world,
        "seconds": round(time.monotonic() - start, 1),
        "exit_codes": codes,
    }
    signals = [-c for c in codes if c is not None and c < 0 and -c != signal.SIGKILL]
    if hung:
        record["status"] = "hang"
    elif signals:
        record["status"] = "abort"
        record["signals"] = [signal.Signals(s).name for s in signals]
    elif any(c != 0 for c in codes):
        record["status"] = "error"
    elif not os.path.exists(result_path):
        record["status"] = "error"
        record["note"] = "no result written"
    else:
        record["status"] = "ok"
        with open(result_path) as f:
            record["result"] = json.load(f)
    return record


def main(argv=None) -> None:
    args = parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    pythons = [p for p in args.pythons.split(",") if p]
    versions = {p: torch_version(p) for p in pythons}
    extra_env = dict(item.split("=", 1) for item in args.env)
    os.makedirs(os.path.join(args.out, "failures"), exist_ok=True)
    first: dict[tuple[str, str], dict] = {}
    counts: dict[str, Counter] = defaultdict(Counter)
    failures = []
    jobs_log = open(os.path.join(args.out, "jobs.jsonl"), "a")
    started = time.time()
    for index in range(args.runs):
        name = names[index % len(names)]
        python = pythons[(index // len(names)) % len(pythons)]
        folder = os.path.join(args.out, "jobs", f"{index:04d}-{name}")
        record = run_job(index, name, python, args, extra_env, folder)
        record["torch"] = versions[python]
        key = (name, python)
        if record["status"] == "ok":
            reference = first.setdefault(key, record["result"])
            if record["result"] != reference:
                record["status"] = "different"
        counts[record["status"]][name] += 1
        if record["status"] != "ok":
            target = os.path.join(args.out, "failures", os.path.basename(folder))
            shutil.rmtree(os.path.join(folder, "scratch"), ignore_errors=True)
            shutil.move(folder, target)
            record["kept"] = target
            failures.append({k: v for k, v in record.items() if k != "result"})
        else:
            shutil.rmtree(folder, ignore_errors=True)
        jobs_log.write(json.dumps({k: v for k, v in record.items() if k != "result"}) + "\n")
        jobs_log.flush()
        summary = {
            "runs": index + 1,
            "hours": round((time.time() - started) / 3600, 2),
            "torch": sorted(set(versions.values())),
            "configs": names,
            "env": extra_env,
            "options": backend_options(args.option),
            "cold_cache": args.cold_cache,
            "by_status": {s: dict(c) for s, c in counts.items()},
            "failures": failures,
        }
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(
            f"[{index + 1}/{args.runs}] {name} torch {versions[python]}: {record['status']} "
            f"({record['seconds']} s)",
            flush=True,
        )
    totals = {s: sum(c.values()) for s, c in counts.items()}
    print(json.dumps({"runs": args.runs, **totals}))
    if failures:
        print(
            "failures:",
            *(f"  {f['index']} {f['config']}: {f['status']} -> {f['kept']}" for f in failures),
            sep="\n",
        )


if __name__ == "__main__":
    main()
