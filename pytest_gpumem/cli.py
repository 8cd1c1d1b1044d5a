"""``gpumem``: refresh and show stored baselines.

``gpumem refresh [pytest args]`` is ``pytest --gpumem --gpumem-refresh [pytest args]`` in a fresh
interpreter (the plugin does the writing, so the CLI and pytest can never disagree on the format).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .baseline import BaselineError, BaselineStore
from .settings import option


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpumem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    refresh = sub.add_parser("refresh", help="run the selected gpumem tests and rewrite their baselines",
                             description="Runs pytest --gpumem --gpumem-refresh with the given pytest arguments.")
    refresh.add_argument("pytest_args", nargs=argparse.REMAINDER, help="test selection and pytest options")
    baselines = option("baselines")
    show = sub.add_parser("show", help="list the stored baselines")
    show.add_argument("--test", metavar="PATTERN", help="only test ids matching this glob")
    show.add_argument(baselines.flag.replace("--gpumem-", "--"), dest="baselines",
                      default=os.environ.get(baselines.env or "", baselines.default),
                      help=f"{baselines.help} (default: {baselines.default})")
    return parser


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
    for test, platform, nproc, entry in rows:
        print(f"{test.ljust(width)}  nproc={nproc:<3d} {entry.gated_mib:>10.1f} MiB  "
              f"rank {entry.rank}  {platform}  [{entry.method}]  {entry.provenance.get('date', '')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["refresh"] and not {"-h", "--help"} & set(argv[1:2]):
        # Everything after "refresh" belongs to pytest, options included.
        command = [sys.executable, "-m", "pytest", "--gpumem", "--gpumem-refresh", *argv[1:]]
        return subprocess.call(command)
    args = _parser().parse_args(argv)
    return _show(Path(args.baselines), args.test)


if __name__ == "__main__":
    sys.exit(main())
