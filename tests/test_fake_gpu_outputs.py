"""A fake GPU has one figure, the allocator's, and no output says otherwise (issue 55).

One failing fake-GPU run against its baseline, every output read: the terminal (failure text, table,
notes), the JSON report, the Markdown summary, the JUnit properties, the benchmark JSON, the plot's
titles and labels, and ``gpumem diff`` of the two reports. None names a device figure or nvidia-smi;
each size is judged once against its baseline, on the allocator figure.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pytest_gpumem import cli
from pytest_gpumem.judging.record_reader import load_report
from pytest_gpumem.judging.report_diff import diff_reports
from pytest_gpumem.presentation import plots

pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.torch]

UNSAID = re.compile(r"nvidia-smi|device figure|NVML", re.IGNORECASE)

JOB = '''
import os

import pytest


@pytest.mark.gpumem(nproc=[1, 2], device="gpu", fake_gpu="on", max_mib=4000)
def test_cuda():
    import torch

    x = torch.ones(int(os.environ.get("MIB", "64")) * 1024 * 1024 // 4, device="cuda")
    y = x * 2
'''


def plot_words(record, path: Path) -> list[str]:
    """Every word a plot shows: titles, legend entries, the text drawn on it."""
    fig = plots.plot(record, path)
    words = [text.get_text() for text in fig.texts]
    for ax in fig.axes:
        words.append(ax.get_title(loc="left"))
        words.extend(text.get_text() for text in ax.texts)
        legend = ax.get_legend()
        if legend is not None:
            words.extend(text.get_text() for text in legend.get_texts())
    return words


def test_no_fake_gpu_output_names_a_device_figure_and_each_size_is_judged_once(
        pytester, monkeypatch, launch_tag, tmp_path, capsys):
    pytester.makepyfile(test_fake=JOB)
    monkeypatch.delenv("CI", raising=False)
    first = pytester.runpytest_subprocess("--gpumem", "--gpumem-refresh", "-p", "no:cacheprovider",
                                          f"--gpumem-report={tmp_path / 'old.json'}", timeout=600)
    first.assert_outcomes(passed=1)
    monkeypatch.setenv("MIB", "80")  # +32 MiB of 128: inside max(5%, 32MiB), outside the allocator's max(0.5%, 16MiB)
    outputs = {name: tmp_path / name for name in ("new.json", "summary.md", "junit.xml", "bench.json")}
    grown = pytester.runpytest_subprocess(
        "--gpumem", "-p", "no:cacheprovider", f"--gpumem-report={outputs['new.json']}",
        f"--gpumem-markdown={outputs['summary.md']}", f"--junitxml={outputs['junit.xml']}",
        f"--gpumem-benchmark-json={outputs['bench.json']}", timeout=600)
    grown.assert_outcomes(failed=1)

    (record,) = load_report(outputs["new.json"])
    checks = [(s.nproc, c.kind, c.figure) for s in record.sizes for c in s.checks if c.kind == "baseline"]
    assert checks == [(1, "baseline", "allocated"), (2, "baseline", "allocated")]  # once a size
    capsys.readouterr()  # what the runs printed
    assert cli.main(["diff", str(tmp_path / "old.json"), str(outputs["new.json"])]) == 1
    diff = capsys.readouterr().out
    rows = diff_reports(load_report(tmp_path / "old.json"), [record]).rows
    assert [(row.nproc, row.figure, row.kind) for row in rows] == [(1, "allocated", "regression"),
                                                                   (2, "allocated", "regression")]

    said = {"terminal": grown.stdout.str(), "diff": diff, "plot": "\n".join(plot_words(record, tmp_path / "p.png")),
            **{name: path.read_text() for name, path in outputs.items()}}
    assert {name: UNSAID.findall(text) for name, text in said.items() if UNSAID.search(text)} == {}
    assert "fake GPU" in said["summary.md"] and "torch allocated on the fake NVIDIA H200" in said["plot"]
    assert said["summary.md"].count("fake GPU: nproc=") == 1  # one footnote for the test, not one a size
