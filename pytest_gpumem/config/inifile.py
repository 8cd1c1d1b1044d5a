"""The rootdir and ini values pytest would use, found without importing pytest (for ``gpumem show``).

Mirrors pytest's own search when it is given no paths: from the current directory upward, the
first ``pytest.ini``, ``.pytest.ini``, ``pyproject.toml`` with ``[tool.pytest.ini_options]`` (or
pytest 9's ``[tool.pytest]``), ``tox.ini`` with ``[pytest]`` or ``setup.cfg`` with
``[tool:pytest]`` is the ini file and its folder the rootdir. Without one, the rootdir is the
nearest folder holding a ``pyproject.toml``, else one holding ``setup.py``, else the start folder.
"""

from __future__ import annotations

import configparser
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli below 3.11
    import tomli as tomllib

INI_NAMES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")


class IniError(ValueError):
    """An ini file that cannot be read; the message names the file."""


@dataclass(frozen=True)
class IniSetup:
    rootdir: Path
    inipath: Path | None = None
    values: dict[str, str] = field(default_factory=dict)


def _text(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(map(str, value))
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def read_ini(path: Path) -> dict[str, str] | None:
    """The pytest section of ``path``, or None when the file has none (it is then not an ini file)."""
    try:
        if path.suffix == ".toml":
            doc = tomllib.loads(path.read_text())
            tool = doc.get("tool", {}).get("pytest")
            if not isinstance(tool, dict):
                return None
            table = tool.get("ini_options", tool)
            return {str(k): _text(v) for k, v in table.items() if not isinstance(v, dict)}
        parser = configparser.ConfigParser(interpolation=None)
        parser.read_string(path.read_text(), source=str(path))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, configparser.Error) as exc:
        raise IniError(f"{path}: cannot read it as pytest would: {exc}") from None
    section = "tool:pytest" if path.name == "setup.cfg" else "pytest"
    if parser.has_section(section):
        return {k: v.strip() for k, v in parser.items(section)}
    return {} if path.name in ("pytest.ini", ".pytest.ini") else None  # these count even when empty


def find(start: Path, rootdir: Path | None = None) -> IniSetup:
    """The ini file and rootdir for a pytest run started in ``start`` with no paths given."""
    start = start.resolve()
    for folder in (start, *start.parents):
        for name in INI_NAMES:
            path = folder / name
            if path.is_file():
                values = read_ini(path)
                if values is not None:
                    return IniSetup(rootdir.resolve() if rootdir else folder, path, values)
    if rootdir is not None:
        return IniSetup(rootdir.resolve())
    for marker in ("pyproject.toml", "setup.py"):
        for folder in (start, *start.parents):
            if (folder / marker).is_file():
                return IniSetup(folder)
    return IniSetup(start)
