"""What the main job (``experiments/serve.py``) prints: the engine it built, what the shipped default model generates
(a continuation of Python source and a tool call for a held-out request) and what the run measured.

    python -c "from lab.eval.demo import show_default_model; show_default_model()"

- :func:`show_default_model`: generate and print the two examples with any ``GenerateFn`` (e.g. the serving engine
  via ``engine_generate_fn``; by default the cached greedy reference decoder on the float32 weights).
- :func:`describe_engine`: the header line -- which devices and weight representation each phase really uses.
- :func:`measured_lines`: the closing summary -- tok/s, TTFT and TPOT p50/p95, KV pages and bytes per token,
  integrity checks run -- from ``engine.summary()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.data.toolcalls import examples, parse_call

TEXT_PROMPT = "class Queue:\n    def __init__(self, maxsize=0):\n        self."
VALID_MEANS = "parses as JSON, names a known tool, arguments match that tool's JSON schema"


def default_model_path() -> Path:
    """``models/default`` of the repository this package lives in."""
    return Path(__file__).resolve().parents[2] / "models" / "default"


def _tidy(text: str) -> str:
    """Trailing blanks stripped from every line and trailing empty lines dropped (the model pads with spaces)."""
    return "\n".join(line.rstrip() for line in text.splitlines()).rstrip("\n")


def show_default_model(path: str | Path | None = None, generate_fn=None, text_prompt: str = TEXT_PROMPT,
                       request: str | None = None, text_tokens: int = 160, show=print) -> dict:
    """Generate and ``show`` (print) a text continuation and a tool call; returns them as a dict with keys
    ``text`` (prompt + continuation), ``request``, ``tool_call`` (the generated text), ``valid`` (schema-valid,
    see :data:`VALID_MEANS`), ``errors``, ``call``, ``expected`` (the reference call when ``request`` is None and
    a held-out one is used) and ``exact`` (the parsed call equals the expected one; None without a reference)."""
    tok = ByteTokenizer()
    if generate_fn is None:
        from lab.eval.cached_decode import cached_greedy_generate_fn
        from phaseserve.quant.loader import load_checkpoint

        cfg, params = load_checkpoint(path or default_model_path(), "float32")
        generate_fn = cached_greedy_generate_fn(params, cfg, batch_size=2)
    expected = expected_call = None
    if request is None:
        ex = examples(1, "heldout", seed=0)[0]
        request, expected, expected_call = ex.request, ex.call_json, ex.call
    prompts = [tok.encode(text_prompt, bos=True), tok.encode(request + "\n", bos=True)]
    text_out, call_out = generate_fn(prompts, text_tokens)
    text = text_prompt + tok.decode(text_out, skip_special=True)
    call, errors = parse_call(call_out, tok)
    call_text = tok.decode(call_out)
    exact = None if expected_call is None else (not errors and call == expected_call)
    show(f"=== text (greedy continuation of a Python prompt, {len(text_out)} tokens) ===")
    show(_tidy(text))
    show("=== tool call ===")
    show(f"request:   {request}")
    show(f"generated: {call_text}")
    show(f"valid:     {'yes' if not errors else 'no'} ({VALID_MEANS})" + (f": {'; '.join(errors)}" if errors else ""))
    if expected is not None:
        show(f"expected:  {expected}")
        show(f"exact:     {_exactness(call, expected_call, exact)}")
    return {"text": text, "request": request, "tool_call": call_text, "valid": not errors, "errors": errors,
            "call": call, "expected": expected, "exact": exact}


def _exactness(call: Any, expected: dict, exact: bool) -> str:
    if exact:
        return "yes (same tool, same argument values as expected)"
    if not isinstance(call, dict) or call.get("name") != expected.get("name"):
        return "no (not the expected tool)"
    return "no (the expected tool, other argument values)"


def _devices(mesh: Any) -> str:
    return ",".join(f"{d.platform}:{d.id}" for d in mesh.devices.flat)


def describe_engine(engine: Any, path: str | Path) -> str:
    """One header line saying what each phase really runs on: in colocated mode one mesh and one weight copy
    (``decode_weights``) serve both phases, so ``prefill_weights`` is reported as unused."""
    q, cfg = engine.serve.quant, engine.cfg
    kv = f"KV {engine.kv_dtype} in {engine.num_pages} pages of {engine.serve.cache.page_size} tokens"
    head = f"model: {path} ({cfg.architecture})"
    if engine.serve.mode == "colocated":
        unused = f" (prefill_weights={q.prefill_weights} unused)" if q.prefill_weights != q.decode_weights else ""
        return (f"{head}; mode colocated: one mesh ({_devices(engine.decode_mesh)}) and one weight copy in "
                f"{q.decode_weights} for both phases{unused}; {kv}")
    return (f"{head}; mode disaggregated: prefill on {_devices(engine.prefill_mesh)} with {q.prefill_weights} "
            f"weights, decode on {_devices(engine.decode_mesh)} with {q.decode_weights} weights; {kv}")


def _ms(p: dict, key: str) -> str:
    return "n/a" if p[key] is None else f"{p[key] * 1e3:.1f}"


def measured_lines(engine: Any, note: str = "") -> list[str]:
    """The closing summary of a run from ``engine.summary()`` (times in ms; ``note`` says what was timed)."""
    from phaseserve.cache.paged import kv_bytes_per_token

    s = engine.summary()
    bpt = kv_bytes_per_token(engine.cfg, engine.kv_dtype)
    bf16 = kv_bytes_per_token(engine.cfg, "bfloat16")
    integrity = (f"{s['integrity_checks']} page-tag row checks before decode steps, {s['aborted']} aborted"
                 if engine.tracker.enabled else "off (cache.integrity=false)")
    return [
        f"=== measured{f' ({note})' if note else ''} ===",
        f"throughput:  {s['output_tok_per_s']:.1f} output tok/s ({s['output_tokens']} tokens of {s['requests']} "
        f"requests in {s['wall_s']:.2f} s, {s['decode_steps']} decode steps)",
        f"TTFT:        p50 {_ms(s['ttft'], 'p50')} ms, p95 {_ms(s['ttft'], 'p95')} ms",
        f"TPOT:        p50 {_ms(s['tpot'], 'p50')} ms, p95 {_ms(s['tpot'], 'p95')} ms",
        f"KV cache:    {engine.kv_dtype}, {bpt} bytes per token ({bpt / bf16:.2f}x bfloat16's {bf16}); "
        f"peak {s['peak_pages_in_use']} of {engine.num_pages - 1} pages in use",
        f"integrity:   {integrity}",
    ]
