"""The README and docs/ as a newcomer meets them: every link leads somewhere, in the repository and in
a built sdist, and the examples of "Writing a gpumem test" run as written."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import processes_tagged

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# [text](target) and ![alt](target), outside code spans and fenced blocks
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def links(page: Path) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text()))
    return _LINK.findall(text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def relative_targets() -> list[tuple[Path, str, Path, str]]:
    """(page, link, the target's path in the repository, its anchor) for every relative link."""
    found = []
    for page in PAGES:
        for link in links(page):
            if re.match(r"^[a-z]+:", link) or link.startswith("#"):
                continue
            path, _, anchor = link.partition("#")
            found.append((page, link, (page.parent / path).resolve(), anchor))
    return found


def test_the_pages_have_links_to_check():
    assert len(relative_targets()) >= 10 and any(p.name == "README.md" for p, *_ in relative_targets())


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_link_points_at_the_projects_own_web_address(page: Path):
    """The project's files are linked relatively: a URL of a repository that may not exist (or a
    fork's) breaks in a clone, an sdist and a mirror alike."""
    own = [link for link in links(page) if "github.com/pytest-gpumem" in link]
    assert own == [], f"{page.name}: use a relative link instead of {own}"


def test_every_relative_link_resolves_in_the_repository():
    broken = [f"{page.relative_to(REPO)}: {link}" for page, link, target, anchor in relative_targets()
              if not target.exists() or (anchor and target.suffix == ".md" and anchor not in anchors(target))]
    assert broken == []


@pytest.mark.slow
def test_every_relative_link_resolves_in_a_built_sdist(tmp_path: Path):
    pytest.importorskip("build")
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs the git checkout (its file list is what an sdist is built from)")
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split()
    tree = tmp_path / "tree"
    for name in listed:  # a clean copy: the build writes its egg-info there, not into the checkout
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(tmp_path / "dist"),
                    str(tree)], check=True, capture_output=True, timeout=300)
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    missing = [f"{page.relative_to(REPO)}: {link}" for page, link, target, _ in relative_targets()
               if target.relative_to(REPO).as_posix() not in names
               and not any(n.startswith(target.relative_to(REPO).as_posix() + "/") for n in names)]
    assert missing == [], f"not in {sdist.name}: {missing}"


# ---------------------------------------------------------------------------------------------
# The examples of "Writing a gpumem test", run as a newcomer would copy them


def readme_example(name: str) -> str:
    text = (REPO / "README.md").read_text()
    after = text.split(f"<!-- example: {name} -->", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_readme_torch_example_runs_as_written(pytester: pytest.Pytester, launch_tag: str):
    pytester.makepyfile(test_readme_torch=readme_example("torch"))
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert processes_tagged(launch_tag) == []


@pytest.mark.slow
@pytest.mark.oneflow
@pytest.mark.skipif(importlib.util.find_spec("oneflow") is None, reason="needs OneFlow")
def test_the_readme_oneflow_example_runs_as_written(pytester: pytest.Pytester, launch_tag: str):
    pytester.makepyfile(test_readme_oneflow=readme_example("oneflow"))
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=1)
    assert processes_tagged(launch_tag) == []
