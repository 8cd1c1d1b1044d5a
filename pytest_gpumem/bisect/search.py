"""The search of ``gpumem bisect``: halving over commits, each judged against GOOD's figure, and the
peak sites that grew at the first bad one. No git, no processes: a probe says what a commit is.

Every MiB figure of one bisect's output is rounded once, to :data:`DIGITS` decimals, and a growth is
the difference of two rounded figures, so ``473.4 -> 537.6`` always reads ``+64.2`` wherever it
appears (the table and the last line judge against the same reference, GOOD's figure).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

from ..config.spec import Tolerance
from ..judging.growth import site_growth
from ..judging.record import SizeRecord
from ..judging.verdict import against_reference

StepVerdict = Literal["good", "bad", "skip"]
DIGITS = 1  # decimals of every MiB figure a bisect prints


def shown(mib: float) -> float:
    """A figure as printed: rounded once, so that differences of printed figures add up."""
    return round(mib, DIGITS)


def growth_text(old: float, new: float) -> str:
    """``+64.2 MiB``: the growth from ``old`` to ``new`` as their printed figures read."""
    return f"{shown(new) - shown(old):+.{DIGITS}f} MiB"


def search(count: int, probe: Callable[[int], StepVerdict]) -> tuple[int, int, list[int]]:
    """Halving over commits ``0 .. count-1`` (oldest first), where -1 (GOOD) is good and
    ``count - 1`` (BAD) is bad; ``probe(i)`` says ``good``, ``bad`` or ``skip``.

    Returns ``(last good, first bad, skipped between them)``: with no skipped commit between, the
    first bad commit is ``first bad``; otherwise it is one of the skipped ones or ``first bad``.
    A skipped middle is replaced by its nearest untried neighbour, the later one on a tie.
    """
    good, bad, skipped = -1, count - 1, set[int]()
    while True:
        left = [i for i in range(good + 1, bad) if i not in skipped]
        if not left:
            return good, bad, sorted(i for i in skipped if good < i < bad)
        middle = (good + bad) // 2
        pick = min(left, key=lambda i: (abs(i - middle), -i))
        verdict = probe(pick)
        if verdict == "good":
            good = pick
        elif verdict == "bad":
            bad = pick
        else:
            skipped.add(pick)


@dataclass
class Judge:
    """A step's verdict: its gated figure at ``nproc`` against GOOD's (``reference``) and the tolerance."""

    nproc: int
    reference: float
    tolerance: Tolerance

    def __call__(self, gated_mib: float | None, why_none: str) -> tuple[StepVerdict, str]:
        """(verdict, why); ``why_none`` says why a step without a figure is skipped."""
        if gated_mib is None:
            return "skip", why_none
        kind, allowance = against_reference(gated_mib, self.reference, self.tolerance)
        growth = growth_text(self.reference, gated_mib)
        if kind == "regression":
            return "bad", f"{growth}, over the +{allowance:.{DIGITS}f} allowed"
        return "good", f"{growth}, within +{allowance:.{DIGITS}f}"


# ---------------------------------------------------------------------------------------------- peak sites


def site_lines(good: SizeRecord, bad: SizeRecord) -> list[str]:
    """The peak sites of the gated rank that grew from ``good`` to ``bad`` (or are new), largest
    first, by the rule a failing test uses (judging/growth.py): ``+256.0 MiB  examples/x.py:57
    train_step (all_gather)``, then one line summing what is not listed.

    The rank is the bad side's gated rank (0 when it names none). [] when either side has no
    sites there (a run that did not record them).
    """
    rank = bad.gated_rank if bad.gated_rank is not None else 0
    before, after = good.measured.sites.get(rank), bad.measured.sites.get(rank)
    if before is None or not after:
        return []
    return site_growth(before, after, "the last good commit").lines()
