"""gpumem: refresh and show stored baselines, diff two JSON reports, measure a launch.

``gpumem refresh [pytest args]`` is ``pytest --gpumem --gpumem-refresh [pytest args]`` in a fresh
interpreter (the plugin does the writing, so the CLI and pytest can never disagree on the format).
``gpumem show`` finds the baselines folder as the plugin does: ``--baselines``, then
``GPUMEM_BASELINES``, then the ini file's ``gpumem_baselines``, relative to pytest's rootdir.
``gpumem diff OLD.json NEW.json`` compares two ``--gpumem-report`` files (main vs the PR, same
job, same machine): exit 0 without a regression, 1 with one, 2 on input it cannot compare.
``gpumem measure --nproc 1,2,4 -- train_net.py ...`` runs a program at each size (``measure.py``).
``gpumem bisect GOOD BAD -- tests/test_x.py::test_y`` finds the commit that grew a test's peak
(the ``bisect`` package). ``gpumem calibrate`` records this machine's GPU model for the fake GPU.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .config import inifile, settings
from .config.spec import SpecError, parse_tolerance
from .judging.baseline import BaselineError, BaselineStore
from .judging.record import ReportError
from .judging.record_reader import load_report
from .judging.report_diff import diff_reports
from .presentation.outputs import diff_markdown, diff_table


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpumem", description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    refresh = sub.add_parser("refresh", help="run the selected gpumem tests and rewrite their baselines",
                             description="Runs pytest --gpumem --gpumem-refresh with the given pytest arguments.")
    refresh.add_argument("pytest_args", nargs=argparse.REMAINDER, help="test selection and pytest options")
    baselines = settings.option("baselines")
    show = sub.add_parser("show", help="list the stored baselines",
                          description="Lists the stored baselines. The folder is found as pytest --gpumem finds it: "
                                      f"--baselines, then {baselines.env}, then {baselines.ini} in the ini file "
                                      "pytest would use here, then the default, relative to pytest's rootdir.")
    show.add_argument("--test", metavar="PATTERN", help="only test ids matching this glob")
    show.add_argument(baselines.flag.replace("--gpumem-", "--"), dest="baselines", metavar="DIR",
                      help=f"{baselines.help} (default: {baselines.env}, then {baselines.ini}, "
                           f"then {baselines.default!r} under the rootdir)")
    show.add_argument("--rootdir", type=Path, help="pytest's rootdir (default: found as pytest finds it)")
    sub.add_parser("measure", add_help=False,  # parsed by measure.py: everything after -- is the program
                   help="run an existing launch at several world sizes and print its per-rank scaling table "
                        "(gpumem measure --help)")
    sub.add_parser("bisect", add_help=False,  # parsed by bisect/command.py: everything after -- names the test
                   help="find the first commit at which a test's gated peak grew past the tolerance "
                        "(gpumem bisect --help)")
    sub.add_parser("calibrate", add_help=False,  # parsed by calibrate.py
                   help="on a real GPU: record its model (properties, library workspaces) for the fake GPU "
                        "(gpumem calibrate --help)")
    diff = sub.add_parser("diff", help="compare the gated peaks of two JSON reports (exit 1 on a regression)",
                          description="Per test and world size: gated peak OLD -> NEW; a regression is "
                                      "NEW > OLD + tolerance. Exit 0: none, 1: a regression, 2: bad input.")
    diff.add_argument("old", type=Path, help="the reference report, e.g. from main (--gpumem-report)")
    diff.add_argument("new", type=Path, help="the report to judge, e.g. from the pull request")
    diff.add_argument("--tolerance", metavar="TOL",
                      help='drift allowed above OLD, e.g. "max(5%%, 32MiB)": the larger of the two (default: each '
                           'test\'s own tolerance)')
    diff.add_argument("--markdown", metavar="PATH", type=Path, help="also write the comparison as Markdown here")
    diff.add_argument("--labels", nargs=2, metavar=("OLD", "NEW"), default=("old", "new"),
                      help="names of the two sides in the Markdown (default: old new)")
    return parser


def baselines_dir(cli_value: str | None, cwd: Path, env: dict[str, str], rootdir: Path | None = None) -> Path:
    """The plugin's baselines folder for a pytest run started in ``cwd``: the same option table,
    the same ini file and rootdir (raises IniError or SettingsError naming the source)."""
    setup = inifile.find(cwd, rootdir)
    try:
        resolved = settings.resolve(
            cli={"baselines": cli_value},
            env=env,
            ini={o.name: setup.values.get(o.ini) for o in settings.OPTIONS},
            rootdir=setup.rootdir,
            enabled=False,
            refresh=False,
        )
    except settings.SettingsError as exc:
        raise settings.SettingsError(f"{exc} (ini file: {setup.inipath})" if setup.inipath else str(exc)) from None
    return resolved.baselines


def _show(directory: Path, pattern: str | None) -> int:
    store = BaselineStore(directory)
    try:
        rows = store.entries(pattern)
    except BaselineError as exc:
        print(f"gpumem: {exc}", file=sys.stderr)
        return 2
    if not rows:
        where = f" matching {pattern!r}" if pattern else ""
        print(f"no baselines{where} under {directory}")
        return 0
    width = max(len(test) for test, *_ in rows)
    nproc_width = max(3, *(len(str(nproc)) for _, _, nproc, _ in rows))  # nproc=1024 aligned with nproc=8
    for test, platform, nproc, entry in rows:
        print(f"{test.ljust(width)}  nproc={nproc:<{nproc_width}d} {entry.gated_mib:>10.1f} MiB  "
              f"rank {entry.rank}  {platform}  [{entry.method}]  {entry.provenance.get('date', '')}")
    return 0


def _diff(args: argparse.Namespace) -> int:
    """Thin: load, compare (report_diff.diff_reports), print; every input problem is exit 2 with its file."""
    try:
        tolerance = parse_tolerance(args.tolerance, "--tolerance") if args.tolerance is not None else None
        old, new = load_report(args.old), load_report(args.new)
    except (ReportError, SpecError) as exc:
        print(f"gpumem diff: {exc}", file=sys.stderr)
        return 2
    result = diff_reports(old, new, tolerance)
    for line in diff_table(result):
        print(line)
    if args.markdown is not None:
        try:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text(diff_markdown(result, *args.labels))
        except OSError as exc:
            print(f"gpumem diff: cannot write {args.markdown}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    return 1 if result.regressions else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["refresh"] and not {"-h", "--help"} & set(argv[1:2]):
        # Everything after "refresh" belongs to pytest, options included.
        command = [sys.executable, "-m", "pytest", "--gpumem", "--gpumem-refresh", *argv[1:]]
        return subprocess.call(command)
    if argv[:1] == ["measure"]:
        from . import measure

        return measure.main(argv[1:])
    if argv[:1] == ["bisect"]:
        from . import bisect

        return bisect.main(argv[1:])
    if argv[:1] == ["calibrate"]:
        from . import calibrate

        return calibrate.main(argv[1:], lambda: baselines_dir(None, Path.cwd(), dict(os.environ)))
    args = _parser().parse_args(argv)
    if args.command == "diff":
        return _diff(args)
    try:
        directory = baselines_dir(args.baselines, Path.cwd(), dict(os.environ), args.rootdir)
    except (inifile.IniError, settings.SettingsError) as exc:
        print(f"gpumem show: {exc}", file=sys.stderr)
        return 2
    return _show(directory, args.test)


if __name__ == "__main__":
    sys.exit(main())
