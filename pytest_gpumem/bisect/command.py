"""The ``gpumem bisect`` command: its arguments, the walk from GOOD to BAD, what it prints, its exit status.

The search itself is :mod:`.search`; the commits, :mod:`.commits`; each step's worktree and
measurement, :mod:`.workspace`. Ctrl-C, SIGTERM and SIGHUP are answered by the launch's own
:class:`SignalGuard`: the step is stopped, the worktree removed, and the exit status is 128 + the signal.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Sequence

from ..config.spec import SpecError, Tolerance, parse_tolerance
from ..launching.signal_guard import FatalSignal, SignalGuard
from ..sampling.allocations import is_allocation_method
from .commits import BadInput, Commit, between, git, is_ancestor, resolve_commit
from .search import DIGITS, Judge, StepVerdict, growth_text, search, shown, site_lines
from .workspace import Measurement, Workspace

USAGE = ("gpumem bisect GOOD BAD [--nproc N] [--tolerance TOL] -- <pytest args naming one test>\n"
         "       gpumem bisect GOOD BAD [--nproc N] [--tolerance TOL] -- measure [options] -- PROGRAM ...")
EXAMPLE = "e.g. -- tests/test_train.py::test_ddp"


def bisect_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpumem bisect", usage=USAGE,
        description="Find the first commit at which a gpumem test's gated peak, at the failing world size, "
                    "grew past the tolerance of GOOD's figure. Each commit is measured in a temporary git "
                    "worktree (your checkout, its working tree and its baselines stay untouched); commits "
                    "that do not collect or whose test errors are skipped. Prints every commit tried "
                    "(sha, subject, gated MiB, good/bad/skip and why), then the peak sites that grew, and "
                    "last 'first bad commit: <sha> <subject>'.",
        epilog="Everything after -- names one gpumem test as pytest arguments (run with --gpumem, a private "
               "report and baselines folder), or is a gpumem measure command. Exit 0: found; 1: not found "
               "(skipped commits leave it ambiguous; the range is printed); 2: bad input, GOOD not good "
               "or BAD not bad.")
    p.add_argument("good", metavar="GOOD", help="a commit where the figure was fine: the reference")
    p.add_argument("bad", metavar="BAD", help="a later commit (GOOD must be its ancestor) where it grew")
    p.add_argument("--nproc", type=_nproc, help="the failing world size (default: the largest size "
                   "launched at BAD)")
    p.add_argument("--tolerance", metavar="TOL", type=_tolerance, help='growth allowed above GOOD\'s figure, '
                   'e.g. "max(5%%, 32MiB)", the larger of the two (default: the test\'s own tolerance, as '
                   'GOOD\'s report records it)')
    return p


def _nproc(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not accepted: expected a world size >= 1")
    return int(text)


def _tolerance(text: str) -> Tolerance:
    try:
        return parse_tolerance(text, "--tolerance")
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fail(message: str) -> int:
    print(f"gpumem bisect: {message}", file=sys.stderr)
    return 2


def _line(label: str, commit: Commit, mib: float | None, verdict: str, why: str, width: int) -> str:
    """One commit tried; ``width``: the subjects' column (the longest subject, at most 40)."""
    figure = "-" if mib is None else f"{shown(mib):.{DIGITS}f} MiB"
    subject = commit.subject if len(commit.subject) <= width else commit.subject[:width - 1] + "~"
    return f"{label:>4}  {commit.short}  {subject:<{width}}  {figure:>10}  {verdict} ({why})"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    options, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    args = bisect_parser().parse_args(options)  # exits 2 naming the argument on a bad value
    if not command:
        return _fail("the test is missing: expected -- and then pytest arguments naming one gpumem test "
                     f"({EXAMPLE}), or -- measure [options] -- PROGRAM")
    try:
        repo = Path(git(Path.cwd(), "rev-parse", "--show-toplevel"))
    except RuntimeError:
        return _fail(f"{Path.cwd()} is not inside a git repository: run gpumem bisect in the checkout to search")
    relative = Path.cwd().resolve().relative_to(repo.resolve())
    try:
        good, bad = resolve_commit(repo, args.good, "GOOD"), resolve_commit(repo, args.bad, "BAD")
        if good.sha == bad.sha:
            raise BadInput(f"GOOD and BAD are the same commit {good.short}: expected GOOD older than BAD")
        if not is_ancestor(repo, good, bad):
            raise BadInput(f"GOOD {good.short} is not an ancestor of BAD {bad.short}: expected GOOD to be an "
                           f"older commit of BAD's history")
        commits = between(repo, good, bad)
    except BadInput as exc:
        return _fail(str(exc))
    guard, space, stopped, code = SignalGuard(), None, 0, 0
    try:
        guard.arm()
        space = Workspace(repo, relative, command)
        code = _bisect(space, good, bad, commits, args)
    except (BadInput, RuntimeError) as exc:  # RuntimeError: a git command failed, with its message
        code = _fail(str(exc))
    except KeyboardInterrupt:
        stopped = signal.SIGINT
    except FatalSignal as exc:
        stopped = exc.signum
    finally:
        guard.hold()  # a second Ctrl-C must not cut the clean-up short
        if space is not None:
            space.close()
        held = guard.restore()
    stopped = stopped or (held[0] if held else 0)
    if stopped:
        print(f"gpumem bisect: stopped by {signal.Signals(stopped).name}; the temporary worktree and "
              f"every process of the step are gone", file=sys.stderr)
        return 128 + stopped
    return code


def _bisect(space: Workspace, good: Commit, bad: Commit, commits: list[Commit], args: argparse.Namespace) -> int:
    selected = _check_selection(space, good) if not space.measure_mode else None
    reference = space.measure(good)
    if reference.selected is not None and len(reference.selected) != 1:
        given = " ".join(space.command)
        if not reference.selected:
            raise BadInput(f"the pytest arguments {given!r} select {selected or 'a test'} at GOOD {good.short}, "
                           f"which is not a gpumem test (its report holds no gpumem test): expected one test "
                           f"marked gpumem, {EXAMPLE}")
        raise BadInput(f"the command {given!r} ran {len(reference.selected)} gpumem tests at GOOD {good.short}: "
                       f"{', '.join(reference.selected)}; expected exactly one")
    if reference.problem is not None or reference.record is None:
        raise BadInput(f"GOOD {good.short} is not good: {reference.why_no_figure(args.nproc or 0)}")
    if reference.record.status == "failed" and reference.record.cause == "limit":
        raise BadInput(f"GOOD {good.short} is not good: its test fails there too: "
                       f"{(reference.record.messages or ('failed',))[0]}; expected an older GOOD where it passes")
    test = reference.record.test
    tolerance = args.tolerance or reference.record.spec.tolerance
    latest = space.measure(bad)
    if latest.record is not None and latest.record.test != test:
        latest.problem = f"it ran {latest.record.test}, not {test}"
    nproc = args.nproc or max(latest.launched() or reference.launched() or [1])
    good_size = reference.size(nproc)
    if good_size is None or good_size.gated_mib is None:
        raise BadInput(f"GOOD {good.short} did not measure nproc={nproc}: it launched "
                       f"{', '.join(map(str, reference.launched()))}; expected --nproc among those")
    gated = good_size.measured.peaks.get(good_size.gated_rank) if good_size.gated_rank is not None else None
    # every commit measured on this machine: auto is exact for a host figure of live allocations
    tolerance = tolerance.resolve(good_size.device == "cpu" and gated is not None
                                  and is_allocation_method(gated.method))
    judge = Judge(nproc, good_size.gated_mib, tolerance)
    print(f"gpumem bisect: {test}, gated peak at nproc={nproc} ({good_size.gated_label}), growth allowed "
          f"above GOOD: {tolerance}; {len(commits) - 1} commits between GOOD and BAD")
    width = min(40, max(len(c.subject) for c in [good, *commits]))
    print(_line("GOOD", good, good_size.gated_mib, "good", "the reference", width))
    bad_size = latest.size(nproc)
    verdict, why = judge(bad_size.gated_mib if bad_size else None, latest.why_no_figure(nproc))
    print(_line("BAD", bad, bad_size.gated_mib if bad_size else None, verdict, why, width), flush=True)
    if verdict != "bad":
        raise BadInput(f"BAD {bad.short} is not bad: {why}" + (
            "" if verdict == "skip"
            else f" (GOOD {good.short}: {shown(good_size.gated_mib):.{DIGITS}f} MiB at nproc={nproc})"))

    measured: dict[int, Measurement] = {-1: reference, len(commits) - 1: latest}
    tried = 0

    def probe(index: int) -> StepVerdict:
        nonlocal tried
        tried += 1
        commit = commits[index]
        found = space.measure(commit)
        if found.record is not None and found.record.test != test:
            found.problem = f"it ran {found.record.test}, not {test}"
        measured[index] = found
        size = found.size(nproc)
        step_verdict, step_why = judge(size.gated_mib if size else None, found.why_no_figure(nproc))
        print(_line(str(tried), commit, size.gated_mib if size else None, step_verdict, step_why, width),
              flush=True)
        return step_verdict

    last_good, first_bad, skipped = search(len(commits), probe)
    print(f"gpumem bisect: {tried} commits measured besides GOOD and BAD")
    if skipped:
        span = [commits[i] for i in range(last_good + 1, first_bad + 1)]
        print(f"gpumem bisect: the skipped commits leave it ambiguous: the first bad commit is one of "
              f"{len(span)} commits after {(commits[last_good] if last_good >= 0 else good).short}:")
        for commit in span:
            print(f"  {commit.sha} {commit.subject}" + ("  (skipped)" if commits.index(commit) in skipped else ""))
        print(f"the first bad commit could be any of: {' '.join(c.short for c in span)}")
        return 1
    before = measured[last_good]
    after = measured[first_bad]
    old, new = before.size(nproc), after.size(nproc)
    assert old is not None and new is not None and old.gated_mib is not None and new.gated_mib is not None
    against = commits[last_good] if last_good >= 0 else good
    sites = site_lines(old, new)
    if sites:
        print(f"peak sites that grew at nproc={nproc} ({new.gated_label}) since {against.short}:")
        for line in sites[:10]:
            print(f"  {line}")
        if len(sites) > 10:
            print(f"  ... and {len(sites) - 10} more")
    else:
        print("peak sites: not recorded in these reports")
    print(last_line(commits[first_bad], good, good_size.gated_mib, new.gated_mib, nproc, new.gated_label))
    return 0


def last_line(first: Commit, good: Commit, reference: float, mib: float, nproc: int, label: str) -> str:
    """``first bad commit: <sha> <subject> (...)``: its growth over GOOD's figure, the figure its row of
    the table judged and printed."""
    return (f"first bad commit: {first.sha} {first.subject} ({growth_text(reference, mib)} at nproc={nproc}, "
            f"{label}: {shown(reference):.{DIGITS}f} -> {shown(mib):.{DIGITS}f} MiB since GOOD {good.short})")


def _check_selection(space: Workspace, good: Commit) -> str:
    """The pytest arguments must name exactly one test at GOOD (collected without launching anything)."""
    code, ids, last = space.collect(good)
    if code == 2:  # errors during collection: the revision, not the arguments
        raise BadInput(f"GOOD {good.short} is not good: the test does not collect there: {last}")
    if code != 0 or not ids:
        raise BadInput(f"the pytest arguments {' '.join(space.command)!r} select no test at GOOD {good.short} "
                       f"({last}): expected arguments naming one gpumem test, {EXAMPLE}")
    if len(ids) > 1:
        shown = ", ".join(ids[:5]) + (f" and {len(ids) - 5} more" if len(ids) > 5 else "")
        raise BadInput(f"the pytest arguments {' '.join(space.command)!r} select {len(ids)} tests at GOOD "
                       f"{good.short}: {shown}; expected exactly one gpumem test, {EXAMPLE}")
    return ids[0]
