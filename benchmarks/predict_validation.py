"""Predicted vs measured: is the nproc=8 peak foreseen from 1, 2, 4 ranks (and from 1, 2)?

    make predict-validation        # both venvs, one after the other:
    .venv-oneflow/bin/python benchmarks/predict_validation.py
    .venv-torch/bin/python benchmarks/predict_validation.py

For the OneFlow eager example (examples/test_oneflow_eager_dp.py) and the torch DDP example
(examples/test_torch_ddp.py), healthy and inflating, each test body is launched at 1, 2, 4 and 8
ranks through the plugin's own TestDriver (the marker's launcher, the plugin's measurement), with the
examples' per-rank batch made smaller (EXAMPLE_LOCAL_BATCH, default 512 rows = 32 MiB) so that eight
inflating ranks fit beside other work in this machine's 24 GiB: at the examples' 2048 rows the torch
twin would hold ~2.3 GiB per rank at 8. Then rank 0's peak at 8 is predicted by
pytest_gpumem.results.predict from the smaller sizes and compared with the measured one, and the marker's
limits (max_ratio, allow_mib) are judged at 8 on the measured and on each predicted figure.

Goals: from 1, 2, 4 the prediction is within 5% of the measured peak at 8, and every verdict at 8
is the same (healthy passes, inflating fails).

Raw figures: benchmarks/results/predict_validation.json (merged per test, so the two venvs fill one
file); the table: benchmarks/results/predict_validation.txt, rewritten from the JSON.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# Run as a script: the checkout's package is imported, so its path goes first (hence E402 below).
sys.path.insert(0, str(ROOT))

from pytest_gpumem.config.spec import Defaults, parse_marker  # noqa: E402
from pytest_gpumem.judging.verdict import judge  # noqa: E402
from pytest_gpumem.launching.driver import TestDriver  # noqa: E402
from pytest_gpumem.launching.rank_setup import RankSetup  # noqa: E402
from pytest_gpumem.results import predict  # noqa: E402
from pytest_gpumem.results.size import SizeResult  # noqa: E402

EXAMPLES = {
    "oneflow": ("examples/test_oneflow_eager_dp.py", ("test_oneflow_eager_dp", "test_oneflow_eager_dp_inflated")),
    "torch": ("examples/test_torch_ddp.py", ("test_torch_ddp", "test_torch_ddp_inflated")),
}
GOAL = 0.05
RESULTS = ROOT / "benchmarks" / "results"


def marker_kwargs(path: str, name: str) -> dict[str, Any]:
    """The test's gpumem marker arguments, read from the example module itself."""
    spec = importlib.util.spec_from_file_location(f"_example_{name}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for mark in getattr(getattr(module, name), "pytestmark", []):
        if mark.name == "gpumem":
            return dict(mark.kwargs)
    raise SystemExit(f"{path}::{name} has no gpumem marker")


def rank_pytest_args(test_id: str) -> list[str]:
    """What the plugin's ParentSide gives a rank: this rootdir and ini, just the test, no xfail games."""
    path, _, rest = test_id.partition("::")
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:randomly", "--runxfail", "--rootdir", str(ROOT),
            "-c", str(ROOT / "pyproject.toml")]
    if importlib.util.find_spec("xdist") is not None:
        args += ["-n", "0"]
    return [*args, f"{ROOT / path}::{rest}"]


def measure(test_id: str, kwargs: dict[str, Any], sizes: tuple[int, ...], batch: int, timeout: float,
            launcher: str | None) -> dict[str, Any]:
    env = {**(kwargs.get("env") or {}), "EXAMPLE_LOCAL_BATCH": str(batch)}
    spec = parse_marker((), {**kwargs, "nproc": list(sizes), "env": env, "timeout": timeout,
                             **({"launcher": launcher} if launcher else {})}, Defaults())
    runner = TestDriver(cwd=ROOT, setup=RankSetup(rootdir=ROOT, rank_pytest_args=rank_pytest_args))
    started = time.monotonic()
    test = runner.run(test_id, spec)
    out: dict[str, Any] = {"launcher": spec.launcher,
                           "limits": {"max_ratio": spec.max_ratio, "allow_mib": spec.allow_mib,
                                      "max_mib": spec.max_mib},
                           "local_batch": batch, "seconds": round(time.monotonic() - started, 1)}
    if test.problems or test.skip_reason:
        out["error"] = (test.skip_reason or "\n".join(test.problems))[-2000:]
        return out
    out["measured"] = {str(n): reading.mib for n, reading in test.readings.items()}
    out["ranks"] = {str(r.world_size): {str(k): p.mib for k, p in r.peaks.items()} for r in test.results}
    out["method"] = sorted({r.methods for r in test.results})
    out["durations"] = {str(r.world_size): round(r.duration_s, 1) for r in test.results}
    return out


def analyse(entry: dict[str, Any], target: int) -> dict[str, Any]:
    """Predictions of ``target`` from the smaller sizes and from the two smallest; verdicts at target."""
    measured = {int(n): v for n, v in entry["measured"].items()}
    smaller = sorted(n for n in measured if n < target)
    limits = entry["limits"]
    spec = parse_marker((), {"nproc": sorted(measured), "max_ratio": limits["max_ratio"],
                             "allow_mib": limits["allow_mib"], "max_mib": limits["max_mib"]}, Defaults())

    def result(n: int) -> SizeResult:
        from pytest_gpumem.sampling import Peak

        return SizeResult(n, "cpu", {0: Peak(measured[n], "measured")})

    def fails_at_target(results: list[SizeResult]) -> bool:
        return any(c.world_size == target for c in judge(spec, results).failures)

    limits_at_target = [c.limit_mib for c in judge(spec, [result(n) for n in sorted(measured)]).checks
                        if c.world_size == target and c.limit_mib is not None]
    out: dict[str, Any] = {"target": target, "measured": measured[target],
                           "limit": min(limits_at_target) if limits_at_target else None,
                           "verdict_measured": ("FAIL" if fails_at_target([result(n) for n in sorted(measured)])
                                                else "pass")}
    for label, sizes in (("from_smaller", smaller), ("from_two", smaller[:2])):
        p = predict.predict([(n, measured[n]) for n in sizes], target)
        launched = [result(n) for n in sizes]
        verdict = fails_at_target(launched + [SizeResult(target, "cpu", {}, prediction=p)])
        out[label] = {"sizes": sizes, "model": p.fit.model.formula, "loo_error": p.fit.loo_error,
                      "fitted_on": list(p.fit.sizes), "left_out": [n for n, _ in p.fit.left_out],
                      "loo_error_with_left_out": p.fit.loo_error_with_left_out,
                      "predicted": p.mib, "error": (p.mib - measured[target]) / measured[target],
                      "verdict": "FAIL" if verdict else "pass",
                      "candidates": {m.formula: predict.loo_error(m, [(n, measured[n]) for n in sizes])
                                     if len(sizes) > m.params else None for m in predict.MODELS}}
    return out


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:+.1f}%"


def render(doc: dict[str, Any]) -> str:
    analysed = [e["analysis"] for e in doc["tests"].values() if "analysis" in e]
    target = analysed[0]["target"] if analysed else 8
    smaller = ",".join(map(str, analysed[0]["from_smaller"]["sizes"])) if analysed else "1,2,4"
    two = ",".join(map(str, analysed[0]["from_two"]["sizes"])) if analysed else "1,2"
    lines = [f"Predicted vs measured rank-0 peak at nproc={target} (CPU), pytest_gpumem.results.predict",
             f"command: {doc.get('command', '?')}", ""]
    header = ("test", *smaller.split(","), f"{target} measured", f"limit at {target}", f"| from {smaller}: model",
              "fitted on", "predicted", "error",
              "LOO", f"| from {two}: predicted", "error", f"| verdict at {target}: measured", f"from {smaller}",
              f"from {two}")
    rows, notes, goal_rows = [], [], []
    for test_id in sorted(doc["tests"]):
        entry = doc["tests"][test_id]
        name = test_id.split("::")[1]
        if "error" in entry:
            notes.append(f"{test_id}: no result: {entry['error'].splitlines()[-1] if entry['error'] else '?'}")
            continue
        a = entry["analysis"]
        m = entry["measured"]
        big, small = a["from_smaller"], a["from_two"]
        rows.append((name, *(f"{m[str(n)]:.1f}" for n in big["sizes"]), f"{a['measured']:.1f}",
                     "-" if a.get("limit") is None else f"{a['limit']:.1f}",
                     f"| {big['model']}", ",".join(map(str, big["fitted_on"])) + (
                         f" ({','.join(map(str, big['left_out']))} left out)" if big["left_out"] else ""),
                     f"{big['predicted']:.1f}", _pct(big["error"]),
                     "n/a" if big["loo_error"] is None else f"{big['loo_error'] * 100:.1f}%",
                     f"| {small['predicted']:.1f}", _pct(small["error"]),
                     f"| {a['verdict_measured']}", big["verdict"], small["verdict"]))
        goal_rows.append((name, abs(big["error"]) <= GOAL,
                           a["verdict_measured"] == big["verdict"] == small["verdict"]))
        notes.append(f"{test_id}: {entry['launcher']} launcher, EXAMPLE_LOCAL_BATCH={entry['local_batch']}, "
                     f"limits max_ratio={entry['limits']['max_ratio']} allow_mib={entry['limits']['allow_mib']}, "
                     f"method {', '.join(entry['method'])}, {entry['seconds']:.0f} s for all launches; "
                     f"LOO errors of each model over {smaller}: " + ", ".join(
                         f"{k} {'n/a' if v is None else f'{v * 100:.1f}%'}" for k, v in big["candidates"].items()))
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(widths[i]) for i, c in enumerate(r)).rstrip()  # noqa: E731
    lines += ["rank-0 peak MiB", fmt(header), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows), ""]
    if goal_rows:
        within = sum(ok for _, ok, _ in goal_rows)
        same = sum(ok for _, _, ok in goal_rows)
        lines.append(f"goal: predicted {target} from {smaller} within {GOAL * 100:.0f}% of measured: {within} of "
                     f"{len(goal_rows)}; same verdict at {target} (measured, from {smaller}, from {two}): "
                     f"{same} of {len(goal_rows)}")
        lines.append("")
    lines += ["left out: nproc=1 below the trend of the larger sizes and every model over all sizes missing a",
              "held-out size by more than 5% (OneFlow's multi-process runtime exists only when N > 1):",
              "the larger sizes alone are fitted (pytest_gpumem.results.predict.fit). "
              "LOO n/a: two sizes, nothing to judge.",
              "", "runs:", *(f"  {n}" for n in notes), "", "environments:"]
    lines += [f"  {k}: {v}" for k, v in sorted(doc.get("environments", {}).items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=sorted(EXAMPLES), action="append",
                        help="default: every framework this interpreter can import")
    parser.add_argument("--sizes", default="1,2,4,8", help="world sizes to launch; the largest is predicted")
    parser.add_argument("--local-batch", type=int, default=512, help="EXAMPLE_LOCAL_BATCH for the ranks")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per launch")
    parser.add_argument("--launcher", help="override the markers' launcher")
    parser.add_argument("--out", type=Path, default=RESULTS / "predict_validation.json")
    parser.add_argument("--render-only", action="store_true", help="rewrite the .txt from the JSON")
    args = parser.parse_args(argv)
    sizes = tuple(sorted(int(s) for s in args.sizes.split(",")))
    doc = json.loads(args.out.read_text()) if args.out.exists() else {"tests": {}, "environments": {}}
    frameworks = args.framework or [f for f in EXAMPLES if importlib.util.find_spec(f) is not None]
    if not args.render_only:
        for framework in frameworks:
            module = importlib.import_module(framework)
            doc["environments"][framework] = (f"{framework} {getattr(module, '__version__', '?')}, Python "
                                              f"{platform.python_version()}, {os.cpu_count()} CPUs, "
                                              f"{datetime.date.today().isoformat()}")
            path, names = EXAMPLES[framework]
            for name in names:
                test_id = f"{path}::{name}"
                print(f"{test_id}: launching nproc {', '.join(map(str, sizes))} ...", flush=True)
                entry = measure(test_id, marker_kwargs(path, name), sizes, args.local_batch, args.timeout,
                                args.launcher)
                if "error" not in entry:
                    entry["analysis"] = analyse(entry, max(sizes))
                doc["tests"][test_id] = entry
                print(json.dumps(entry.get("analysis", entry.get("error")), indent=1), flush=True)
        doc["command"] = ("make predict-validation (= .venv-oneflow/bin/python benchmarks/predict_validation.py; "
                          ".venv-torch/bin/python benchmarks/predict_validation.py)")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    for entry in doc["tests"].values():  # the analysis follows the code, the measurements stay
        if "measured" in entry:
            entry["analysis"] = analyse(entry, max(int(n) for n in entry["measured"]))
    text = render(doc)
    args.out.with_suffix(".txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
