"""No import cycle among the modules of ``textgym`` (``textgym/``) and ``textgym.agents`` (``agents/``).

The graph is read from the source with :mod:`ast`, every ``import`` counted wherever it sits: a
function-level import that dodges a cycle at run time is still a cycle in the design. Nodes are
modules (a package is its ``__init__``); an edge ``M -> T`` says M's code imports T. The rules:

1. ``import a.b.c`` and ``from a.b import c`` (``c`` a submodule) point at ``a.b.c``; ``from a.b
   import name`` points at ``a.b``. Relative imports are resolved against the importing module.
2. Importing ``a.b.c`` runs the ``__init__`` of ``a`` and ``a.b`` first, so those are edges too, but
   not the importer's own enclosing packages: they are already being imported when its code runs.
   (Without that exception every package whose ``__init__`` imports its children would be a cycle.)
3. A package ``__init__`` importing its own submodules is an edge like any other: on its own it
   makes no cycle, it does when a submodule imports back a name the ``__init__`` defines itself.
4. ``from pkg import name``, where ``pkg``'s ``__init__`` only re-exports ``name`` (``from
   .sub import name``), points at the module that defines ``name`` (followed through every
   re-export): a submodule taking a sibling's name through its package is not a cycle, while
   ``registry -> builtin -> textgym.rewards(make_reward_model) -> registry`` still is one.

A strongly connected component of more than one module is a cycle; the test names its modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the import name of each source folder (pyproject.toml's package-dir: agents/ installs as textgym.agents)
SOURCES = {"textgym": ROOT / "textgym", "textgym.agents": ROOT / "agents"}


def module_files(sources: dict[str, Path]) -> dict[str, Path]:
    """Every ``.py`` file of the source folders by its module name (``pkg/__init__.py`` is ``pkg``)."""
    found = {}
    for package, folder in sources.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _imports(tree: ast.AST, module: str, is_package: bool) -> Iterable[tuple[str, str | None]]:
    """``(target, name)`` for every import in ``tree``: ``name`` None for ``import target``.

    Relative imports are resolved: ``from .x import y`` in ``a.b`` (a module) is ``a.x``, in ``a.b``
    (a package) ``a.b.x``.
    """
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module
            for alias in node.names:
                yield target, alias.name


def _package_chain(module: str) -> list[str]:
    """``a.b.c`` → ``["a", "a.b"]``: the packages whose ``__init__`` runs before ``a.b.c``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(sources: dict[str, Path]) -> dict[str, set[str]]:
    """The module-level import graph of the source folders, by the rules of this file's docstring."""
    files = module_files(sources)
    packages = {m for m, p in files.items() if p.name == "__init__.py"}
    raw = {m: list(_imports(ast.parse(p.read_text(), str(p)), m, m in packages)) for m, p in files.items()}

    def project_module(name: str) -> str | None:
        """``name`` or its longest prefix that is a module of the project (``a.b.attr`` → ``a.b``)."""
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    def exporters(package: str) -> dict[str, str]:
        """The names a package's ``__init__`` takes from other modules, and from which module."""
        out = {}
        for target, name in raw[package]:
            if name is not None and name != "*" and project_module(target) is not None:
                out[name] = f"{target}.{name}" if f"{target}.{name}" in files else project_module(target)
        return out

    reexports = {p: exporters(p) for p in packages}

    def defining_module(target: str, name: str, seen: frozenset = frozenset()) -> str:
        """The module ``from target import name`` depends on (rules 1 and 4)."""
        if f"{target}.{name}" in files:
            return f"{target}.{name}"
        source = reexports.get(target, {}).get(name)
        if source is None or source in seen:
            return target
        return defining_module(source, name, seen | {target}) if source in packages else source

    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, imports in raw.items():
        own = set(_package_chain(module)) | {module}
        for target, name in imports:
            found = project_module(target)
            if found is None:
                continue
            explicit = defining_module(found, name) if name is not None and found == target else found
            graph[module].add(explicit)
            ran = set(_package_chain(explicit)) | {found} | set(_package_chain(found))  # rule 2
            graph[module] |= {p for p in ran if p in packages} - own
        graph[module].discard(module)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in sorted(component) for b in sorted(graph[a] & component)]
    return f"{sorted(component)} ({'; '.join(edges)})"


def test_no_import_cycle():
    graph = import_graph(SOURCES)
    assert "textgym.envs.text_rlhf" in graph and "textgym.agents.ppo.trainer" in graph  # both folders were read
    new = cycles(graph)
    assert not new, "import cycles (function-level imports count):\n" + "\n".join(_describe(c, graph) for c in new)


# ---------------------------------------------------------------- the rules, on a small package


def _write(folder: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return {"pkg": folder}


def test_a_function_level_import_makes_a_cycle(tmp_path):
    sources = _write(tmp_path, {"__init__.py": "", "a.py": "from pkg.b import g\n",
                                "b.py": "def g():\n    from .a import f\n"})  # fmt: skip
    assert cycles(import_graph(sources)) == [frozenset({"pkg.a", "pkg.b"})]


def test_a_package_reexporting_its_children_is_no_cycle(tmp_path):
    sources = _write(tmp_path, {"__init__.py": "from .a import f\nfrom .b import g\n", "a.py": "def f(): pass\n",
                                "b.py": "from pkg import f\n", "sub/__init__.py": "from pkg.sub.c import h\n",
                                "sub/c.py": "import pkg.a\nh = 1\n"})  # fmt: skip
    graph = import_graph(sources)
    assert graph["pkg.b"] == {"pkg.a"}  # through the re-export, to the module defining f
    assert graph["pkg.sub.c"] == {"pkg.a"}  # pkg and pkg.sub enclose pkg.sub.c: already being imported
    assert cycles(graph) == []


def test_a_name_defined_in_the_package_init_makes_a_cycle(tmp_path):
    sources = _write(tmp_path, {"__init__.py": "from .a import f\nLIMIT = 3\n", "a.py": "from . import LIMIT\n"})
    assert cycles(import_graph(sources)) == [frozenset({"pkg", "pkg.a"})]


def test_importing_a_submodule_runs_its_package_init(tmp_path):
    sources = _write(tmp_path, {"__init__.py": "", "models.py": "from pkg.envs.prompts import P\n",
                                "envs/__init__.py": "from pkg.envs.env import Env\n", "envs/prompts.py": "P = 1\n",
                                "envs/env.py": "from pkg.models import M\n"})  # fmt: skip
    assert cycles(import_graph(sources)) == [frozenset({"pkg.models", "pkg.envs", "pkg.envs.env"})]


def test_import_textgym_and_the_cli_help_load_neither_torch_nor_transformers():
    """Issue 42.11: `import textgym` took 4.8 s and `textgym --help` 4.6 s idle, importing torch and transformers
    through the env classes; they now load with the first env (measured: docs/performance.md)."""
    code = ("import sys, contextlib, io\nimport textgym\nfrom textgym.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "    main(['train', '--help'])\n"
            "print(sorted(m for m in ('torch', 'transformers', 'torchrl') if m in sys.modules))\n"
            "import gymnasium as gym\ngym.make('TextRLHF-v0', max_new_tokens=2)\n"
            "print(textgym.TextRLHFEnv.__name__)\n")  # fmt: skip
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "TextRLHFEnv"


def folder_graph(graph: dict[str, set[str]], files: dict[str, Path]) -> dict[str, set[str]]:
    """``graph`` with each sub-folder's modules collapsed into the folder (``textgym.rewards.base`` ->
    ``textgym.rewards``); a module at a source folder's root stays itself (``textgym.models``)."""

    def folder(module: str) -> str:
        root = max((r for r in SOURCES if module == r or module.startswith(r + ".")), key=len)
        parts, depth = module.split("."), len(root.split("."))
        return ".".join(parts[: depth + 1]) if len(parts) > depth + 1 or module in packages else module

    packages = {m for m, p in files.items() if p.name == "__init__.py"} - set(SOURCES)
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(folder(module), set()).update(folder(t) for t in targets if t not in SOURCES)
    for here, there in out.items():
        there.discard(here)
    return out


def test_no_folder_imports_a_folder_that_imports_it_back():
    """Issue 43.4: the build scripts in textgym/assets import the reward models and textgym.models, which took their
    asset paths from textgym.assets: the two folders imported each other. The paths live in textgym.asset_paths."""
    graph, files = import_graph(SOURCES), module_files(SOURCES)
    folders = folder_graph(graph, files)
    assert "textgym.assets" in folders and "textgym.rewards" in folders["textgym.assets"]
    found = cycles(folders)
    assert not found, "folder cycles:\n" + "\n".join(_describe(c, folders) for c in found)


def test_no_module_imports_the_package_root():
    """Issue 43.4: episodes.py and the CLI imported ``textgym`` itself to register the env ids, a tie upward to the
    package root; any ``textgym.*`` module runs the root ``__init__`` (which registers them) before its own code."""
    graph = import_graph(SOURCES)
    upward = sorted(m for m, targets in graph.items() if "textgym" in targets and m != "textgym")
    assert upward == [], upward
