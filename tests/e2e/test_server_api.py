"""The OpenAI surface the standard tools drive (lm-eval, guidellm): completions ``echo`` + ``logprobs`` and
``max_tokens=0`` scoring, prompt lists and ``n``, fresh seeds, chat logprobs; on the shipped default model.

One server (uvicorn in a thread) over one float32 colocated engine; logprobs are compared with ``log_softmax`` of a
dense forward of the same weights (``transformer.forward``).
"""

from __future__ import annotations

import http.client
import json

import jax
import numpy as np
import pytest

import phaseserve as ps
from lab.eval.demo import default_model_path
from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.model.transformer import forward
from phaseserve.server import EngineBackend, create_app
from phaseserve.server.launch import start_in_thread

MODEL = "phaseserve-default"
TOK = ByteTokenizer()
TOL = 2e-4


@pytest.fixture(scope="module")
def server():
    cfg, params = ps.load_checkpoint(default_model_path(), "float32")
    serve = ps.ServeConfig(mode="colocated", quant=ps.QuantConfig("float32", "float32", "float32", "float32"),
                           cache=ps.CacheConfig(page_size=16, num_pages=256, max_pages_per_seq=16), max_batch=8)
    engine = ps.Engine(cfg, params, serve)
    app = create_app(EngineBackend(engine), TOK, MODEL)
    srv, thread, base = start_in_thread(app)
    yield {"port": int(base.rsplit(":", 1)[1]), "cfg": cfg, "params": params, "engine": engine}
    srv.should_exit = True
    thread.join(30)


def post(server, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=120)
    conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json"})
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def reference(server, ids: list[int]) -> np.ndarray:
    logits = forward(server["params"], server["cfg"], np.asarray([ids], np.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def test_echo_scoring_matches_a_dense_forward(server):
    """lm-eval's loglikelihood request: token ids, echo, logprobs=1, max_tokens=0."""
    ids = [TOK.bos_id, *TOK.encode("What's the weather in Paris?\n")]
    status, r = post(server, "/v1/completions", {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1,
                                                 "max_tokens": 0, "temperature": 0})
    assert status == 200, r
    [c] = r["choices"]
    lp = c["logprobs"]
    assert c["text"] == "What's the weather in Paris?\n" and c["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    assert lp["tokens"] == ["<bos>", *"What's the weather in Paris?\n"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [0, *range(len(ids) - 1)]
    ref = reference(server, ids)
    np.testing.assert_allclose(lp["token_logprobs"][1:], [ref[t - 1, ids[t]] for t in range(1, len(ids))], atol=TOL)
    for t in range(1, len(ids)):
        [(tok, v)] = lp["top_logprobs"][t].items()
        best = int(np.argmax(ref[t - 1]))
        assert tok == TOK.decode([best]) and abs(v - ref[t - 1, best]) < TOL


def test_string_prompt_gets_bos_and_generated_logprobs(server):
    prompt = "What's the weather in Paris?\n"
    status, r = post(server, "/v1/completions", {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 4,
                                                 "temperature": 0, "ignore_eos": True})
    assert status == 200, r
    [c] = r["choices"]
    ids = TOK.encode(prompt, bos=True)
    assert r["usage"]["prompt_tokens"] == len(ids)  # <bos> first, as the model was trained
    lp = c["logprobs"]
    assert c["text"].startswith(prompt) and len(lp["tokens"]) == len(ids) + 4
    gen = [TOK.encode(t)[0] if not t.startswith("<") else TOK.special_ids[t] for t in lp["tokens"][len(ids):]]
    ref = reference(server, ids + gen)
    for j, t in enumerate(gen):
        row = ref[len(ids) - 1 + j]
        assert t == int(np.argmax(row))  # greedy
        assert abs(lp["token_logprobs"][len(ids) + j] - row[t]) < TOL
        assert len(lp["top_logprobs"][len(ids) + j]) == 2
    assert lp["text_offset"][len(ids)] == len(prompt)


def test_prompt_lists_and_n_give_ordered_choices_with_their_seeds(server):
    body = {"prompt": [[TOK.bos_id, 72, 105], [TOK.bos_id, 79, 107]], "n": 2, "max_tokens": 6, "seed": 11,
            "temperature": 1.0, "ignore_eos": True}
    status, r = post(server, "/v1/completions", body)
    assert status == 200, r
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert [c["seed"] for c in r["choices"]] == [11, 12, 11, 12]
    assert r["usage"] == {"prompt_tokens": 6, "completion_tokens": 24, "total_tokens": 30}
    status, again = post(server, "/v1/completions", body)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in r["choices"]]  # seeded: reproducible
    status, strs = post(server, "/v1/completions", {"prompt": ["Hi", "Ok"], "max_tokens": 1})
    assert status == 200 and len(strs["choices"]) == 2


def test_unseeded_sampling_draws_a_fresh_seed_per_request(server):
    body = {"prompt": "Tell me", "max_tokens": 12, "temperature": 1.0, "ignore_eos": True, "n": 3}
    seeds, texts = set(), set()
    for _ in range(2):
        status, r = post(server, "/v1/completions", body)
        assert status == 200, r
        seeds |= {c["seed"] for c in r["choices"]}
        texts |= {c["text"] for c in r["choices"]}
    assert len(seeds) == 6 and len(texts) >= 2  # before: one seed (0) and one text for all six
    # the reported seed reproduces its choice
    c = r["choices"][0]
    status, one = post(server, "/v1/completions", {**body, "n": 1, "seed": c["seed"]})
    assert one["choices"][0]["text"] == c["text"]


def test_chat_logprobs(server):
    status, r = post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What's the weather in Paris?"}], "logprobs": True,
        "top_logprobs": 3, "max_tokens": 5, "temperature": 0, "n": 2})
    assert status == 200, r
    assert [c["index"] for c in r["choices"]] == [0, 1]
    for c in r["choices"]:
        content = c["logprobs"]["content"]
        assert len(content) == r["usage"]["completion_tokens"] // 2
        for item in content:
            assert len(item["top_logprobs"]) == 3
            assert item["logprob"] == max(t["logprob"] for t in item["top_logprobs"])  # greedy
            assert item["bytes"] == list(item["token"].encode()) or item["token"].startswith(("bytes:", "<"))


@pytest.mark.parametrize("body,needle", [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": 1, "stream": True}, "logprobs with stream"),
    ({"prompt": [], "max_tokens": 1}, "prompt"),
    ({"prompt": [[1], []], "max_tokens": 1}, "prompt"),
])
def test_completion_field_refusals(server, body, needle):
    status, r = post(server, "/v1/completions", body)
    assert status == 400 and needle in r["error"]["message"], r
