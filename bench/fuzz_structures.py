"""The structure fuzzer at nightly size: hundreds of random models trained with zero3 against
single-process eager; every failure shrunk to a minimal reproducer and printed.

    python -m bench.fuzz_structures --cases 300 --seed 1
    python -m bench.fuzz_structures --cases 40 --seed 7 --worlds 2 --inductor 0
    python -m bench.fuzz_structures --replay '<a case JSON printed by a failure>'

Cases come from ``tests/support/structure_cases.py`` (the hypothesis strategy the suite's fixed-seed
slice, ``tests/distributed/test_structure_fuzz.py``, draws from too): world sizes in turn from ``--worlds``,
``--inductor`` of them compiled with Inductor, the rest with the eager codegen. Each world size
runs in one process launch (``tests/support/structure_runner.py``'s ``RankPool``), restarted only after a
case that raised or hung. Per case one line: index, world, codegen, status, seconds. At the end:
the figures (cases, passed, failed, invalid: cases eager itself refuses, time, launches), then
for each kind of failure (``signature``) its first case shrunk (``--shrink-budget`` runs at most)
and printed as a standalone module with its error, and the JSON that ``--replay`` takes.
Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

from tests.support.structure_cases import EXCLUDED, Case, draw_cases, source
from tests.support.structure_runner import CaseRunner, signature
from tests.support.structure_shrink import minimize


def _describe(result: dict) -> str:
    detail = result["detail"]
    if isinstance(detail, list):
        return "; ".join(detail[:4]) + (f" (+{len(detail) - 4} more)" if len(detail) > 4 else "")
    return str(detail)


def _report(case: Case, result: dict) -> str:
    lines = [
        "-" * 100,
        f"FAILURE {signature(result)}: {_describe(result)}",
        "",
        source(case).rstrip(),
        "",
        f"# replay: python -m bench.fuzz_structures --replay '{case.to_json()}'",
    ]
    if result.get("traceback"):
        lines += ["", "# rank traceback (last lines):"]
        lines += ["#   " + line for line in result["traceback"].rstrip().splitlines()[-25:]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worlds", default="1,2,3", help="world sizes, in turn")
    parser.add_argument("--inductor", type=int, default=None, help="cases with Inductor (5%%)")
    parser.add_argument("--shrink-budget", type=int, default=40, help="runs per shrink")
    parser.add_argument("--max-shrinks", type=int, default=6, help="kinds of failure shrunk")
    parser.add_argument("--replay", help="run one case given as JSON (then shrink it if it fails)")
    parser.add_argument("--json", help="write the summary and failures here")
    args = parser.parse_args(argv)

    runner = CaseRunner()
    start = time.monotonic()
    if args.replay:
        drawn = [Case.from_json(args.replay)]
    else:
        inductor = round(args.cases * 0.05) if args.inductor is None else args.inductor
        worlds = tuple(int(w) for w in args.worlds.split(","))
        drawn = draw_cases(args.cases, args.seed, worlds=worlds, inductor=inductor)
        print(
            f"{len(drawn)} cases (seed {args.seed}, worlds {worlds}, {inductor} with Inductor); "
            f"excluded from the draw: {sorted(EXCLUDED) or 'nothing'}",
            flush=True,
        )
    counts: collections.Counter = collections.Counter()
    first_failures: dict[str, tuple[Case, dict]] = {}
    failures = []
    try:
        for index, case in enumerate(drawn):
            began = time.monotonic()
            result = runner(case)
            counts[result["status"]] += 1
            print(
                f"{index:4d} world {case.world} {case.codegen:8s} {result['status']:8s} "
                f"{time.monotonic() - began:6.1f}s  "
                + (_describe(result)[:160] if result["status"] != "ok" else ""),
                flush=True,
            )
            if result["status"] in ("mismatch", "error"):
                failures.append({"index": index, "case": case.to_json(), "result": result})
                first_failures.setdefault(signature(result), (case, result))
        run_seconds = time.monotonic() - start
        launches = runner.launches
        reports = []
        for kind, (case, _) in list(first_failures.items())[: args.max_shrinks]:
            print(f"shrinking the first {kind} ...", flush=True)
            small, result, runs = minimize(case, runner, budget=args.shrink_budget)
            reports.append(_report(small, result) + f"\n# shrunk in {runs} runs")
    finally:
        runner.close()
    failed = counts["mismatch"] + counts["error"]
    summary = {
        "cases": len(drawn),
        "passed": counts["ok"],
        "failed": failed,
        "mismatch": counts["mismatch"],
        "error": counts["error"],
        "invalid": counts["invalid"],
        "seconds": round(run_seconds),
        "seconds_with_shrinking": round(time.monotonic() - start),
        "launches": launches,
        "failure_kinds": sorted(first_failures),
    }
    print("\n".join(reports))
    print("=" * 100)
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "failures": failures, "reports": reports}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
