"""One name per concept, each module one concern: where the central names live (read from the source, so a
move that leaves a second copy behind fails here)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def top_level_defs(name: str) -> list[str]:
    """The library modules (``phaseserve``) that define ``name`` at top level (a class, function or assignment)."""
    out = []
    for path in sorted((ROOT / "phaseserve").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            targets = getattr(node, "targets", [])
            names = [getattr(node, "name", None)] + [t.id for t in targets if isinstance(t, ast.Name)]
            if name in names:
                out.append(str(path.relative_to(ROOT)))
    return out


def test_the_request_state_lives_with_the_request():
    from phaseserve.engine import request

    assert request.Sequence.__module__ == "phaseserve.engine.request"
    assert top_level_defs("Sequence") == ["phaseserve/engine/request.py"]
    assert top_level_defs("stop_reason") == ["phaseserve/engine/request.py"]  # the finish rule
