"""Session outputs: one record per test (JSON-able), the end-of-session table."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from pytest_gpumem.judging.explain import imbalance, peak_times
from pytest_gpumem.judging.verdict import Verdict
from pytest_gpumem.launching.runner import TestRun


def record(test: TestRun, verdict: Verdict | None, status: str, baselines: Mapping[int, float]) -> dict[str, Any]:
    """Everything about one test that outlives the process: sent to the xdist controller as JSON."""
    spec = test.spec
    sizes = []
    for result in test.results:
        label, gated = result.gated(spec.rank)
        sizes.append({
            "nproc": result.world_size,
            "device": result.device,
            "gated_rank": label,
            "gated_mib": gated,
            "others_max_mib": result.others_max(spec.rank),
            "ratio": verdict.ratio(result.world_size) if verdict else None,
            "baseline_mib": baselines.get(result.world_size),
            "ranks": {str(r): p.mib for r, p in sorted(result.peaks.items())},
            "methods": {str(r): p.method for r, p in sorted(result.peaks.items())},
            "host_ranks": {str(r): p.mib for r, p in sorted(result.host_peaks.items())},
            "floor": None if result.floor is None else {
                "framework": result.floor.framework,
                "what": result.floor.describe(result.device, result.world_size),
                "ranks": {str(r): round(mib, 1) for r, mib in sorted(result.floor.ranks.items())}},
            "rss_ranks": {str(r): round(mib, 1) for r, mib in sorted(result.rss_peaks.items())},
            "peak_at_s": {str(r): round(t, 3) for r, t in sorted(peak_times(result).items())},
            "imbalance": imbalance(result),
            "duration_s": round(result.duration_s, 3),
            "reused": result.reused,
            "nodes": {str(r): node for r, node in sorted(result.nodes.items())},
            "timeline": [[round(t, 4), {str(r): round(v, 2) for r, v in point.items()}]
                         for t, point in result.timeline],
            "failed": bool(verdict and any(c.world_size == result.world_size for c in verdict.failures)),
            # Not launched: fitted from the launched sizes (model, its LOO error, the points).
            "predicted": result.prediction.as_dict() if result.prediction is not None else None,
        })
    return {
        "test": test.test_id,
        "status": status,
        "nproc": list(spec.nproc),
        "launcher": spec.launcher,
        "limits": {"max_mib": spec.max_mib, "max_ratio": spec.max_ratio, "allow_mib": spec.allow_mib,
                   "rank": spec.rank, "tolerance": str(spec.tolerance)},
        "sizes": sizes,
        "provenance": test.provenance,
        "messages": [str(c) for c in verdict.failures] if verdict else [],
        "notes": list(verdict.notes) if verdict else [],
    }


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Fixed-width table, one row per test and world size."""
    records = list(records)
    header = ("test", "nproc", "gated peak MiB", "others max", "ratio", "baseline", "device", "verdict")
    rows: list[tuple[str, ...]] = []
    for rec in records:
        if not rec["sizes"]:
            rows.append((rec["test"], ",".join(map(str, rec["nproc"])), "-", "-", "-", "-", "-", rec["status"]))
        for size in rec["sizes"]:
            verdict = rec["status"]
            if rec["status"] in ("FAIL", "XFAIL") and not size["failed"]:
                verdict = "ok"
            nproc = str(size["nproc"]) + ("*" if size["reused"] else "")
            predicted = ", predicted" if size.get("predicted") else ""
            rows.append((
                rec["test"],
                nproc,
                f"{_mib(size['gated_mib'])} ({size['gated_rank']}{predicted})",
                _mib(size["others_max_mib"]),
                "-" if size["ratio"] is None else f"{size['ratio']:.2f}x",
                _mib(size["baseline_mib"]),
                size["device"],
                verdict,
            ))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    line = lambda row: "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip()  # noqa: E731
    out = [line(header), line(tuple("-" * w for w in widths))]
    out.extend(line(row) for row in rows)
    if any(size["reused"] for rec in records for size in rec["sizes"]):
        out.append("* nproc=1 reference reused from an earlier launch in this session")
    out.extend(predicted_lines(records))
    return out


def predicted_lines(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """``nproc=8 of test: predicted by a + b*N from nproc 1,2,4; LOO error 1.2%, not launched``."""
    lines = []
    for rec in records:
        for size in rec["sizes"]:
            fit = size.get("predicted")
            if fit:
                lines.append(f"nproc={size['nproc']} of {rec['test']}: {fit.get('basis', 'predicted')}, not launched")
    return lines


def refresh_lines(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """``test nproc=2: 512.3 -> 530.1 MiB (+3.5%)`` for each rewritten baseline entry."""
    lines = []
    for rec in records:
        for nproc, old, new in rec.get("baseline_changes", []):
            if old is None:
                change = f"(new) -> {new:.1f} MiB"
            else:
                delta = (new - old) / old * 100 if old else 0.0
                change = f"{old:.1f} -> {new:.1f} MiB ({delta:+.1f}%)"
            lines.append(f"{rec['test']} nproc={nproc}: {change}")
    return lines
