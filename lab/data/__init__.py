"""Training data for the default model: the standard-library text corpus and the seeded mixture with the
synthetic tool calls (:mod:`phaseserve.data.toolcalls`), tokenized by :mod:`phaseserve.data.tokenizer`."""

from lab.data.corpus import Mixture, eval_windows, stdlib_files, text_stream

__all__ = ["Mixture", "eval_windows", "stdlib_files", "text_stream"]
