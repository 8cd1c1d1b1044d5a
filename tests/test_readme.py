"""The README, the changelog and docs/ as a newcomer meets them: a README that fits a screen, every link
leads somewhere (in the repository, in a built sdist, and on the docs site: `make docs` builds it with
--strict), a reference that lists every option and marker argument, and the examples of
docs/writing-tests.md run as written."""

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
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
README_LIMIT = 8000  # bytes: the two-minute read; the rest is on the docs site
DOCS_LIMIT = 103_000  # bytes over docs/*.md: pages that say what is true now, the history left to the CHANGELOG
# (raised from 100_000 with issues 54, 55 and 57: the fake GPU's value policy, the hosted-runner workflow, eager boxing)
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


def docs_hooks():
    """tools/docs/hooks.py, the mkdocs hooks that write the reference tables (loaded without mkdocs)."""
    spec = importlib.util.spec_from_file_location("gpumem_docs_hooks", REPO / "tools" / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_fits_a_screen_and_names_the_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) <= README_LIMIT
    assert "make demo" in text and "make test" in text


def test_the_docs_stay_within_their_size():
    """Issue 37 found 210 KB of docs, mostly the history of measurements; what grows past the limit
    is a sentence that belongs in the CHANGELOG or benchmarks/results, or one the linked page says."""
    sizes = {page.name: len(page.read_bytes()) for page in (REPO / "docs").glob("*.md")}
    assert sum(sizes.values()) <= DOCS_LIMIT, sorted(sizes.items(), key=lambda item: -item[1])[:5]


def test_the_readmes_demo_table_reads_the_committed_baselines():
    """Each row's baseline column is what baselines/examples holds for that test and size (issue 37:
    the table read 297.0 MiB against a baseline of 289.1 recorded before two refinements)."""
    import json

    rows = re.findall(r"^(examples/[\w.]+)::(\w+)\s+(\d+)\s+([\d.]+) \(rank 0\).*?\s([\d.]+)\s+cpu\s",
                      (REPO / "README.md").read_text(), re.M)
    assert len(rows) >= 8, rows
    for path, test, nproc, peak, shown in rows:
        stored = json.loads((REPO / "baselines" / f"{path}.json").read_text())["tests"][test]["cpu:x86_64"][nproc]
        assert float(shown) == pytest.approx(stored["gated_mib"], abs=0.05), (path, test, nproc)
        assert abs(float(peak) - stored["gated_mib"]) <= 1.0, f"{test} at {nproc}: not the run that recorded it"


def test_every_docs_page_is_in_the_sites_navigation():
    nav = (REPO / "mkdocs.yml").read_text().split("\nnav:\n", 1)[1]
    listed = set(re.findall(r":\s*([\w-]+\.md)\s*$", nav, re.M))
    pages = {p.name for p in (REPO / "docs").glob("*.md")} | set(docs_hooks().OUTSIDE_PAGES)
    assert pages == listed


def test_the_reference_lists_every_option_and_marker_argument(pytester: pytest.Pytester):
    """The tables are written from the code; every flag pytest knows of is on the page."""
    from pytest_gpumem.config.settings import OPTIONS
    from pytest_gpumem.config.spec import MARKER_ARGUMENTS

    hooks = docs_hooks()
    rendered = (REPO / "docs" / "reference.md").read_text()
    assert hooks.MARKER_TABLE in rendered and hooks.OPTION_TABLE in rendered
    for argument in MARKER_ARGUMENTS:
        assert f"| `{argument.name}` |" in rendered
    for option in OPTIONS:
        assert all(f"`{name}`" in rendered for name in (option.flag, option.env, option.ini) if name)
    flags = set(re.findall(r"(--gpumem[\w-]*)", "\n".join(pytester.runpytest("--help").outlines)))
    assert len(flags) > len(OPTIONS) and [f for f in sorted(flags) if f"`{f}`" not in rendered] == []


def test_the_reference_pages_committed_tables_are_the_codes(tmp_path: Path):
    """docs/reference.md holds the tables as the code writes them (the repository's page shows them);
    a table edited by hand, or left behind by a new argument, is a failure that names the fix."""
    hooks = docs_hooks()
    page = (REPO / "docs" / "reference.md").read_text()
    assert hooks.with_tables(page) == page, "docs/reference.md's tables are not current: run `make reference`"
    stale = page.replace("| `nproc` |", "| `nprocs` |", 1)
    assert stale != page and hooks.with_tables(stale) == page
    with pytest.raises(ValueError, match="has no <!-- end of generated table"):
        hooks.with_tables(page.replace(hooks.END_TABLE, "", 1))


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
# The examples of docs/writing-tests.md, run as a newcomer would copy them


def documented_example(name: str) -> str:
    text = (REPO / "docs" / "writing-tests.md").read_text()
    after = text.split(f"<!-- example: {name} -->", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_documented_torch_example_runs_as_written(pytester: pytest.Pytester, launch_tag: str):
    pytester.makepyfile(test_readme_torch=documented_example("torch"))
    result = pytester.runpytest("--gpumem", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert processes_tagged(launch_tag) == []


@pytest.mark.slow
@pytest.mark.oneflow
@pytest.mark.skipif(importlib.util.find_spec("oneflow") is None, reason="needs OneFlow")
def test_the_documented_oneflow_example_runs_as_written(pytester: pytest.Pytester, launch_tag: str):
    pytester.makepyfile(test_readme_oneflow=documented_example("oneflow"))
    result = pytester.runpytest_subprocess("--gpumem", "-p", "no:cacheprovider", timeout=300)
    result.assert_outcomes(passed=1)
    assert processes_tagged(launch_tag) == []


def test_the_readmes_install_line_installs_the_plugin_in_a_fresh_venv_and_a_gpumem_test_runs(tmp_path: Path):
    """The README's first install line, as written, from the checkout, in a venv with nothing in it;
    then a newcomer's first gpumem test (host memory: no framework needed)."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Install", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    line = next(raw.split("#")[0].strip() for raw in block.splitlines() if raw.startswith("pip install"))
    assert line == "pip install ."
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    done = subprocess.run([str(python), "-m", *line.split()], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_first.py").write_text(
        "import pytest\n\n\n@pytest.mark.gpumem(nproc=[1, 2], device='cpu', max_mib=500)\n"
        "def test_first():\n    buffer = bytearray(64 * 2**20)\n")
    run = subprocess.run([str(python), "-m", "pytest", "--gpumem", "-p", "no:cacheprovider", "test_first.py"],
                         cwd=project, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    row = re.search(r"test_first\.py::test_first\s+2\s+(\d+\.\d) \(rank 0\)", run.stdout)
    assert row is not None and 64.0 <= float(row.group(1)) < 128.0, run.stdout[-3000:]  # the 64 MiB it holds


def documented_markers() -> list[tuple[str, str, tuple, dict]]:
    """(page, the marker's source, its positional and keyword arguments) of every gpumem marker in the
    pages' Python blocks; a block that is not whole Python (an excerpt with ...) is read line by line."""
    import ast

    found = []
    for page in PAGES:
        for block in re.findall(r"^```python\n(.*?)^```", page.read_text(), re.S | re.M):
            try:
                trees = [ast.parse(block)]
            except SyntaxError:
                trees = [ast.parse(m) for m in re.findall(r"@(?:pytest\.mark\.)?gpumem\(.*?\)\n(?=\s*(?:@|def))",
                                                          block, re.S)]
            for tree in trees:
                for node in ast.walk(tree):
                    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("pytest.mark.gpumem", "gpumem"):
                        args = tuple(ast.literal_eval(a) for a in node.args)
                        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
                        found.append((page.relative_to(REPO).as_posix(), ast.unparse(node), args, kwargs))
    return found


def test_every_marker_the_docs_show_is_accepted_as_written():
    """A newcomer copies the pages' markers: each one parses (the argument names and values exist),
    and the simulation page's own example asks for what it says."""
    from pytest_gpumem.config.spec import Defaults, SpecError, parse_marker

    markers = documented_markers()
    assert len(markers) >= 8
    refused = []
    for page, source, args, kwargs in markers:
        try:
            parse_marker(args, kwargs, Defaults())
        except SpecError as err:
            refused.append(f"{page}: {source}: {err}")
    assert refused == []
    simulation = [kwargs for page, _, _, kwargs in markers if page == "docs/simulation.md"]
    assert {"auto", "on"} <= {k.get("simulate", "auto") for k in simulation[:2]}


def test_the_built_site_opens_from_disk_with_its_search_and_fetches_nothing():
    """`make docs` (run before the tests by `make test`) builds a site that works from file://: pages
    are files (no folder URLs), the search index is a script, the Web Worker shim is the site's own,
    and no page loads a script, font or style sheet from the network."""
    site = REPO / "site"
    if not (site / "index.html").exists():
        pytest.skip("the site is not built here: `make docs` builds it (make test does first)")
    assert (site / "search" / "search_index.js").read_text().startswith("var __index = ")
    pages = sorted(site.glob("*.html"))
    assert len(pages) >= 15 and (site / "reference.html").exists()
    remote = []
    for page in pages:
        html = page.read_text()
        remote += [f"{page.name}: {url}" for url in re.findall(r'(?:src|href)="(https?://[^"]+)"', html)
                   if re.search(r"\.(js|css|woff2?)\b|fonts\.|unpkg|cdn", url)]
        if page.name != "404.html":
            assert "javascripts/iframe-worker-shim.js" in html, page.name
    assert remote == []
