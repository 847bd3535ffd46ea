"""Quality evaluation: metrics on logits and generations, and generation-based evaluation (held-out
perplexity, tool-call validity and exact match, greedy agreement) against a pluggable ``generate_fn``."""

from lab.eval.cached_decode import cached_greedy_generate_fn
from lab.eval.demo import default_model_path, show_default_model
from lab.eval.generation import (
    GenerateFn,
    ToolCallReport,
    engine_generate_fn,
    evaluate_tool_calls,
    generation_agreement,
    greedy_generate_fn,
    heldout_perplexity,
    score_tool_calls,
)
from lab.eval.metrics import (
    first_divergence,
    kl_divergence,
    mean_nll,
    perplexity,
    sequence_match_rate,
    token_match_rate,
    token_nll,
    top1_agreement,
)

__all__ = [
    "GenerateFn", "ToolCallReport", "cached_greedy_generate_fn", "default_model_path", "engine_generate_fn",
    "evaluate_tool_calls", "first_divergence", "generation_agreement", "greedy_generate_fn", "heldout_perplexity",
    "kl_divergence", "mean_nll", "perplexity", "score_tool_calls", "sequence_match_rate", "show_default_model",
    "token_match_rate", "token_nll", "top1_agreement",
]
