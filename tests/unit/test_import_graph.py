"""The package's layering, read from the source with ``ast`` (every import, including those inside functions):

    config -> qarrays (quantized arrays, the matmul dispatch) -> model -> quant / cache -> engine -> serving
    / server (HTTP) -> bench / eval -> experiments

- no cycles between ``phaseserve``'s units (a subpackage, a top-level module, or the package root
  ``phaseserve/__init__.py``, which imports the public API);
- ``phaseserve.model`` imports none of engine, bench, serving, server, eval, quant (it multiplies through
  ``phaseserve.qarrays`` only);
- the engine imports nothing from bench, nor Hydra / OmegaConf (the Hydra translation is
  ``phaseserve.config_hydra``, beside the configs);
- the allocator and the scheduler are host code: no jax;
- ``pallas_kernels`` (the kernel layer) imports nothing from phaseserve.

A failure names each offending edge as ``file:line  importer -> imported``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "phaseserve"


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


def imports_in(source: str, package: str) -> list[tuple[str, int]]:
    """:func:`imports` of ``source``, a module of ``package`` (for relative imports)."""
    out = []
    for node in ast.walk(ast.parse(source)):
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


def unit(module: str) -> str | None:
    """The layering unit of a phaseserve module: ``phaseserve.<first part>``, or ``phaseserve`` for the root."""
    parts = module.split(".")
    if parts[0] != "phaseserve":
        return None
    return ".".join(parts[:2])


def edges(package: Path = PKG) -> list[tuple[str, str, str]]:
    """(importer module, imported module, "file:line") for every import in the package."""
    out = []
    for path in sorted(package.rglob("*.py")):
        src = module_name(path)
        for mod, line in imports(path):
            out.append((src, mod, f"{path.relative_to(ROOT)}:{line}"))
    return out


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


def offending(pred_src, pred_dst, package: Path = PKG) -> list[str]:
    return sorted({f"{where}  {src} -> {dst}" for src, dst, where in edges(package) if pred_src(src) and pred_dst(dst)})


def _under(*prefixes: str):
    return lambda m: any(m == p or m.startswith(p + ".") for p in prefixes)


def test_no_cycles_between_units():
    graph: dict[str, set[str]] = defaultdict(set)
    where: dict[tuple[str, str], str] = {}
    for src, dst, loc in edges():
        a, b = unit(src), unit(dst)
        if b is not None and a != b:
            graph[a].add(b)
            where.setdefault((a, b), f"{loc}  {src} -> {dst}")
    report = []
    while (cycle := find_cycle(graph)) is not None:  # report every cycle: drop one edge of each and look again
        report.append("import cycle " + " -> ".join(cycle) + ":\n" + "\n".join(
            "  " + where[(a, b)] for a, b in zip(cycle, cycle[1:], strict=False)))
        graph[cycle[-2]].discard(cycle[-1])
    assert not report, "\n".join(report)


def test_model_imports_only_the_quantized_array_leaf():
    bad = offending(_under("phaseserve.model"), _under(*(f"phaseserve.{u}" for u in (
        "engine", "bench", "serving", "server", "eval", "quant", "cache", "config_hydra", "train"))))
    assert not bad, "the model imports upward:\n" + "\n".join(bad)


def test_engine_imports_no_bench_and_no_hydra():
    bad = offending(_under("phaseserve.engine"), _under("phaseserve.bench", "hydra", "omegaconf"))
    assert not bad, "the engine imports the experiment harness or Hydra:\n" + "\n".join(bad)


def test_only_bench_and_eval_sit_above_the_http_server():
    above = _under("phaseserve.server", "phaseserve.bench", "phaseserve.eval")
    bad = offending(lambda m: not above(m), _under("phaseserve.server"))
    bad += offending(_under("phaseserve.server"), _under("phaseserve.bench", "phaseserve.eval"))
    assert not bad, "imports across the HTTP server's layer:\n" + "\n".join(bad)


def test_allocator_and_scheduler_import_no_jax():
    host = ("phaseserve.cache.allocator", "phaseserve.engine.scheduler")
    bad = offending(lambda m: m in host, _under("jax", "jaxlib", "flax", "phaseserve.cache.paged"))
    assert not bad, "host-only modules import jax:\n" + "\n".join(bad)


def test_kernels_import_nothing_from_phaseserve():
    bad = offending(lambda m: True, _under("phaseserve"), ROOT / "pallas_kernels")
    assert not bad, "pallas_kernels imports phaseserve:\n" + "\n".join(bad)


def test_the_checks_see_imports_inside_functions():
    """The graph reader finds function-local and relative imports (the test above would be blind otherwise)."""
    src = "import numpy\n\ndef f():\n    from ..bench import schema\n    from . import decode\n    import hydra.core\n"
    found = imports_in(src, "phaseserve.engine")
    assert found == [("numpy", 1), ("phaseserve.bench.schema", 4), ("phaseserve.engine.decode", 5),
                     ("hydra.core", 6)]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None
