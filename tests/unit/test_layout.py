"""The package's layering, enforced: each subpackage imports only the layers below it, and only the
pytest glue imports pytest (ruff's banned-import rule covers the latter for the package).

    config        what the user asks for (marker, settings, ini)
    sampling      the samplers: memray in the rank, RSS and NVML from the parent, host identity
    oneflow       OneFlow-only code (boxing audit, rendezvous)
    rankside      what runs inside a rank, and the files it exchanges with its parent
    results       what a size measured (SizeResult, its gated reading), or what was predicted of it
    launching     the parent side of a launch, which hands its measurements to judging's types
    judging       one test's run -> its outcome (the gate): verdicts, baselines, the typed record
    presentation  renderers of the record
    top level     plugin (pytest glue), session (the machinery, built once from the settings), cli,
                  measure and bisect (commands; bisect is a package: its search, its commits, its
                  worktree steps, the command)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pytest_gpumem"
LAYERS = ["storage", "config", "sampling", "oneflow", "rankside", "results", "launching", "judging", "presentation"]
TOP = {"plugin", "hookspecs", "session", "cli", "measure", "bisect", "calibrate"}
COMMAND_PACKAGES = {"bisect"}  # top-level commands that are packages: they may use every layer
# Imports that reach up a layer on purpose, each with its reason.
ALLOWED_UP: set[tuple[str, str]] = set()


def _imports(path: Path) -> set[str]:
    """The pytest_gpumem subpackages a module imports, type-checking-only imports included."""
    found = set()
    own = path.relative_to(PACKAGE).parts
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = list(own[:-1])[: len(own) - node.level] if node.level > 1 else list(own[:-1])
                parts = base + (node.module.split(".") if node.module else [])
                if not parts:  # from . import x (in a top-level module): x is the subpackage
                    found.update(alias.name for alias in node.names)
                    continue
            elif node.module and node.module.startswith("pytest_gpumem."):
                parts = node.module.split(".")[1:]
            else:
                continue
            found.add(parts[0])
        elif isinstance(node, ast.Import):
            found.update(alias.name.split(".")[1] for alias in node.names
                         if alias.name.startswith("pytest_gpumem."))
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py")
                 if p.parent != PACKAGE and p.relative_to(PACKAGE).parts[0] not in COMMAND_PACKAGES)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_layer_imports_only_the_layers_below_it(path: Path):
    layer = path.relative_to(PACKAGE).parts[0]
    below = set(LAYERS[: LAYERS.index(layer) + 1])
    up = {target for target in _imports(path) & set(LAYERS) if target not in below}
    assert up <= {target for source, target in ALLOWED_UP if source == layer}, (
        f"{path.relative_to(PACKAGE)} imports {sorted(up)}, above its layer {layer!r}: "
        f"move the shared code down, or pass it in")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports(path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports, anywhere in it (functions and type checks too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                found.add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return (found & known) - {name}


def test_no_module_of_the_package_imports_itself_through_others():
    """No import cycle, lazy imports included: a cycle means two modules that are one job, or a
    type in the wrong one (record <-> growth was one)."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: _module_imports(path, set(paths)) for name, path in paths.items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            cycle = trail[trail.index(name):] + [name]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if name in done:
            return
        for target in sorted(graph[name]):
            visit(target, trail + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])


def test_nothing_below_the_top_level_imports_it():
    for path in MODULES:
        top = _imports(path) & TOP
        assert not top, f"{path.relative_to(PACKAGE)} imports the top-level module(s) {sorted(top)}"


def test_the_top_level_holds_only_the_entry_points():
    assert {p.stem for p in PACKAGE.glob("*.py")} | COMMAND_PACKAGES == TOP | {"__init__"}


def test_the_layer_list_names_every_subpackage():
    assert sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()) == sorted(
        LAYERS + sorted(COMMAND_PACKAGES))


@pytest.mark.parametrize("name", sorted(COMMAND_PACKAGES))
def test_a_command_package_imports_no_other_top_level_module(name: str):
    for path in (PACKAGE / name).rglob("*.py"):
        assert not _imports(path) & (TOP - {name}), f"{path.relative_to(PACKAGE)} imports a top-level module"


def test_only_the_cli_imports_the_commands():
    assert {"measure", "bisect"} <= _imports(PACKAGE / "cli.py")
    for path in PACKAGE.glob("*.py"):
        if path.stem != "cli":
            assert not _imports(path) & {"measure", "bisect"}, f"{path.name} imports a command module"
    for path in PACKAGE.rglob("*.py"):
        if path.parent != PACKAGE and path.relative_to(PACKAGE).parts[0] not in COMMAND_PACKAGES:
            assert not _imports(path) & {"measure", "bisect"}, f"{path.name} imports a command module"


def test_no_two_public_functions_or_classes_share_a_name():
    """One name per idea (issue 37): a reader who meets ``site_growth`` knows which one it is. ``main``
    is the exception: each command module's entry point, as Python's ``python -m`` convention has it."""
    seen: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            public = not getattr(node, "name", "_").startswith("_")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and public:
                seen.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    shared = {name: where for name, where in seen.items() if len(where) > 1 and name != "main"}
    assert shared == {}, "rename one of each: " + "; ".join(f"{n}: {', '.join(w)}" for n, w in shared.items())


def test_no_class_is_over_250_lines():
    """A class a reader holds in mind at once (issue 37: the Runner had grown to 273)."""
    long = [f"{path.relative_to(PACKAGE)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for path in sorted(PACKAGE.rglob("*.py")) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ClassDef) and (node.end_lineno or 0) - node.lineno + 1 > 250]
    assert long == [], "split: " + ", ".join(long)


# Functions whose contract is to change what they are handed: pytest's hooks (the items to reorder,
# a report's user_properties), torch.distributed's object collectives (they fill the caller's list),
# and the installers that patch torch or OneFlow in a rank.
_FILLERS_BY_CONTRACT = {
    "plugin.py:pytest_collection_modifyitems", "plugin.py:_finish",
    "rankside/simulate.py:all_gather_object", "rankside/simulate.py:gather_object",
    "rankside/simulate.py:scatter_object_list",
    "rankside/fakegpu/cuda_api.py:install_cuda_api", "rankside/gpu_allocator.py:_hold_peaks_across_resets",
    # the fake GPU's mends patch torch and the job's modules, and record into the value policy's collector;
    # its fake mode registers higher-order operators' rules for its own class
    "rankside/fakegpu/mends/storage_resize.py:_patch", "rankside/fakegpu/mends/compile_eager.py:_patch",
    "rankside/fakegpu/mends/ties.py:fakes_replaced", "rankside/fakegpu/dispatch.py:_counting_mode",
    "rankside/fakegpu/dispatch.py:run_fake",
    "oneflow/rendezvous.py:exec_and_wrap", "oneflow/eager.py:wrap_to_global",
    # drops the snapshot of a frame's locals it read, which kept the user's dropped tensors alive
    "sampling/holders.py:_locals",
}
_MUTATORS = {"append", "extend", "insert", "update", "setdefault", "add", "pop", "remove", "clear",
             "discard", "popitem", "sort", "reverse"}


def _root(node: ast.AST) -> str | None:
    """The name an expression starts from: ``run`` for ``run.result.sites[0]``."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _handed(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """The function's parameters, and the names a loop over one of them binds (``for run in test.runs``)."""
    names = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs} - {"self", "cls"}
    grew = True
    while grew:
        grew = False
        for node in ast.walk(fn):
            if isinstance(node, (ast.For, ast.comprehension)) and _root(node.iter) in names:
                for target in ast.walk(node.target):
                    if isinstance(target, ast.Name) and target.id not in names:
                        names.add(target.id)
                        grew = True
    return names


def _fills(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[int, str]]:
    """Where ``fn`` changes something it was handed: a mutating call, an item or attribute set or deleted."""
    handed, found = _handed(fn), []
    for node in ast.walk(fn):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS
                and not isinstance(node.func.value, ast.Call) and _root(node.func.value) in handed):
            found.append((node.lineno, ast.unparse(node.func)))
        targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete))
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        found += [(node.lineno, ast.unparse(t)) for t in targets
                  if isinstance(t, (ast.Attribute, ast.Subscript)) and _root(t) in handed]
    return found


def test_no_function_fills_a_list_or_dict_it_was_handed():
    """Steps return what they found and the caller gathers it (issue 37: the gate's helpers filled
    the problems, warnings and notes they were handed, the launch's helpers the result they were
    handed, so a reader had to follow every call). An object changes its own state only."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(PACKAGE)}:{getattr(fn, 'name', '')}"
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and where not in _FILLERS_BY_CONTRACT:
                found += [f"{where} line {line} changes {what}" for line, what in _fills(fn)]
    assert found == [], "return it instead: " + "; ".join(found)


def test_the_fill_check_sees_a_handed_object_changed_through_a_loop():
    """The check above can fail: a floor added to each run of the test it was handed."""
    source = "def add(test):\n    for run in test.runs:\n        run.result = 1\n        run.notes.append(2)\n"
    fn = ast.parse(source).body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert _fills(fn) == [(3, "run.result"), (4, "run.notes.append")]


# Where a size's gated reading is made: once judging starts (a finished run's readings), and before it
# for the sizes the launch cap fits a prediction to and a size relaunched for its peak sites; ``judge``
# makes them for a caller that hands it results without a run.
_READERS = {"launching/launched.py:readings", "judging/verdict.py:judge", "launching/scaling.py:_predict",
            "launching/driver.py:_with_sites"}


def test_which_rank_is_gated_is_decided_in_one_place():
    """Which rank of a size is gated, its label and its figures: ``results.size.gated_reading``
    decides, and the reading is handed on (issue 56: 30 call sites recomputed it from the result and
    the marker's rank, in five modules); ``SizeResult`` itself takes no rank."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and f"{where}:{fn.name}" not in _READERS:
                found += [f"{where}:{fn.name} line {node.lineno}" for node in ast.walk(fn)
                          if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "gated_reading"]
    assert found == [], "hand the size's GatedReading down instead: " + "; ".join(found)
    size = next(node for node in ast.parse((PACKAGE / "results" / "size.py").read_text()).body
                if isinstance(node, ast.ClassDef) and node.name == "SizeResult")
    assert [fn.name for fn in size.body if isinstance(fn, ast.FunctionDef)
            and "rank" in [a.arg for a in fn.args.args]] == []


def test_the_drawn_path_of_one_test_goes_down_the_layers_once():
    """docs/architecture.md draws one test's path from the hook to the table: each module once, the
    top level first and then the layers in order, each module reached (imported) from one drawn above
    it, so a reader never climbs back to a room already left (issue 56: 53 stops, 38 returns)."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = page.split("## The path of one test", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    drawn = [line.split()[0] for line in block.splitlines() if line.strip()]
    assert len(drawn) == len(set(drawn)), drawn
    paths = [PACKAGE / name for name in drawn]
    assert all(path.is_file() for path in paths), drawn
    rank = [-1 if path.parent == PACKAGE else LAYERS.index(path.relative_to(PACKAGE).parts[0]) for path in paths]
    assert rank == sorted(rank), f"not in layer order: {drawn}"
    known = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    names = [_module_name(path) for path in paths]
    for i, name in enumerate(names[1:], 1):
        reached = any(name in _module_imports(above, known) for above in paths[:i])
        assert reached, f"{drawn[i]}: imported by no module drawn above it"
