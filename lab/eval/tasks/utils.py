"""Scoring of the ``ps_toolcalls`` lm-eval task (``!function utils.process_toolcall``), run inside lm-eval's own
environment, which need not have phaseserve: a generation is read as :func:`phaseserve.data.toolcalls.extract_call`
reads generated tokens (the text between ``<tool_call>`` and ``</tool_call>`` or ``<eos>``; a server that skips
special tokens in its text returns the JSON alone) and checked as :func:`phaseserve.data.toolcalls.validate_call`
checks it, with ``jsonschema`` against ``data/tools.json`` (the project's ``TOOLS``; tests/e2e/test_lm_eval.py checks
that both give the same verdicts).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

TOOLS_JSON = Path(__file__).resolve().parent / "data" / "tools.json"


@lru_cache(maxsize=1)
def _validators() -> dict:
    from jsonschema import Draft202012Validator

    return {name: Draft202012Validator(schema) for name, schema in json.loads(TOOLS_JSON.read_text()).items()}


def call_text(generation: str) -> str:
    """The call's JSON text in a generation (with or without the ``<tool_call>`` markers)."""
    text = generation
    if "<tool_call>" in text:
        text = text.split("<tool_call>", 1)[1]
    for stop in ("</tool_call>", "<eos>"):
        text = text.split(stop, 1)[0]
    return text.strip()


def valid_call(call: Any) -> bool:
    """True when ``call`` is ``{"name": <a known tool>, "arguments": <valid for its schema>}``."""
    validators = _validators()
    if not isinstance(call, dict) or set(call) != {"name", "arguments"} or call["name"] not in validators:
        return False
    return validators[call["name"]].is_valid(call["arguments"])


def process_toolcall(doc: dict, results: list[str]) -> dict[str, float]:
    """``exact_match``: the generation parses to the expected call; ``valid``: it parses to a schema-valid call."""
    try:
        call = json.loads(call_text(results[0]))
    except json.JSONDecodeError:
        return {"exact_match": 0.0, "valid": 0.0}
    return {"exact_match": float(call == doc["call"]), "valid": float(valid_call(call))}
