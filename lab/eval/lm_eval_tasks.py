"""The data of the project's local lm-evaluation-harness tasks (``lab/eval/tasks/*.yaml``), built from the default
model's own held-out data, so that lm-eval can run offline against the server with nothing from a hub.

- ``ps_toolcalls`` (``generate_until``): held-out single-turn tool-call requests (:mod:`phaseserve.data.toolcalls`,
  mix ``single``: a multi-turn history holds ``<tool_call>`` tokens, which a text prompt cannot express because the
  shipped tokenizer splits special-token text into bytes). The prompt is ``{request}\\n`` (the tokenizer prepends
  ``<bos>``, as trained); the generation is scored by ``lab/eval/tasks/utils.py``: exact match of the parsed call
  and schema validity against ``tools.json`` (the project's ``TOOLS``, checked with ``jsonschema`` as
  :func:`phaseserve.data.toolcalls.validate_call` checks them);
- ``ps_code_ppl`` (``loglikelihood_rolling``): the first ``PPL_CHUNKS`` chunks (at most ``PPL_BYTES`` bytes, cut at
  a line end) of every held-out standard-library file (:mod:`lab.data.corpus`): word and byte perplexity, bits per
  byte;
- ``ps_code_mc`` (``multiple_choice``): held-out code, which line comes next: the context is up to ``MC_CONTEXT``
  bytes of a held-out file ending at a line end, the choices are the true next line and three other lines of the same
  file (``acc``, ``acc_norm``).

Every choice is seeded and the files list is sorted, so :func:`build` writes the same bytes on any machine with the
same Python minor version (the standard library is the corpus); the committed data is checked against it
(tests/e2e/test_lm_eval.py).

    python -m lab.eval.lm_eval_tasks          # rewrites lab/eval/tasks/data/
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from lab.data.corpus import stdlib_files, stdlib_root
from phaseserve.data.toolcalls import TOOLS, examples

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
DATA_DIR = TASKS_DIR / "data"
TASKS = ("ps_toolcalls", "ps_code_ppl", "ps_code_mc")
NUM_TOOLCALLS = 200
PPL_BYTES = 900  # a chunk's bytes at most: one rolling window of the model's 1,024-token context
PPL_CHUNKS = 3  # chunks per held-out file
NUM_MC = 150
MC_CONTEXT = 600  # bytes of code before the line to choose
MC_MIN_LINE = 8  # characters (stripped) a choice line needs: no blank lines, lone brackets or `else:`
SEED = 0


def _chunks(text: str, max_bytes: int, num: int) -> list[str]:
    """The first ``num`` consecutive chunks of ``text`` of at most ``max_bytes`` UTF-8 bytes, each ending at a line
    end (a single longer line is skipped)."""
    out, cur = [], ""
    for line in text.splitlines(keepends=True):
        if len((cur + line).encode()) > max_bytes:
            if cur:
                out.append(cur)
                if len(out) == num:
                    return out
            cur = "" if len(line.encode()) > max_bytes else line
        else:
            cur += line
    if cur and len(out) < num:
        out.append(cur)
    return out


def toolcall_docs(n: int = NUM_TOOLCALLS, seed: int = SEED) -> list[dict]:
    """``n`` distinct held-out single-turn requests with the call each expects."""
    return [{"id": i, "kind": ex.kind, "prompt": ex.request + "\n", "call": ex.call, "target": ex.call_json}
            for i, ex in enumerate(examples(n, split="heldout", seed=seed, mix="single"))]


def ppl_docs(max_bytes: int = PPL_BYTES, chunks: int = PPL_CHUNKS) -> list[dict]:
    """The first ``chunks`` chunks of every held-out standard-library file."""
    root = stdlib_root()
    docs = []
    for path in stdlib_files("heldout"):
        rel = path.relative_to(root).as_posix()
        for k, text in enumerate(_chunks(path.read_text(encoding="utf-8"), max_bytes, chunks)):
            docs.append({"id": len(docs), "file": rel, "chunk": k, "text": text})
    return docs


def mc_docs(n: int = NUM_MC, seed: int = SEED, context_bytes: int = MC_CONTEXT) -> list[dict]:
    """``n`` next-line questions drawn (seeded) from the held-out files; the answer's position among the four
    choices is drawn too."""
    rng = random.Random(seed)
    root = stdlib_root()
    files = []
    for path in stdlib_files("heldout"):
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        good = [i for i in range(1, len(lines)) if len(lines[i].strip()) >= MC_MIN_LINE]
        if len({lines[i] for i in good}) >= 8:
            files.append((path.relative_to(root).as_posix(), lines, good))
    docs = []
    while len(docs) < n:
        rel, lines, good = files[rng.randrange(len(files))]
        i = rng.choice(good)
        answer = lines[i]
        context = ""
        for line in reversed(lines[:i]):
            if len((line + context).encode()) > context_bytes:
                break
            context = line + context
        others = sorted({lines[j] for j in good} - {answer})
        if not context or len(others) < 3:
            continue
        choices = rng.sample(others, 3)
        label = rng.randrange(4)
        choices.insert(label, answer)
        docs.append({"id": len(docs), "file": rel, "line": i, "context": context, "choices": choices, "label": label})
    return docs


def build(out_dir: str | Path = DATA_DIR) -> dict[str, int]:
    """Write ``<task>.jsonl`` for every task and ``tools.json`` (the tool schemas) into ``out_dir``; returns the
    number of documents per task."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for task, docs in (("ps_toolcalls", toolcall_docs()), ("ps_code_ppl", ppl_docs()), ("ps_code_mc", mc_docs())):
        (out / f"{task}.jsonl").write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
        counts[task] = len(docs)
    (out / "tools.json").write_text(json.dumps(TOOLS, indent=1, sort_keys=True) + "\n")
    return counts


if __name__ == "__main__":
    print(build())
