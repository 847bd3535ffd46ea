"""Evaluation through generation, against a pluggable ``generate_fn`` so that any generator — the reference
below or the serving engine (``Engine.generate`` wrapped by :func:`engine_generate_fn`) — is judged the same way.

``GenerateFn``: ``generate_fn(prompts, max_tokens) -> list[list[int]]`` takes token-id prompts and returns,
for each, the generated ids only (not the prompt), ending with the stop token when one was produced.

- :func:`greedy_generate_fn` — the oracle: greedy decoding by full recompute with ``ps.forward`` (no
  cache) inside one jitted ``while_loop`` over a fixed padded buffer, so one compile serves a whole batch
  (``lab.eval.cached_decode.cached_greedy_generate_fn`` is the fast cached equivalent);
- :func:`heldout_perplexity` — perplexity on fixed held-out windows of standard-library text;
- :func:`evaluate_tool_calls` — tool-call validity and exact match on held-out requests;
- :func:`generation_agreement` — token / sequence match between two generators on the same prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lab.data.corpus import eval_windows
from lab.eval.metrics import mean_nll, sequence_match_rate, token_match_rate
from phaseserve.config import ModelConfig, SequenceTooLongError
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.data.toolcalls import ToolExample, parse_call
from phaseserve.model.transformer import forward

GenerateFn = Callable[[list[list[int]], int], list[list[int]]]
LogitsFn = Callable[[Any, jax.Array], jax.Array]  # (params, tokens i32[B, T]) -> f32[B, T, V]


def batched_generate_fn(run: Callable, params, cfg: ModelConfig, *, pad: int, bucket: int,
                        batch_size: int) -> GenerateFn:
    """The host side shared by the reference generators: prompts go ``batch_size`` at a time into a buffer
    i32[batch_size, L] (left-aligned, ``pad`` after, L a multiple of ``bucket``) and through the jitted
    ``run(params, buf, lengths, active, max_new) -> (buf, lengths)``; returns each prompt's new tokens."""

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        need = max((len(p) for p in prompts), default=0) + max_tokens
        if need > cfg.max_position_embeddings:
            raise SequenceTooLongError(f"prompt + max_tokens = {need} exceeds the model's "
                                       f"{cfg.max_position_embeddings} positions")
        width = min(-(-need // bucket) * bucket, cfg.max_position_embeddings)
        out: list[list[int]] = []
        for s in range(0, len(prompts), batch_size):
            chunk = prompts[s: s + batch_size]
            buf = np.full((batch_size, width), pad, np.int32)
            lengths = np.ones(batch_size, np.int32)
            active = np.zeros(batch_size, bool)
            for r, p in enumerate(chunk):
                buf[r, : len(p)] = p
                lengths[r], active[r] = len(p), True
            res, new_len = jax.device_get(run(params, buf, lengths, active, np.int32(max_tokens)))
            out += [res[r, len(p): int(new_len[r])].tolist() for r, p in enumerate(chunk)]
        return out

    return generate


def greedy_generate_fn(params, cfg: ModelConfig, *, stop_ids: Sequence[int] | None = None, batch_size: int = 16,
                       pad_id: int | None = None, bucket: int = 32, logits_fn: LogitsFn | None = None) -> GenerateFn:
    """Reference greedy generator (see module docstring). ``stop_ids`` default to ``cfg.eos_token_ids``;
    prompts are run ``batch_size`` at a time in a buffer padded to a multiple of ``bucket`` tokens."""
    stops = jnp.asarray(list(stop_ids if stop_ids is not None else cfg.eos_token_ids) or [-1], jnp.int32)
    pad = ByteTokenizer().pad_id if pad_id is None else pad_id
    logits_fn = logits_fn or (lambda p, t: forward(p, cfg, t))

    @jax.jit
    def run(params, buf, lengths, active, max_new):
        """buf i32[B, L] (prompts left-aligned, pad after), lengths i32[B] (>= 1), active bool[B] (False for
        batch-padding rows), max_new i32[] -> (buf, lengths) after at most max_new greedy tokens per row."""
        rows = jnp.arange(buf.shape[0])

        def cond(state):
            _, _, done, i = state
            return (i < max_new) & ~jnp.all(done)

        def body(state):
            buf, lengths, done, i = state
            logits = logits_fn(params, buf)  # f32[B, L, V]
            nxt = jnp.argmax(logits[rows, lengths - 1], axis=-1).astype(jnp.int32)
            at = jnp.minimum(lengths, buf.shape[1] - 1)  # finished rows rewrite a token they already hold
            buf = buf.at[rows, at].set(jnp.where(done, buf[rows, at], nxt))
            lengths = lengths + (~done).astype(jnp.int32)
            done = done | jnp.isin(nxt, stops)
            return buf, lengths, done, i + 1

        buf, lengths, _, _ = jax.lax.while_loop(cond, body, (buf, lengths, ~active, jnp.int32(0)))
        return buf, lengths

    return batched_generate_fn(run, params, cfg, pad=pad, bucket=bucket, batch_size=batch_size)


def engine_generate_fn(engine: Any, temperature: float = 0.0) -> GenerateFn:
    """Wrap a ``ps.Engine`` (``engine.generate([ps.Request(...)])``) as a ``GenerateFn``."""
    import phaseserve as ps

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        reqs = [ps.Request(id=f"eval{i}", prompt=list(p), max_tokens=max_tokens, temperature=temperature)
                for i, p in enumerate(prompts)]
        outs = engine.generate(reqs)
        return [list(o.tokens) for o in outs]

    return generate


def heldout_perplexity(params, cfg: ModelConfig, windows: np.ndarray | None = None, batch_size: int = 16,
                       logits_fn: LogitsFn | None = None) -> dict[str, float]:
    """Perplexity on held-out text. windows i32[N, T + 1] (default: :func:`eval_windows` of the held-out
    standard-library files at T = min(256, max positions)). Returns ``{"nll", "ppl", "bits_per_byte", "tokens"}``;
    ``nll`` is the token-weighted mean in nats (positions whose target is ``<pad>`` do not count)."""
    if windows is None:
        windows = eval_windows("heldout", seq_len=min(256, cfg.max_position_embeddings))
    logits_fn = logits_fn or jax.jit(lambda p, t: forward(p, cfg, t))
    pad = ByteTokenizer().pad_id
    total, count = 0.0, 0
    for s in range(0, len(windows), batch_size):
        w = np.asarray(windows[s: s + batch_size])
        mask = (w[:, 1:] != pad).astype(np.float32)
        n = float(mask.sum())
        if n:
            total += mean_nll(logits_fn(params, jnp.asarray(w[:, :-1])), w[:, 1:], mask) * n
            count += int(n)
    nll = total / count
    return {"nll": nll, "ppl": float(np.exp(nll)), "bits_per_byte": nll / np.log(2), "tokens": count}


@dataclass
class ToolCallReport:
    """Outcome of :func:`evaluate_tool_calls`. Rates are fractions of ``n`` requests."""

    n: int
    validity: float  # a call that parses as JSON and matches its tool's schema
    exact_match: float  # ... and equals the expected call (parsed JSON compared as values)
    has_call: float  # a <tool_call> marker was produced at all
    argument_accuracy: float = 0.0  # expected argument values (nested leaves) reproduced, of all expected ones
    exact_by_kind: dict[str, float] = field(default_factory=dict)  # exact match per ToolExample.kind
    failures: list[dict] = field(default_factory=list)  # the first few invalid / wrong generations
    exact: list[bool] = field(default_factory=list)  # per request, for confidence intervals
    valid: list[bool] = field(default_factory=list)
    argument_hits: list[tuple[int, int]] = field(default_factory=list)  # per request: (values reproduced, expected)

    def as_dict(self) -> dict:
        return {"n": self.n, "validity": self.validity, "exact_match": self.exact_match, "has_call": self.has_call,
                "argument_accuracy": self.argument_accuracy, "exact_by_kind": self.exact_by_kind}


def _leaves(args: dict, prefix: tuple = ()) -> dict[tuple, Any]:
    """Nested argument values by path: {"when": {"date": d}} -> {("when", "date"): d}."""
    out: dict[tuple, Any] = {}
    for k, v in args.items():
        out.update(_leaves(v, (*prefix, k)) if isinstance(v, dict) and v else {(*prefix, k): v})
    return out


def argument_hits(call: Any, expected: dict) -> tuple[int, int]:
    """(expected argument values the call reproduces at the same path, expected values); none for another tool."""
    want = _leaves(expected["arguments"])
    if not isinstance(call, dict) or call.get("name") != expected["name"] or not isinstance(call.get("arguments"),
                                                                                           dict):
        return 0, len(want)
    got = _leaves(call["arguments"])
    return sum(path in got and got[path] == v for path, v in want.items()), len(want)


def score_tool_calls(generations: Sequence[Sequence[int]], examples: Sequence[ToolExample],
                     tok: ByteTokenizer | None = None, keep_failures: int = 5) -> ToolCallReport:
    """Score given generations (one per example) for validity, exact match and argument accuracy."""
    tok = tok or ByteTokenizer()
    if len(generations) != len(examples) or not examples:
        raise ValueError(f"need one generation per example, got {len(generations)} for {len(examples)}")
    has = 0
    exact, valid, hits = [], [], []
    failures: list[dict] = []
    for gen, ex in zip(generations, examples, strict=True):
        call, errors = parse_call(gen, tok)
        has += tok.tool_start_id in gen
        valid.append(not errors)
        exact.append(not errors and call == ex.call)
        hits.append(argument_hits(call, ex.call))
        if not exact[-1] and len(failures) < keep_failures:
            failures.append({"request": ex.request, "kind": ex.kind, "expected": ex.call_json, "errors": errors,
                             "generated": tok.decode(gen)})
    n = len(examples)
    kinds = sorted({ex.kind for ex in examples})
    by_kind = {k: float(np.mean([e for e, ex in zip(exact, examples, strict=True) if ex.kind == k])) for k in kinds}
    return ToolCallReport(n=n, validity=sum(valid) / n, exact_match=sum(exact) / n, has_call=has / n,
                          argument_accuracy=sum(h for h, _ in hits) / max(1, sum(t for _, t in hits)),
                          exact_by_kind=by_kind, failures=failures, exact=exact, valid=valid, argument_hits=hits)


def evaluate_tool_calls(generate_fn: GenerateFn, examples: Sequence[ToolExample], max_tokens: int = 112,
                        tok: ByteTokenizer | None = None) -> ToolCallReport:
    """Generate a call for every held-out request (prompt ``<bos>[history]request\\n``) and score it. Single
    requests and conversations are generated apart (a conversation's long prompt would widen every row)."""
    tok = tok or ByteTokenizer()
    order = sorted(range(len(examples)), key=lambda i: examples[i].kind == "multi_turn")
    groups = [[i for i in order if (examples[i].kind == "multi_turn") == long] for long in (False, True)]
    gens: dict[int, list[int]] = {}
    for group in groups:
        if group:
            gens.update(zip(group, generate_fn([examples[i].prompt_ids(tok) for i in group], max_tokens),
                            strict=True))
    return score_tool_calls([gens[i] for i in range(len(examples))], examples, tok)


def generation_agreement(ref_fn: GenerateFn, test_fn: GenerateFn, prompts: list[list[int]],
                         max_tokens: int) -> dict[str, float]:
    """Greedy agreement of two generators on the same prompts: ``{"token_match", "sequence_match"}``."""
    ref, test = ref_fn(prompts, max_tokens), test_fn(prompts, max_tokens)
    return {"token_match": token_match_rate(ref, test), "sequence_match": sequence_match_rate(ref, test)}
