"""Show what the shipped default model does: a continuation of Python source and a tool call for a held-out
request, printed and returned. This is what the README's main command prints.

    python -c "from phaseserve.eval.demo import show_default_model; show_default_model()"

Any ``GenerateFn`` can produce the tokens (e.g. the serving engine via ``engine_generate_fn``); by default
the cached greedy reference decoder runs on the float32 weights of ``models/default``.
"""

from __future__ import annotations

from pathlib import Path

from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.data.toolcalls import examples, parse_call

TEXT_PROMPT = "class Queue:\n    def __init__(self, maxsize=0):\n        self."


def default_model_path() -> Path:
    """``models/default`` of the repository this package lives in."""
    return Path(__file__).resolve().parents[2] / "models" / "default"


def show_default_model(path: str | Path | None = None, generate_fn=None, text_prompt: str = TEXT_PROMPT,
                       request: str | None = None, text_tokens: int = 160, show=print) -> dict:
    """Generate and ``show`` (print) a text continuation and a tool call; returns them as a dict with keys
    ``text`` (prompt + continuation), ``request``, ``tool_call`` (the generated JSON text), ``valid``,
    ``errors`` and ``expected`` (the reference call when ``request`` is None and a held-out one is used)."""
    tok = ByteTokenizer()
    if generate_fn is None:
        from phaseserve.eval.cached_decode import cached_greedy_generate_fn
        from phaseserve.model.loader import load_checkpoint

        cfg, params = load_checkpoint(path or default_model_path(), "float32")
        generate_fn = cached_greedy_generate_fn(params, cfg, batch_size=2)
    expected = None
    if request is None:
        ex = examples(1, "heldout", seed=0)[0]
        request, expected = ex.request, ex.call_json
    prompts = [tok.encode(text_prompt, bos=True), tok.encode(request + "\n", bos=True)]
    text_out, call_out = generate_fn(prompts, text_tokens)
    text = text_prompt + tok.decode(text_out, skip_special=True)
    call, errors = parse_call(call_out, tok)
    call_text = tok.decode(call_out)
    show("=== text (greedy continuation of a Python prompt) ===")
    show(text)
    show("=== tool call ===")
    show(f"request:   {request}")
    show(f"generated: {call_text}")
    show(f"valid:     {not errors}" + (f"  ({'; '.join(errors)})" if errors else ""))
    if expected is not None:
        show(f"expected:  {expected}")
    return {"text": text, "request": request, "tool_call": call_text, "valid": not errors, "errors": errors,
            "call": call, "expected": expected}
