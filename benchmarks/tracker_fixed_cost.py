"""What starting and stopping the host tracker costs a rank, whatever its job (issue 29).

A rank tracked from its test's setup pays, besides tracking the job itself: importing memray (it
imports rich), starting the tracker (memray patches the allocator symbols of every shared library
already loaded: the framework's, by then) and stopping it (it restores them and writes the
capture). Measured in fresh processes that first import the framework as a rank's start-up does,
then time each step: CPU seconds, median [min-max] of ``--runs`` processes.

    .venv-torch/bin/python benchmarks/tracker_fixed_cost.py --python .venv-torch/bin/python \\
        --python .venv-oneflow/bin/python [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_cost import framework_of  # noqa: E402

PROBE = r'''
import json, os, sys, tempfile, time
framework = sys.argv[1]
if framework != "none":
    __import__(framework)
t0 = time.process_time()
import memray
t1 = time.process_time()
path = os.path.join(tempfile.mkdtemp(), "capture.bin")
tracker = memray.Tracker(path, native_traces=False, follow_fork=False, trace_python_allocators=True,
                         file_format=memray.FileFormat.AGGREGATED_ALLOCATIONS)
tracker.__enter__()
t2 = time.process_time()
tracker.__exit__(None, None, None)
t3 = time.process_time()
os.unlink(path)
print(json.dumps({"import memray": t1 - t0, "start": t2 - t1, "stop": t3 - t2}))
'''


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", action="append", required=True, help="an interpreter with torch or OneFlow")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"# tracker_fixed_cost.py --runs {args.runs}: CPU seconds per rank, median [min-max]")
    print("| framework loaded | import memray | start | stop | total |")
    print("| --- | --- | --- | --- | --- |")
    for python in args.python:
        framework = framework_of(python)
        for loaded in ("none", framework):
            runs = [json.loads(subprocess.run([python, "-c", PROBE, loaded], capture_output=True, text=True,
                                              check=True).stdout.strip().splitlines()[-1])
                    for _ in range(args.runs)]
            cells = []
            for step in ("import memray", "start", "stop"):
                got = [r[step] for r in runs]
                cells.append(f"{statistics.median(got):.3f} [{min(got):.3f}-{max(got):.3f}]")
            total = statistics.median(sum(r.values()) for r in runs)
            label = f"{loaded} ({framework}'s Python)" if loaded == "none" else loaded
            print(f"| {label} | " + " | ".join(cells) + f" | {total:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
