"""A framework's own last word in a rank's output: the C++ check that aborted it.

A rank that OneFlow's or torch's C++ code aborts dies with a Python crash dump (``Fatal Python
error: Aborted`` and the frames it was in) whose tail is what a failure shows; the line that says why,
``transport.cpp:107] Check failed: stat->size >= msg.size (8 vs. 16)``, was printed before the dump
and fell out of the lines shown. It goes first, on the failure's first line.
"""

from __future__ import annotations

import re

# glog's fatal line (OneFlow; any library logging with glog): F<yyyymmdd> <time> <thread> <file:line>] <why>;
# c10's (torch, c10/util/Logging.cpp): [F<mmdd> <time> <file:line>] <why>. A line may begin with another
# process's unfinished output: the pattern is not anchored.
_FATAL_LOG = re.compile(r"\[?F\d{3,8} \d\d:\d\d:\d\d\.\d+\s+(?:\d+ )?(?:[\w./-]*/)?([\w.+-]+:\d+)\] (.+)")
# C++'s uncaught exception (torch's c10::Error, DistBackendError; any library's std:: exceptions)
_TERMINATE = re.compile(r"terminate called after throwing an instance of '([^']+)'\s*\n\s*what\(\):\s+(.+)")


def framework_message(output: str) -> str:
    """The first C++ fatal check or uncaught C++ exception in ``output``, on one line:
    ``transport.cpp:107: Check failed: ...``, ``c10::Error: CUDA error: ...``; "" where there is none."""
    found = [(m.start(), f"{m.group(1)}: {m.group(2).strip()}") for m in _FATAL_LOG.finditer(output)]
    found += [(m.start(), f"{m.group(1)}: {m.group(2).strip()}") for m in _TERMINATE.finditer(output)]
    return min(found)[1] if found else ""
