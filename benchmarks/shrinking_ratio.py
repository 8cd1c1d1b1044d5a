"""A cap per size gates a job whose memory should shrink with N, with no baseline (issue 55).

    .venv-torch/bin/python benchmarks/shrinking_ratio.py --reruns 20

tests/jobs.py HOST_FSDP2_SHRINK (FSDP2 on the host, nproc=1 real, 2 and 8 simulated) in a project of
its own with no baselines: the healthy job ``--reruns`` times (each must pass; the spread is the
widest ratio minus the narrowest), then each of its four regressions once (each must fail at 8). Each
run is a whole ``pytest --gpumem``; every figure is rank 0's peak of live allocations.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from jobs import HOST_FSDP2_SHRINK  # noqa: E402

BUGS = ("gather_logits", "no_reshard", "ema_full", "optimizer_before_shard")


def run(project: Path, label: str, bug: str = "") -> tuple[str, dict[int, float], dict[int, float], list[str]]:
    """One whole ``pytest --gpumem``: (status, {nproc: MiB}, {nproc: ratio}, nproc of failed checks)."""
    report = project / "report.json"
    started = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUMEM_") and k != "CI"}
    subprocess.run([sys.executable, "-m", "pytest", "--gpumem", "-q", "-p", "no:cacheprovider",
                    f"--gpumem-report={report}", "test_fsdp2_shrink.py"], cwd=project, capture_output=True,
                   timeout=1800, env={**env, "FSDP2_BUG": bug})
    rec = json.loads(report.read_text())["tests"][0]
    mib = {s["nproc"]: s["gated_mib"] for s in rec["sizes"]}
    ratio = {s["nproc"]: s["ratio"] for s in rec["sizes"] if s.get("ratio") is not None}
    failed = [str(s["nproc"]) for s in rec["sizes"] for c in s["checks"] if not c["ok"]]
    print(f"{label:24} {time.perf_counter() - started:5.1f} s  {rec['status']:7} "
          + "  ".join(f"{n}: {m:7.2f} MiB" + (f" {ratio[n]:.4f}x" if n in ratio else "") for n, m in mib.items())
          + (f"  failed at {', '.join(failed)}" if failed else ""), flush=True)
    return rec["status"], mib, ratio, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--reruns", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        (project / "test_fsdp2_shrink.py").write_text(HOST_FSDP2_SHRINK)
        (project / "pytest.ini").write_text("[pytest]\n")
        healthy = [run(project, f"healthy {i + 1}") for i in range(args.reruns)]
        bugs = {bug: run(project, bug, bug) for bug in BUGS}
    print(f"\nhealthy: {sum(h[0] == 'passed' for h in healthy)}/{len(healthy)} passed")
    for n in sorted(healthy[0][2]):
        ratios = [h[2][n] for h in healthy]
        peaks = [h[1][n] for h in healthy]
        print(f"  nproc={n}: ratio {min(ratios):.4f}-{max(ratios):.4f}x (spread {max(ratios) - min(ratios):.4f}), "
              f"peak {min(peaks):.2f}-{max(peaks):.2f} MiB")
    for bug, (status, _, ratio, failed) in bugs.items():
        print(f"{bug}: {status}, ratio " + ", ".join(f"{n}: {r:.2f}x" for n, r in ratio.items())
              + f", failed at nproc={', '.join(failed) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
