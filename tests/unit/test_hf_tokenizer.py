"""A checkpoint's own Hugging Face tokenizer without ``transformers`` (issue 62): :class:`HFTokenizer` reads
``tokenizer.json`` with ``tokenizers`` and renders the chat template with jinja2, and agrees with transformers'
``AutoTokenizer`` -- ids, decoded text, special ids, chat prompts with and without offered tools -- on a word-level
(SentencePiece-style) tokenizer and a byte-level BPE one; a fresh interpreter in which ``transformers`` cannot be
imported serves such a checkpoint over HTTP; the default model's earlier ``tokenizer.json`` format still loads."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from phaseserve.data.chat_template import render
from phaseserve.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

WORDS = [f"\u2581{a}" for a in "abcdefghijklmnopqrstuvwxyz"] + [f"\u2581{a}{b}" for a in "aeiou" for b in "nrst"]
# a template in the style of the Qwen / Llama 3 ones: tojson with indent, loop controls, raise_exception, tools
RICH_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>tools:\n{% for t in tools %}{{ t | tojson(indent=2) }}\n{% endfor %}"
    "{% endif %}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% if loop.index0 > 8 %}{% break %}{% endif %}\n<|{{ m['role'] }}|>\n  {{ m['content'] | trim }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
SIMPLE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                   "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "convert", "description": "Währung umrechnen",
                                           "parameters": {"type": "object", "properties": {"amount": {
                                               "type": "number"}}}}}]
CHATS = [[{"role": "system", "content": "a b"}, {"role": "user", "content": "ar es c"}],
         [{"role": "user", "content": " on  it "}, {"role": "assistant", "content": "a"}, {"role": "user",
                                                                                           "content": "b"}]]


def word_level_tokenizer(directory, template: str):
    """A SentencePiece-style word-level tokenizer (vocab 96: ``<s>`` post-processor, ``▁``-words, chat specials)
    saved with ``template`` in ``directory``; the transformers tokenizer that wrote it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    vocab.update({f"<extra{i}>": i for i in range(len(vocab), 96)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                 additional_special_tokens=specials[3:])
    hf.chat_template = template
    hf.save_pretrained(directory)
    return hf


def _byte_bpe(directory, template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = np.random.default_rng(0)
    words = ["tool", "call", "amount", "währung", "def", "return", "value", " ", "\n", "{", "}", ":", "é"]
    corpus = ["".join(rng.choice(words, 20)) for _ in range(200)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    hf.chat_template = template
    hf.save_pretrained(directory)
    return hf


def _ids(x) -> list[int]:
    return list(x["input_ids"] if hasattr(x, "keys") else x)


@pytest.mark.parametrize("make", [word_level_tokenizer, _byte_bpe], ids=["word-level", "byte-bpe"])
@pytest.mark.parametrize("template", [SIMPLE_TEMPLATE, RICH_TEMPLATE], ids=["simple", "rich"])
def test_hf_tokenizer_agrees_with_transformers(tmp_path, make, template):
    hf = make(tmp_path, template)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == len(hf)
    assert (tok.bos_id, tok.eos_id) == (hf.bos_token_id, hf.eos_token_id)
    assert {i for i in range(len(hf)) if tok.is_special(i)} == set(hf.all_special_ids)
    rng = np.random.default_rng(1)
    for text in ["a b c", "ar es  on", "tool call währung é", "x"]:
        for bos in (False, True):
            assert tok.encode(text, bos=bos) == hf(text, add_special_tokens=bos)["input_ids"], (text, bos)
    for _ in range(20):
        ids = [int(t) for t in rng.integers(0, len(hf), 12)]
        for skip in (False, True):
            assert tok.decode(ids, skip_special=skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)
    for chat in CHATS:
        for tools in (None, TOOLS):
            want = _ids(hf.apply_chat_template(chat, tools=tools, add_generation_prompt=True, tokenize=True))
            assert tok.chat_ids(chat, tools) == want, (chat, tools)
    assert tok.info()["chat_template"] == template


def test_a_template_that_refuses_or_breaks_is_a_value_error():
    with pytest.raises(ValueError, match="unknown role tool"):
        render(RICH_TEMPLATE, [{"role": "tool", "content": "x"}], bos_token="<s>")
    with pytest.raises(ValueError, match="does not compile"):
        render("{% for m in messages %}", [])
    with pytest.raises(ValueError, match="failed"):  # the sandbox refuses attribute access to internals
        render("{{ messages.__class__.__mro__ }}", [])


SERVE_WITHOUT_TRANSFORMERS = """
import http.client, json, sys
sys.modules["transformers"] = None  # any import of it raises ImportError, as after the README's install
from phaseserve.server.launch import build_backend, compose, start_in_thread, tokenizer_of
from phaseserve.server import create_app
cfg = compose(["model.checkpoint=%s", "quant=f32", "engine.mode=colocated", "engine.max_batch=2",
               "cache.num_pages=64"])
tok = tokenizer_of(cfg)
srv, thread, base = start_in_thread(create_app(build_backend(cfg), tok, "tiny"))
conn = http.client.HTTPConnection("127.0.0.1", int(base.rsplit(":", 1)[1]), timeout=120)
body = {"model": "tiny", "messages": %r, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"content-type": "application/json"})
r = conn.getresponse()
reply = json.loads(r.read())
srv.should_exit = True
thread.join(30)
print(json.dumps([type(tok).__name__, r.status, reply["usage"]["prompt_tokens"], tok.chat_ids(%r, %r)]))
"""


def test_a_checkpoint_is_served_without_transformers(tmp_path):
    """A fresh interpreter in which ``import transformers`` fails (the README's install does not bring it) serves a
    checkpoint with its own word-level tokenizer and chat template through the HTTP server: the chat is answered,
    its prompt is transformers' (with and without tools)."""
    from tests.parity.hf_models import build

    hf = word_level_tokenizer(tmp_path, RICH_TEMPLATE)
    build("llama", tmp_path, seed=4)
    want = _ids(hf.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True))
    want_tools = _ids(hf.apply_chat_template(CHATS[0], tools=TOOLS, add_generation_prompt=True, tokenize=True))
    code = SERVE_WITHOUT_TRANSFORMERS % (tmp_path, CHATS[0], CHATS[0], TOOLS)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    name, status, prompt_tokens, ids = json.loads(out.stdout.strip().splitlines()[-1])
    assert (name, status, prompt_tokens) == ("HFTokenizer", 200, len(want))
    assert ids == want_tools


def test_the_default_models_earlier_tokenizer_format_loads(tmp_path):
    """``models/default/tokenizer.json`` as shipped before a797108 (the project's own format) is the byte-level
    tokenizer, not an error (it fell through to the Hugging Face path and failed with ``KeyError: 'added_tokens'``)."""
    tok = ByteTokenizer()
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "type": "byte_level", "vocab_size": 264, "bytes": "ids 0..255 are the UTF-8 byte values",
        "special_tokens": tok.special_ids, "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}))
    assert load_tokenizer(tmp_path) == tok
    (tmp_path / "tokenizer.json").write_text(json.dumps({"type": "byte_level", "vocab_size": 264,
                                                         "special_tokens": {"<bos>": 1}}))
    with pytest.raises(ValueError, match="special token ids"):
        ByteTokenizer.load(tmp_path)
