"""``gpumem measure``: an existing launch at several world sizes, and its per-rank scaling table.

    gpumem measure --nproc 1,2,4 [--launcher L] [--device D] [--timeout S] [--max-nproc N]
                   [--fake-gpu auto|on|off] [--fake-gpu-model M] [--report F.json] [--markdown F.md]
                   -- train_net.py --config-file gpt2.py

No pytest: a script-mode :class:`Spec` (``script=``/``module=``, ``args=``) goes through the same
:class:`TestDriver` as a test, so the numbers, the timeout, the temporary folder and the killing of
every process are the test's own; sizes above the cap are predicted as in a test. The report and
the Markdown are the plugin's formats (``gpumem diff`` reads the report). Unset options come from
``GPUMEM_*`` and the ini file, as in a test session. Exit 0 when every launch
succeeded, 1 when one failed (its output is printed), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .config import inifile
from .config.settings import OPTIONS, SettingsError, option, resolve
from .config.spec import SpecError, parse_marker
from .session import preflight

USAGE = "gpumem measure --nproc 1,2,4 [options] -- SCRIPT.py [ARGS ...] | -m MODULE [ARGS ...]"
_PYTHON = re.compile(r"^python[\d.]*$")


def _validated(name: str) -> Callable[[str], str]:
    """An argparse type that checks a value the way the plugin's setting does, and keeps the text."""
    opt = option(name)

    def check(text: str) -> str:
        try:
            opt.parse(text)
        except (ValueError, TypeError):
            raise argparse.ArgumentTypeError(f"{text!r} is not accepted: expected {opt.accepted}") from None
        return text

    return check


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not accepted: expected world sizes separated by commas, e.g. 1,2,4") from None


def _rank(text: str) -> int | str:
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not accepted: expected an int >= 0 or all") from None


def _setting_argument(parser: argparse.ArgumentParser, name: str, lead: str) -> None:
    """``--NAME``, one of the plugin's settings: checked, accepted and defaulted as its option declares."""
    opt = option(name)
    parser.add_argument("--" + name.replace("_", "-"), type=_validated(name),
                        help=f"{lead}: {opt.accepted} (default: ${opt.env} or {opt.default_text})")


def measure_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpumem measure", usage=USAGE,
        description="Run an existing launch at each world size and print every rank's peak memory.",
        epilog="Everything after -- is the program: a Python script (relative to the current folder) "
               "or -m MODULE, with its own arguments. The ranks run it with this interpreter.")
    p.add_argument("--nproc", type=_sizes, required=True, help="world sizes, e.g. 1,2,4 (larger than "
                   "--max-nproc: predicted from the launched sizes)")
    for name, lead in (("launcher", "how the ranks start"), ("device", "memory that is reported"),
                       ("timeout", "seconds for each launch"), ("max_nproc", "largest world size launched"),
                       ("fake_gpu", "with --device gpu, a fake GPU"),
                       ("fake_gpu_model", "the GPU model a fake GPU emulates")):
        _setting_argument(p, name, lead)
    p.add_argument("--no-predict", action="store_true", help="fail instead of predicting sizes above the cap")
    p.add_argument("--rank", type=_rank, default=0, help="the rank whose peak is the ratio's and the "
                   "prediction's subject: an int or all (default 0)")
    p.add_argument("--report", type=Path, help="write the JSON report here (the plugin's format)")
    p.add_argument("--markdown", type=Path, help="write a Markdown summary here")
    p.add_argument("--plots", type=Path, help="write a memory-over-time PNG into this folder (needs matplotlib)")
    return p


def _program(command: Sequence[str], cwd: Path) -> dict[str, Any]:
    """``script=``/``module=`` and ``args=`` of the Spec, or ValueError naming what is wrong."""
    if not command:
        raise ValueError(f"the program is missing: expected it after --, e.g. {USAGE}")
    first = command[0]
    if first == "-m":
        if len(command) < 2:
            raise ValueError("-m needs a module name: -m MODULE [ARGS ...]")
        return {"module": command[1], "args": list(command[2:])}
    if _PYTHON.match(Path(first).name):
        raise ValueError(f"the program starts at {first!r}: start it at the script (the ranks run it with "
                         f"this interpreter), e.g. -- train_net.py --steps 3")
    if not (cwd / first).is_file():
        raise ValueError(f"the program {first!r} is not a file under {cwd}: expected a Python script "
                         f"or -m MODULE")
    return {"script": first, "args": list(command[1:])}


def _fail(message: str) -> int:
    print(f"gpumem measure: {message}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    options, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = measure_parser().parse_args(options)  # exits 2 naming the argument on a bad value
    cwd = Path.cwd()
    try:
        program = _program(command, cwd)
    except ValueError as exc:
        return _fail(str(exc))
    given = {"launcher": args.launcher, "device": args.device, "timeout": args.timeout,
             "max_nproc": args.max_nproc, "predict": "0" if args.no_predict else None,
             "fake_gpu": args.fake_gpu, "fake_gpu_model": args.fake_gpu_model}
    try:  # unset options come from GPUMEM_*, then the ini file pytest would use here, as the plugin's
        setup = inifile.find(cwd)
        settings = resolve(given, os.environ, {o.name: setup.values.get(o.ini) for o in OPTIONS},
                           rootdir=setup.rootdir, enabled=True, refresh=False)
    except (inifile.IniError, SettingsError) as exc:
        return _fail(str(exc))
    from .launching.launchers import registered

    try:
        spec = parse_marker((), {"nproc": list(args.nproc), "rank": args.rank, "max_ratio": None,
                                 "launcher": settings.launcher, "device": settings.device,
                                 "timeout": settings.timeout, **program},
                            settings.defaults(tuple(registered())))  # the installed packages' launchers too
    except SpecError as exc:
        name = str(exc).split("=", 1)[0]
        return _fail(f"argument --{name.replace('_', '-')}: {exc}" if name.isidentifier() else str(exc))
    for name in ("report", "markdown"):
        path = getattr(args, name)
        if path is not None and not _writable(path.parent):
            return _fail(f"argument --{name}: cannot write {str(path)!r}: expected a writable path")
    problem = preflight(settings, fake_gpu=spec.device == "gpu" and spec.fake_gpu != "off",
                        plots=args.plots is not None,
                        names={"fake_gpu_model": "argument --fake-gpu-model", "plots": "argument --plots"})
    if problem is not None:
        return _fail(problem)
    return _measure(spec, settings, args, " ".join(command))


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK)


def _measure(spec: Any, settings: Any, args: argparse.Namespace, command: str) -> int:
    from . import session
    from .judging.gate import measured
    from .judging.record import report_document
    from .launching import scaling
    from .presentation import outputs
    from .presentation.report import scaling_table

    built = session.Session.from_settings(settings, rootdir=Path.cwd(), cwd=Path.cwd(), rank_pytest_args=_no_pytest)
    rec, failures = measured(scaling.run(built.driver, command, spec, built.capacity))
    for line in scaling_table(rec):
        print(line)
    if args.report is not None:
        args.report.write_text(json.dumps(report_document([rec]), indent=2) + "\n")
    if args.markdown is not None:
        args.markdown.write_text(outputs.markdown([rec]))
    if args.plots is not None:
        from .presentation import plots

        plots.plot_all([rec], args.plots)
    if rec.status in ("passed", "measured"):
        return 0
    for message in failures:
        print(f"gpumem measure: {message}", file=sys.stderr)
    return 1


def _no_pytest(test_id: str) -> list[str]:
    raise AssertionError("gpumem measure launches programs, never a test body")
