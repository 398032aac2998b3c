"""The layering of the source tree, checked over its imports (``ast``, nothing imported).

From the ground up: ``shardc/core`` (mesh, placements, options, IR types) <- ``runtime/``
(what runs on the ranks) <- ``passes/`` (the compiler passes) <- ``shardc/program`` (build
and run a rank's program, read it out) <- ``shardc/planning`` and ``shardc/train`` <- the
public modules at ``shardc/``'s top (``__init__``, ``compiler``, ``checkpoint``) <-
``shardc/tools`` (the CLI and what it drives). A module imports only from its own package
or from a lower floor. Also checked: no import cycle, no private name (``_x``) imported
from another module, and no shardc import inside a function (the way cycles used to be
hidden); an import of another library inside a function says why on its line
(``# noqa: PLC0415 - <why>``, the marker ruff's check of the same rule reads: an optional
dependency, or an import cost that was measured)."""
from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass

import networkx as nx

pytestmark: list = []  # one process, reads source files only: the fast tier

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# where each installed package lives in the tree (pyproject's package-dir)
DIRS = {"shardc": "shardc", "shardc.passes": "passes", "shardc.runtime": "runtime"}
FLOORS = [  # (package prefix, floor); the longest prefix decides
    ("shardc.core", 0), ("shardc.runtime", 1), ("shardc.passes", 2), ("shardc.program", 3),
    ("shardc.planning", 4), ("shardc.train", 4), ("shardc", 5), ("shardc.tools", 6),
]
# ``python -m shardc`` is the CLI's other door
GROUP = {"shardc.__main__": ("shardc.tools", 6)}


@dataclass
class Import:
    source: str  # importing module
    target: str  # imported module
    names: tuple[str, ...]  # names taken from it (from-imports)
    line: int
    in_function: bool
    type_only: bool  # under ``if TYPE_CHECKING:``
    text: str  # the source line(s)


def _modules() -> dict[str, str]:
    mods = {}
    for pkg, d in DIRS.items():
        for dirpath, _, files in os.walk(os.path.join(ROOT, d)):
            rel = os.path.relpath(dirpath, os.path.join(ROOT, d))
            if pkg == "shardc" and rel.split(os.sep)[0] in ("passes", "runtime"):
                continue
            for f in files:
                if not f.endswith(".py"):
                    continue
                parts = [] if rel == "." else rel.split(os.sep)
                if f != "__init__.py":
                    parts.append(f[:-3])
                mods[".".join([pkg, *parts])] = os.path.join(dirpath, f)
    return mods


MODULES = _modules()


def _package(mod: str) -> str:
    return mod if MODULES[mod].endswith("__init__.py") else mod.rpartition(".")[0]


def floor(mod: str) -> tuple[str, int]:
    if mod in GROUP:
        return GROUP[mod]
    best = max((p for p in FLOORS if mod == p[0] or mod.startswith(p[0] + ".")), key=lambda p: len(p[0]))
    return best


def _imports(mod: str) -> list[Import]:
    path = MODULES[mod]
    src = open(path).read()
    lines = src.splitlines()
    tree = ast.parse(src)
    out: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            fn = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            tc = type_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                text = "\n".join(lines[child.lineno - 1:child.end_lineno])
                if isinstance(child, ast.Import):
                    for a in child.names:
                        out.append(Import(mod, a.name, (), child.lineno, in_function, type_only, text))
                else:
                    base = child.module or ""
                    if child.level:
                        pkg = _package(mod).split(".")
                        base = ".".join(pkg[:len(pkg) - child.level + 1] + ([base] if base else []))
                    for a in child.names:
                        sub = f"{base}.{a.name}"
                        if sub in MODULES:  # ``from shardc.passes import joint``
                            out.append(Import(mod, sub, (), child.lineno, in_function, type_only, text))
                        else:
                            out.append(Import(mod, base, (a.name,), child.lineno, in_function,
                                              type_only, text))
            visit(child, fn, tc)

    visit(tree, False, False)
    return out


IMPORTS = [i for m in sorted(MODULES) for i in _imports(m)]
OURS = [i for i in IMPORTS if i.target in MODULES and i.target != i.source]


def _where(i: Import) -> str:
    return f"{os.path.relpath(MODULES[i.source], ROOT)}:{i.line}: {i.text.strip()}"


def test_every_module_has_a_floor() -> None:
    assert "shardc.compiler" in MODULES and "shardc.passes.lower" in MODULES  # the walk saw the tree
    for mod in MODULES:
        floor(mod)


def test_imports_go_down_the_floors() -> None:
    wrong = []
    for i in OURS:
        (pkg_s, f_s), (pkg_t, f_t) = floor(i.source), floor(i.target)
        if not (f_t < f_s or pkg_t == pkg_s):
            wrong.append(f"{_where(i)}  ({pkg_s}, floor {f_s} -> {pkg_t}, floor {f_t})")
    assert not wrong, "imports that go up or sideways:\n" + "\n".join(wrong)


def test_no_import_cycle() -> None:
    g = nx.DiGraph()
    for i in OURS:
        if not i.type_only:
            g.add_edge(i.source, i.target)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles[:20])


def test_no_private_name_crosses_modules() -> None:
    private = [f"{_where(i)}  ({name})" for i in OURS for name in i.names
               if name.startswith("_") and not name.startswith("__")]
    assert not private, "private names imported from another module:\n" + "\n".join(private)


def test_imports_inside_functions_say_why() -> None:
    ours = [_where(i) for i in OURS if i.in_function]
    assert not ours, ("shardc modules imported inside a function (import them at the top; a "
                      "cycle means a layer is wrong):\n" + "\n".join(ours))
    silent = [_where(i) for i in IMPORTS if i.in_function and i.target not in MODULES
              and not re.search(r"# noqa: PLC0415 - \w", i.text)]
    assert not silent, ("imports inside a function without a '# noqa: PLC0415 - <why>' comment "
                        "(an optional dependency, or a measured import cost):\n" + "\n".join(silent))
