"""The library/lab split and the library's layering, read from the source with ``ast``: every import, at module
level and inside functions (imports under ``if TYPE_CHECKING:`` never run and are not counted).

The serving library is ``phaseserve`` and ``pallas_kernels`` (the kernels); the lab (``lab``: benchmarks,
evaluation, training, corpus, published figures, reports, fault injection, kernel tools) sits above it and is
imported by ``experiments/``:

    config -> qarrays (quantized arrays, the matmul dispatch) -> model -> quant / cache -> engine -> distributed
    (Ray, KV transfer) / server (HTTP)  [library]  ->  lab  ->  experiments

- the library imports nothing from the lab;
- no import cycles between the library's modules (module by module, function-local imports included), nor
  between ``phaseserve``'s units (a subpackage, a top-level module, or the package root);
- ``phaseserve.model`` imports none of engine, distributed, server, quant, cache (it multiplies through
  ``phaseserve.qarrays`` only);
- the engine imports no Hydra / OmegaConf (the Hydra translation is ``phaseserve.config_hydra``);
- nothing in the library below the HTTP server imports it;
- the allocator and the scheduler are host code: no jax;
- ``pallas_kernels`` (the kernel layer) imports nothing from phaseserve.

A failure names each offending edge as ``file:line  importer -> imported``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("phaseserve", "pallas_kernels")
LAB = "lab"

Edge = tuple[str, str, str]  # (importer module, imported module, "file:line")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    p = ROOT.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def imports(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in ``path``; ``from a import b`` gives ``a.b`` when that is a
    module, else ``a``."""
    name = module_name(path)
    return imports_in(path.read_text(), name if path.name == "__init__.py" else name.rpartition(".")[0])


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _nodes(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node of ``tree`` (function bodies included) except the bodies of ``if TYPE_CHECKING:``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if _type_checking_only(node):
            todo.extend(reversed(node.orelse))
            continue
        todo.extend(reversed(list(ast.iter_child_nodes(node))))


def imports_in(source: str, package: str) -> list[tuple[str, int]]:
    """:func:`imports` of ``source``, a module of ``package`` (for relative imports)."""
    out = []
    for node in _nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if is_module(sub) else base, node.lineno))
    return out


def edges(*packages: str) -> list[Edge]:
    """Every import in the given top-level packages (default: the library)."""
    out = []
    for pkg in packages or LIBRARY:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            src = module_name(path)
            out += [(src, mod, f"{path.relative_to(ROOT)}:{line}") for mod, line in imports(path)]
    return out


def _under(*prefixes: str):
    return lambda m: any(m == p or m.startswith(p + ".") for p in prefixes)


def lab_imports(found: Iterable[Edge]) -> list[str]:
    """Each edge of ``found`` into the lab, as ``file:line  importer -> imported``."""
    return sorted(f"{where}  {src} -> {dst}" for src, dst, where in found if _under(LAB)(dst))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


IN_LIBRARY = _under(*LIBRARY)


def cycles(found: Iterable[Edge], node=lambda m: m, within=IN_LIBRARY) -> list[str]:
    """Every import cycle among ``found``'s modules that ``within`` accepts, each mapped by ``node`` (a module, or
    its unit), as a report naming the edges: one edge of each cycle is dropped and the graph searched again."""
    graph: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for src, dst, loc in found:
        if within(src) and within(dst) and (a := node(src)) != (b := node(dst)):
            graph[a].add(b)
            where.setdefault((a, b), f"{loc}  {src} -> {dst}")
    report = []
    while (cycle := find_cycle(graph)) is not None:
        report.append("import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(
            "  " + where[(a, b)] for a, b in zip(cycle, cycle[1:], strict=False)))
        graph[cycle[-2]].discard(cycle[-1])
    return report


def unit(module: str) -> str:
    """The layering unit of a phaseserve module: ``phaseserve.<first part>``, or ``phaseserve`` for the root."""
    return ".".join(module.split(".")[:2])


def offending(pred_src, pred_dst, found: Iterable[Edge] | None = None) -> list[str]:
    found = edges() if found is None else found
    return sorted({f"{where}  {src} -> {dst}" for src, dst, where in found if pred_src(src) and pred_dst(dst)})


def test_the_walk_covers_the_library():
    found = edges()
    importers = {src for src, _, _ in found}
    assert {"phaseserve.engine.engine", "phaseserve.server.app", "pallas_kernels.int4_matmul"} <= importers
    assert not any(_under(LAB)(m) for m in importers), "a lab module lies inside the library's packages"
    assert all(not (ROOT / p / LAB).exists() for p in LIBRARY)


def test_the_library_imports_nothing_from_the_lab():
    bad = lab_imports(edges())
    assert not bad, "the serving library imports the lab:\n" + "\n".join(bad)


def test_no_import_cycles_between_library_modules():
    report = cycles(edges())
    assert not report, "\n".join(report)


def test_no_cycles_between_units():
    report = cycles(edges("phaseserve"), node=unit, within=_under("phaseserve"))
    assert not report, "\n".join(report)


def test_model_imports_only_the_quantized_array_leaf():
    bad = offending(_under("phaseserve.model"), _under(*(f"phaseserve.{u}" for u in (
        "engine", "distributed", "server", "quant", "cache", "config_hydra"))))
    assert not bad, "the model imports upward:\n" + "\n".join(bad)


def test_engine_imports_no_hydra():
    bad = offending(_under("phaseserve.engine"), _under("hydra", "omegaconf"))
    assert not bad, "the engine imports Hydra:\n" + "\n".join(bad)


def test_nothing_in_the_library_sits_above_the_http_server():
    bad = offending(lambda m: not _under("phaseserve.server")(m), _under("phaseserve.server"))
    assert not bad, "library modules import the HTTP server:\n" + "\n".join(bad)


def test_allocator_and_scheduler_import_no_jax():
    host = ("phaseserve.cache.allocator", "phaseserve.engine.scheduler")
    bad = offending(lambda m: m in host, _under("jax", "jaxlib", "flax", "phaseserve.cache.paged"))
    assert not bad, "host-only modules import jax:\n" + "\n".join(bad)


def test_kernels_import_nothing_from_phaseserve():
    bad = offending(lambda m: True, _under("phaseserve"), edges("pallas_kernels"))
    assert not bad, "pallas_kernels imports phaseserve:\n" + "\n".join(bad)


def test_the_checks_see_imports_inside_functions():
    """The graph reader finds function-local and relative imports, skips ``if TYPE_CHECKING:`` bodies, and the
    checkers report a lab import and a cycle fed to them (the tests above would be blind otherwise)."""
    src = ("import numpy\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lab import figures\n"
           "else:\n    import json\n\ndef f():\n    from ..cache import paged\n    from . import decode_step\n"
           "    import hydra.core\n    if True:\n        from lab.bench import measure\n")
    found = imports_in(src, "phaseserve.engine")
    assert found == [("numpy", 1), ("typing", 2), ("json", 6), ("phaseserve.cache.paged", 9),
                     ("phaseserve.engine.decode_step", 10), ("hydra.core", 11), ("lab.bench.measure", 13)]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None

    fake = [(src_, dst, f"{src_.replace('.', '/')}.py:{line}") for line, (src_, dst) in enumerate([
        ("phaseserve.engine.engine", "phaseserve.cache.paged"),
        ("phaseserve.cache.paged", "phaseserve.config"),
        ("phaseserve.config", "phaseserve.engine.engine"),  # closes a cycle of three modules
        ("phaseserve.quant.a", "phaseserve.quant.b"),
        ("phaseserve.quant.b", "phaseserve.quant.a"),  # and one of two
        ("phaseserve.server.app", "lab.bench.measure"),  # a lab import
        ("lab.bench.measure", "phaseserve.engine"),  # the lab may import the library: no cycle through it
        ("phaseserve.engine", "numpy"),
    ], start=1)]
    assert lab_imports(fake) == ["phaseserve/server/app.py:6  phaseserve.server.app -> lab.bench.measure"]
    report = cycles(fake)
    assert len(report) == 2
    assert report[0].startswith("import cycle phaseserve.cache.paged -> phaseserve.config -> "
                                "phaseserve.engine.engine -> phaseserve.cache.paged:")
    assert "phaseserve/config.py:3  phaseserve.config -> phaseserve.engine.engine" in report[0]
    assert report[1].startswith("import cycle phaseserve.quant.a -> phaseserve.quant.b -> phaseserve.quant.a")
    assert cycles(fake, node=unit) and cycles(fake[3:]) == cycles(fake)[1:]
    assert not cycles(fake[5:]) and not lab_imports(fake[:5])
