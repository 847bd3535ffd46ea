"""Data for the default model: the byte-level tokenizer, the standard-library text corpus and the synthetic
tool-call set (schemas, validator, held-out requests), mixed into seeded training batches."""

from phaseserve.data.corpus import Mixture, eval_windows, stdlib_files, text_stream
from phaseserve.data.tokenizer import VOCAB_SIZE, ByteTokenizer
from phaseserve.data.toolcalls import (
    TOOLS,
    ToolExample,
    examples,
    extract_call,
    iter_examples,
    parse_call,
    sample_example,
    validate,
    validate_call,
)

__all__ = [
    "TOOLS", "VOCAB_SIZE", "ByteTokenizer", "Mixture", "ToolExample", "eval_windows", "examples", "extract_call",
    "iter_examples", "parse_call", "sample_example", "stdlib_files", "text_stream", "validate", "validate_call",
]
