"""mkdocs hooks for the docs site (mkdocs.yml names this file; `make docs` builds the site).

Three jobs, so that the site is built from the repository as it is and cannot drift from it:

- the reference page's tables are written from the code: the marker arguments from
  ``pytest_gpumem.config.spec.MARKER_ARGUMENTS``, the options from ``pytest_gpumem.config.settings.OPTIONS``.
  They are committed in docs/reference.md too (``make reference`` rewrites them; a test checks they are
  current), so the page reads the same on the repository's page; the build writes them again;
- README.md becomes the site's home page and CHANGELOG.md its changelog page;
- a page's relative link to a repository file outside docs/ (a benchmark result, a script) is
  rewritten to a copy of that file in the site; a link to a file that does not exist is a warning,
  which ``mkdocs build --strict`` turns into a failure.

The Markdown of the tables is made by plain functions (no mkdocs import), so tests/test_readme.py
can check that every option and marker argument is in the reference.
"""

from __future__ import annotations

import logging
import posixpath
import re
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the docs venv builds from the checkout; the plugin is not installed there
    sys.path.insert(0, str(REPO))

# Pages made from files outside docs/: the page's path in the site -> the file in the repository.
OUTSIDE_PAGES = {"index.md": "README.md", "changelog.md": "CHANGELOG.md"}
_PAGE_OF = {source: page for page, source in OUTSIDE_PAGES.items()}
COPIED = "repository"  # where the site keeps copies of the repository files that pages link to
MARKER_TABLE = "<!-- generated: marker arguments -->"
OPTION_TABLE = "<!-- generated: options -->"
END_TABLE = "<!-- end of generated table: make reference -->"

_LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
log = logging.getLogger("mkdocs.hooks.gpumem")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def marker_table() -> str:
    """The marker's arguments as a Markdown table, from the one table the parser reads."""
    from pytest_gpumem.config.spec import MARKER_ARGUMENTS

    rows = ["| argument | default | accepted | what it does |", "| --- | --- | --- | --- |"]
    for arg in MARKER_ARGUMENTS:
        default = f"`{arg.default.strip('[]')}`" if arg.default.startswith("[") else f"`{arg.default}`"
        if arg.default.startswith("["):
            default = f"the ini setting {default}"
        rows.append(f"| `{arg.name}` | {default} | {_cell(arg.accepted)} | {_cell(arg.meaning)} |")
    return "\n".join(rows)


def option_table() -> str:
    """The session settings as a Markdown table, from the option table the plugin and the CLI read."""
    from pytest_gpumem.config.settings import OPTIONS

    rows = ["| setting | default | accepted | what it does |", "| --- | --- | --- | --- |"]
    for opt in OPTIONS:
        names = [f"`{opt.flag}`", f"`{opt.env}`" if opt.env else "", f"`{opt.ini}` (ini)"]
        if opt.const is not None:
            names[0] = f"`{opt.flag}` (takes no value: {opt.env}={opt.const})"
        rows.append(f"| {'<br>'.join(n for n in names if n)} | {_cell(opt.default_text)} | {_cell(opt.accepted)} "
                    f"| {_cell(opt.help)} |")
    return "\n".join(rows)


def with_tables(markdown: str) -> str:
    """The page with each generated table (from its start mark to ``END_TABLE``) written afresh."""
    for mark, table in ((MARKER_TABLE, marker_table), (OPTION_TABLE, option_table)):
        if mark not in markdown:
            continue
        before, after = markdown.split(mark, 1)
        old, found, rest = after.partition(END_TABLE)
        if not found or "<!-- generated:" in old:
            raise ValueError(f"docs/reference.md: {mark} has no {END_TABLE} after it")
        markdown = f"{before}{mark}\n{table()}\n{END_TABLE}{rest}"
    return markdown


def _source(src_uri: str) -> str:
    """The repository path of the Markdown a site page is built from."""
    return OUTSIDE_PAGES.get(src_uri, f"docs/{src_uri}")


def repository_links(markdown: str, source: str) -> dict[str, str]:
    """Relative links of a page (outside code) -> the repository path they lead to, anchors dropped."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", markdown))
    found = {}
    for match in _LINK.finditer(text):
        link = match.group(2)
        if re.match(r"^[a-z]+:", link) or link.startswith("#"):
            continue
        path = posixpath.normpath(posixpath.join(posixpath.dirname(source), link.partition("#")[0]))
        found[link] = path
    return found


# ---------------------------------------------------------------------------------------------
# The hooks (mkdocs calls these by name)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    for page, source in OUTSIDE_PAGES.items():
        if (REPO / source).exists():
            files.append(File.generated(config, page, content=(REPO / source).read_text()))
    copied: set[str] = set()
    for file in list(files):
        if not file.src_uri.endswith(".md"):
            continue
        source = _source(file.src_uri)
        markdown = (REPO / source).read_text()
        for link, path in repository_links(markdown, source).items():
            if path.startswith("docs/") or path in _PAGE_OF or path in copied:
                continue
            if path.startswith("../") or not (REPO / path).is_file():
                continue  # left as it is: mkdocs warns about the page's broken link
            copied.add(path)
            files.append(File.generated(config, f"{COPIED}/{path}", abs_src_path=str(REPO / path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    markdown = with_tables(markdown)
    source = _source(page.file.src_uri)
    here = posixpath.dirname(page.file.src_uri)
    for link, path in repository_links(markdown, source).items():
        anchor = link.partition("#")[2]
        if path in _PAGE_OF:
            target = posixpath.relpath(_PAGE_OF[path], here or ".")
        elif path.startswith("docs/"):
            target = posixpath.relpath(path[len("docs/"):], here or ".")
        elif (REPO / path).is_file() and not path.startswith("../"):
            target = posixpath.relpath(f"{COPIED}/{path}", here or ".")
        else:
            log.warning("%s links to %s, which is not in the repository", source, link)
            continue
        new = target + (f"#{anchor}" if anchor else "")
        if new != link:
            markdown = _LINK.sub(lambda m: m.group(1) + new + m.group(3) if m.group(2) == link else m.group(0),
                                 markdown)
    return markdown


if __name__ == "__main__":  # `make reference`: rewrite the committed tables of docs/reference.md
    page = REPO / "docs" / "reference.md"
    page.write_text(with_tables(page.read_text()))
