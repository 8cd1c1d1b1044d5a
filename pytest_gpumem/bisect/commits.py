"""The commits ``gpumem bisect`` searches: GOOD and BAD resolved, the first-parent history between them.

Every git command runs with hooks off; a failed one raises RuntimeError with git's message.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


class BadInput(Exception):
    """Exit 2: the message says what was given and what is accepted."""


def git(repo: Path, *args: str, check: bool = True) -> str:
    done = subprocess.run(["git", "-c", "core.hooksPath=/dev/null", "-C", str(repo), *args],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if check and done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {done.stderr.strip()}")
    return done.stdout.strip() if done.returncode == 0 else ""


@dataclass(frozen=True)
class Commit:
    sha: str
    subject: str

    @property
    def short(self) -> str:
        return self.sha[:10]


def resolve_commit(repo: Path, rev: str, name: str) -> Commit:
    sha = git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}", check=False)
    if not sha:
        raise BadInput(f"{name} {rev!r} is not a commit of {repo}: expected a commit, branch, tag or "
                       f"revision such as HEAD~5")
    return Commit(sha, git(repo, "log", "-1", "--format=%s", sha))


def between(repo: Path, good: Commit, bad: Commit) -> list[Commit]:
    """BAD's first-parent history after GOOD, oldest first and BAD last, less the commits that do not
    contain GOOD (those before the merge of a GOOD on a side branch)."""
    descendants = set(git(repo, "rev-list", "--ancestry-path", f"{good.sha}..{bad.sha}").split())
    out = git(repo, "rev-list", "--first-parent", "--reverse", "--format=%H %s", f"{good.sha}..{bad.sha}")
    commits = []
    for line in out.splitlines():
        sha, _, subject = line.partition(" ")
        if sha != "commit" and sha in descendants:
            commits.append(Commit(sha, subject))
    return commits


def is_ancestor(repo: Path, older: Commit, newer: Commit) -> bool:
    return subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", older.sha, newer.sha],
                          capture_output=True).returncode == 0
