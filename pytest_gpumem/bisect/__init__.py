"""``gpumem bisect``: the first commit at which a gpumem test's gated figure grew past the tolerance.

    gpumem bisect GOOD BAD [--nproc N] [--tolerance TOL] -- <pytest args naming one test>
    gpumem bisect GOOD BAD [--nproc N] [--tolerance TOL] -- measure [options] -- PROGRAM ...

GOOD is measured first: its gated figure at the failing size is the reference, and the tolerance
is the test's own as its report records it (``--tolerance`` overrides). BAD must then be more than
the tolerance above it. The commits between them (BAD's first-parent history, from the first one
that contains GOOD) are searched by halving: a commit more than the tolerance above GOOD's figure is bad, one within
it good, and one whose test does not collect, errors or does not measure that size is skipped (a
neighbour is tried instead, as ``git bisect skip`` does). Every commit tried is printed with its
figure and verdict; the last line names the first bad commit.

Why a search of our own rather than ``git bisect run``: the verdict needs GOOD's figure and the
step's report, which a ``bisect run`` script would have to carry between processes; git's search
leaves state (refs, BISECT_LOG) that an interrupted run must reset; and skipping "the nearest
neighbour" is deterministic here, so a test can count the steps.

Nothing of the user's checkout is touched: each step checks the commit out in one temporary
``git worktree`` (hooks off) under a private temporary folder, with the report and the baselines
folder in that folder (``--gpumem-missing-baseline=ignore``). The measuring pytest or ``gpumem
measure`` runs in a fresh interpreter, in a session of its own bound to die with us; on Ctrl-C,
SIGTERM or SIGHUP it is interrupted (its launch kills its ranks), then killed if it lingers, and
the worktree and the folder are removed before we exit. The plugin that measures is the one
installed here: a ``sitecustomize`` in the temporary folder loads this very ``pytest_gpumem``
before the checked-out tree is on ``sys.path``, in pytest and in every rank, so a revision that
holds its own ``pytest_gpumem`` only provides the project under test.

Exit 0: found; 1: not found (the skipped commits leave it ambiguous); 2: bad input, GOOD not
good, BAD not bad; 130/143: interrupted.
"""

from .command import main

__all__ = ["main"]
