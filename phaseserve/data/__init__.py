"""Data the server needs: the byte-level tokenizer and the synthetic tool-call set (schemas, validator, parser).
The training corpus (standard-library text and the seeded mixture) is lab code: :mod:`lab.data.corpus`."""

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
    "TOOLS", "VOCAB_SIZE", "ByteTokenizer", "ToolExample", "examples", "extract_call", "iter_examples", "parse_call",
    "sample_example", "validate", "validate_call",
]
