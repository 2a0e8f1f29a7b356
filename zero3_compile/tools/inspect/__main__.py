"""``python -m zero3_compile.inspect script.py [--world N] [--out DIR] [-- script args]``

Runs ``script.py`` on N local ranks (torchrun, gloo on CPU / nccl on CUDA as the script chooses)
with every zero3 graph recorded, then prints rank 0's report. Each rank's report.txt,
report.json and pictures are written under DIR/rank<r>/.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from .session import ENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zero3_compile.inspect", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument(
        "script", help="the training script (it calls zero3_compile.shard and torch.compile)"
    )
    parser.add_argument("--world", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument(
        "--out", default="zero3_inspect", help="output folder (default ./zero3_inspect)"
    )
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    script_args = argv[split + 1 :]  # everything after "--" goes to the script
    out = os.path.abspath(args.out)
    env = {**os.environ, ENV: out}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={args.world}",
        args.script,
        *script_args,
    ]
    code = subprocess.call(command, env=env)
    report = os.path.join(out, "rank0", "report.txt")
    if os.path.exists(report):
        with open(report) as f:
            print(f.read())
        for rank_dir in sorted(d for d in os.listdir(out) if d.startswith("rank")):
            for name in sorted(os.listdir(os.path.join(out, rank_dir))):
                print(os.path.join(out, rank_dir, name))
    else:
        print(
            "zero3 inspect: no report was written (did the script compile with backend='zero3'?)",
            file=sys.stderr,
        )
    return code


if __name__ == "__main__":
    sys.exit(main())
