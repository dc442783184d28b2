"""Imports run one way: errors -> ir -> schema -> planner -> executor -> calibrate -> cli / api.

Every `import` of the package's own modules, at module level or inside a function, is an edge of
the import graph; the test fails on an edge that points up a layer, on a cycle (lazy imports
included: none may dodge one), and on a private name (`_x`) taken from another module."""
import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ir", "schema", "planner", "executor")
LAYERS = ("tensorstow.errors", "tensorstow.ir", "tensorstow.schema", "tensorstow.planner",
          "tensorstow.executor", "tensorstow.calibrate", "tensorstow.cli|tensorstow.api", "tensorstow")
"""Bottom to top; a module may import its own layer (without a cycle) and the ones below it."""


def modules() -> dict[str, Path]:
    """Module name -> file, for every module of the installed package (pyproject's package-dir)."""
    out = {"tensorstow": ROOT / "__init__.py"}
    out |= {f"tensorstow.{p.stem}": p for p in ROOT.glob("*.py") if p.name != "__init__.py"}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            parts = p.relative_to(ROOT).with_suffix("").parts
            name = "tensorstow." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = p
    return out


def layer(module: str) -> int:
    for k, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names.split("|")):
            return k if module != "tensorstow" or names == "tensorstow" else len(LAYERS) - 1
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def edges(mods: dict[str, Path]):
    """(importer, imported module, line, names) for every import of a package module."""
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(a.name, ()) for a in node.names if a.name.startswith("tensorstow")]
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tensorstow"):
                targets = []
                for a in node.names:  # `from tensorstow.ir import hf` imports the module ir.hf
                    sub = f"{node.module}.{a.name}"
                    targets.append((sub, ()) if sub in mods else (node.module, (a.name,)))
            else:
                continue
            for target, names in targets:
                while target not in mods:  # `import tensorstow.executor.run` -> that module
                    target = target.rpartition(".")[0]
                yield name, target, node.lineno, names


def test_the_module_list_covers_the_package():
    mods = modules()
    assert {"tensorstow.errors", "tensorstow.schema.plan", "tensorstow.planner.plan", "tensorstow.executor.runtime",
            "tensorstow.calibrate", "tensorstow.cli", "tensorstow.api"} <= set(mods)
    for m in mods:
        layer(m)


def test_imports_point_down_the_layers():
    mods = modules()
    up = [f"{mods[a].relative_to(ROOT)}:{line}: {a} imports {b}"
          for a, b, line, _ in edges(mods) if layer(b) > layer(a)]
    assert not up, "imports that point up a layer:\n" + "\n".join(up)


def test_the_import_graph_has_no_cycle():
    mods = modules()
    g = nx.DiGraph((a, b) for a, b, _, _ in edges(mods) if a != b)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + c[:1]) for c in cycles[:5])


def test_no_module_takes_another_ones_private_names():
    mods = modules()
    private = [f"{mods[a].relative_to(ROOT)}:{line}: {a} imports {b}.{n}"
               for a, b, line, names in edges(mods) for n in names if n.startswith("_") and a != b]
    assert not private, "private names imported across modules:\n" + "\n".join(private)


def test_a_planted_upward_import_is_caught(tmp_path, monkeypatch):
    """The walk sees an import inside a function: a planner module that imports the executor
    lazily is an upward edge."""
    fake = tmp_path / "planner"
    fake.mkdir()
    (fake / "x.py").write_text("def f():\n    from tensorstow.executor.runtime import Executor\n")
    mods = modules() | {"tensorstow.planner.x": fake / "x.py"}
    found = [(a, b) for a, b, _, _ in edges(mods) if layer(b) > layer(a)]
    assert found == [("tensorstow.planner.x", "tensorstow.executor.runtime")]
