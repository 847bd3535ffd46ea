"""Synthetic function-calling data: tool schemas and their validation (``jsonschema``), a seeded
generator of (request in words, expected tool call) pairs with a fixed held-out split, and the parser that
reads a tool call back out of generated tokens.

A tool call is the JSON object ``{"name": <tool>, "arguments": {...}}``; an example is laid out as::

    <bos>What's the weather in Lisbon in celsius?\\n<tool_call>{"name": "get_weather", ...}</tool_call><eos>
    |--------------------- prompt ----------------|------------------- completion -------------------|

Argument values are drawn half from small fixed lists (real city names, topics, people) and half invented
(syllable names, random word pairs, random numbers), so a model cannot answer from memorised values alone:
it has to copy the argument out of the request, which is what exact match measures.

Split: a request belongs to the held-out set when the SHA-1 of its text is 0 mod 10 (about 10% of all
requests), so a held-out request never occurs in training and the split needs no stored list.

Validation (:func:`validate`, :func:`validate_call`) is the ``jsonschema`` library (JSON Schema draft 2020-12):
the whole specification, not a hand-written subset. Patterns are anchored at both ends in the schemas, because
JSON Schema's ``pattern`` matches anywhere in the string; an invalid schema raises ``jsonschema.SchemaError``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from jsonschema import Draft202012Validator

from phaseserve.data.tokenizer import ByteTokenizer

_EMAIL = r"^[a-z][a-z0-9.]*@[a-z]+\.(com|org|net)(?![\s\S])"  # anchored at both ends ($ would allow a final \n)
_CURRENCIES = {"USD": "dollars", "EUR": "euros", "GBP": "pounds", "JPY": "yen", "CHF": "swiss francs",
               "CAD": "canadian dollars", "INR": "rupees", "CNY": "yuan", "SEK": "swedish kronor", "MXN": "pesos"}

TOOLS: dict[str, dict] = {
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False},
    "convert_currency": {"type": "object", "properties": {
        "amount": {"type": "number", "minimum": 0},
        "from": {"type": "string", "enum": sorted(_CURRENCIES)},
        "to": {"type": "string", "enum": sorted(_CURRENCIES)}},
        "required": ["amount", "from", "to"], "additionalProperties": False},
    "set_timer": {"type": "object", "properties": {
        "minutes": {"type": "integer", "minimum": 1, "maximum": 1440}},
        "required": ["minutes"], "additionalProperties": False},
    "search_web": {"type": "object", "properties": {
        "query": {"type": "string", "minLength": 1}},
        "required": ["query"], "additionalProperties": False},
    "send_email": {"type": "object", "properties": {
        "to": {"type": "string", "pattern": _EMAIL},
        "subject": {"type": "string", "minLength": 1}},
        "required": ["to", "subject"], "additionalProperties": False},
}


# ---- validation ---------------------------------------------------------------------------------------
def validate(value: Any, schema: dict, path: str = "$") -> list[str]:
    """Errors of ``value`` against the JSON Schema ``schema`` (``"<json path>: <message>"``); empty when valid."""
    Draft202012Validator.check_schema(schema)
    errors = sorted(Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.absolute_path))
    return [f"{path}{e.json_path[1:]}: {e.message}" for e in errors]


def validate_call(call: Any, tools: dict[str, dict] = TOOLS) -> list[str]:
    """Errors of a parsed tool call ``{"name": ..., "arguments": {...}}`` against the tool schemas."""
    if not isinstance(call, dict):
        return [f"$: a tool call must be an object, got {type(call).__name__}"]
    extra = sorted(set(call) - {"name", "arguments"})
    if extra:
        return [f"$: unexpected keys {extra}"]
    name = call.get("name")
    if name not in tools:
        return [f"$.name: unknown tool {name!r}"]
    if "arguments" not in call:
        return ["$: missing 'arguments'"]
    return validate(call["arguments"], tools[name], "$.arguments")


# ---- examples -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolExample:
    """One request and the call that answers it."""

    request: str
    call: dict

    @property
    def call_json(self) -> str:
        return json.dumps(self.call)

    def prompt_ids(self, tok: ByteTokenizer) -> list[int]:
        """``<bos>request\\n`` — what the model is given."""
        return tok.encode(self.request + "\n", bos=True)

    def completion_ids(self, tok: ByteTokenizer) -> list[int]:
        """``<tool_call>json</tool_call><eos>`` — what it should produce."""
        return [tok.tool_start_id, *tok.encode(self.call_json), tok.tool_end_id, tok.eos_id]

    def ids(self, tok: ByteTokenizer) -> list[int]:
        return self.prompt_ids(tok) + self.completion_ids(tok)


_CITIES = ["Paris", "London", "Tokyo", "Berlin", "Madrid", "Rome", "Lisbon", "Oslo", "Cairo", "Lima", "Seoul",
           "Sydney", "Toronto", "Chicago", "Boston", "Denver", "Dublin", "Vienna", "Prague", "Warsaw", "Athens",
           "Nairobi", "Mumbai", "Delhi", "Bangkok", "Jakarta", "Manila", "Hanoi", "Istanbul", "Moscow", "Kyiv",
           "Helsinki", "Stockholm", "Zurich", "Geneva", "Munich", "Hamburg", "Seattle", "Austin", "Miami",
           "New York", "San Francisco", "Los Angeles", "Buenos Aires", "Mexico City", "Cape Town", "Hong Kong",
           "Rio de Janeiro"]
_WEATHER = ["What's the weather in {city}?", "What is the weather like in {city} in {unit}?",
            "Tell me the temperature in {city} in {unit}.", "How warm is it in {city} right now?",
            "Weather forecast for {city}, please.", "Give me the current weather in {city}, in {unit}.",
            "Is it raining in {city}?", "Check the weather for {city} using {unit}."]
_CONVERT = ["Convert {amount} {from_name} to {to_name}.", "How much is {amount} {from_code} in {to_code}?",
            "Change {amount} {from_name} into {to_name}, please.", "What are {amount} {from_code} worth in {to_name}?",
            "Exchange {amount} {from_code} to {to_code}."]
_TIMER = ["Set a timer for {m} minutes.", "Start a {m} minute timer.", "Remind me in {m} minutes.",
          "Timer: {m} minutes, please.", "Can you set a {m}-minute timer?"]
_SEARCH = ["Search the web for {q}.", "Look up {q} online.", "Find information about {q}.", "Can you google {q}?",
           "Search for {q}, please."]
_EMAIL_T = ["Send an email to {to} with the subject {s}.", "Email {to} about {s}.",
            "Write to {to} with subject \"{s}\".", "Send {to} a message titled {s}."]
_TOPICS = ["python decorators", "the history of Rome", "jax sharding", "mixture of experts models", "sourdough bread",
           "cheap flights to Oslo", "the best hiking trails", "how rainbows form", "quantum computing basics",
           "electric cars", "the tallest mountains", "vegan pasta recipes", "learning the guitar",
           "black holes", "the stock market today", "chess openings", "tomato plant care", "solar panels",
           "the French revolution", "marathon training plans", "coffee brewing methods", "ancient Egypt",
           "rust ownership rules", "paged attention", "bird migration", "the Olympic games"]
_NAMES = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy", "mallory", "oscar",
          "peggy", "trent", "victor", "wendy", "li.wei", "sam.jones", "maria.garcia", "ken.tanaka"]
_DOMAINS = ["example.com", "mail.org", "work.net", "school.org"]
_SUBJECTS = ["the quarterly report", "lunch on Friday", "the project deadline", "holiday plans", "the budget",
             "tomorrow's meeting", "the new design", "a birthday party", "the server outage", "weekend hiking",
             "the contract draft", "team offsite", "book club", "invoice 42", "the launch date"]


_SYLLABLES = ["ka", "lo", "mi", "ra", "ven", "tor", "sa", "bel", "do", "ru", "ni", "qua", "zen", "pe", "lin",
              "go", "tha", "mor", "vi", "sul", "ek", "an", "bri", "cas", "fel", "ho", "jun", "wa", "yor", "del"]
_WORDS = ["garden", "river", "copper", "winter", "yellow", "quiet", "rocket", "silver", "market", "forest", "orange",
          "planet", "engine", "castle", "tiger", "paper", "cloud", "harbor", "violin", "desert", "island", "candle",
          "mirror", "pocket", "bridge", "window", "dragon", "marble", "meadow", "thunder", "lantern", "pepper",
          "falcon", "glacier", "velvet", "compass", "puzzle", "canyon", "ember", "willow", "anchor", "basket",
          "cobalt", "dolphin", "feather", "granite", "honey", "jungle", "kettle", "lemon", "magnet", "nectar",
          "olive", "pillow", "quartz", "saddle", "timber", "umbrella", "walnut", "zebra", "recipes", "history",
          "prices", "maps", "tickets", "reviews", "schedule", "festival", "museum", "training", "repair", "tutorial"]


def _invented_name(rng: random.Random, parts: tuple[int, int] = (2, 3)) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(*parts)))


def _city(rng: random.Random) -> str:
    return rng.choice(_CITIES) if rng.random() < 0.5 else _invented_name(rng).capitalize()


def _query(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(_TOPICS)
    return " ".join(rng.sample(_WORDS, rng.randint(2, 3)))


def _address(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"{rng.choice(_NAMES)}@{rng.choice(_DOMAINS)}"
    name = _invented_name(rng) + ("." + _invented_name(rng, (1, 2)) if rng.random() < 0.3 else "")
    return f"{name}@{_invented_name(rng, (1, 2))}.{rng.choice(['com', 'org', 'net'])}"


def _subject(rng: random.Random) -> str:
    return rng.choice(_SUBJECTS) if rng.random() < 0.5 else "the " + " ".join(rng.sample(_WORDS, 2))


def _amount(rng: random.Random) -> int | float:
    r = rng.random()
    if r < 0.5:
        return rng.choice([5, 10, 20, 25, 50, 75, 100, 150, 200, 250, 500, 1000, 2500])
    if r < 0.8:
        return rng.randint(1, 999)
    return round(rng.randint(100, 99999) / 100, 2)


def sample_example(rng: random.Random) -> ToolExample:
    """One random request (uniform over the five tools)."""
    tool = rng.choice(sorted(TOOLS))
    if tool == "get_weather":
        city, unit = _city(rng), rng.choice(["celsius", "fahrenheit"])
        text = rng.choice(_WEATHER)
        args = {"city": city, "unit": unit} if "{unit}" in text else {"city": city}
        return ToolExample(text.format(city=city, unit=unit), {"name": tool, "arguments": args})
    if tool == "convert_currency":
        src, dst = rng.sample(sorted(_CURRENCIES), 2)
        amount = _amount(rng)
        text = rng.choice(_CONVERT).format(amount=json.dumps(amount), from_name=_CURRENCIES[src],
                                           to_name=_CURRENCIES[dst], from_code=src, to_code=dst)
        return ToolExample(text, {"name": tool, "arguments": {"amount": amount, "from": src, "to": dst}})
    if tool == "set_timer":
        m = rng.choice([rng.randint(1, 60), rng.randint(1, 180), rng.choice([90, 120, 240, 480, 720])])
        return ToolExample(rng.choice(_TIMER).format(m=m), {"name": tool, "arguments": {"minutes": m}})
    if tool == "search_web":
        q = _query(rng)
        return ToolExample(rng.choice(_SEARCH).format(q=q), {"name": tool, "arguments": {"query": q}})
    to, s = _address(rng), _subject(rng)
    return ToolExample(rng.choice(_EMAIL_T).format(to=to, s=s), {"name": tool, "arguments": {"to": to, "subject": s}})


def split_of(request: str) -> str:
    """``"heldout"`` for about 10% of requests (by SHA-1 of the text), else ``"train"``."""
    return "heldout" if int(hashlib.sha1(request.encode()).hexdigest(), 16) % 10 == 0 else "train"


def iter_examples(split: str, seed: int) -> Iterator[ToolExample]:
    """Endless seeded stream of the examples of one split (``"train"`` or ``"heldout"``)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(seed)
    while True:
        ex = sample_example(rng)
        if split_of(ex.request) == split:
            yield ex


def examples(n: int, split: str = "heldout", seed: int = 0, unique: bool = True) -> list[ToolExample]:
    """The first ``n`` examples of a split's stream (distinct requests when ``unique``)."""
    out: list[ToolExample] = []
    seen: set[str] = set()
    for ex in iter_examples(split, seed):
        if unique and ex.request in seen:
            continue
        seen.add(ex.request)
        out.append(ex)
        if len(out) == n:
            return out
    raise AssertionError("unreachable")


# ---- reading calls back out of generated tokens -------------------------------------------------------
def extract_call(ids: Sequence[int], tok: ByteTokenizer) -> str | None:
    """The text between the first ``<tool_call>`` and the next ``</tool_call>`` (or ``<eos>`` / the end) of a
    generation; None when it contains no ``<tool_call>``."""
    ids = [int(t) for t in ids]
    if tok.tool_start_id not in ids:
        return None
    body = ids[ids.index(tok.tool_start_id) + 1:]
    for stop in (tok.tool_end_id, tok.eos_id):
        if stop in body:
            body = body[: body.index(stop)]
    return tok.decode(body, skip_special=True)


def parse_call(ids: Sequence[int], tok: ByteTokenizer) -> tuple[dict | None, list[str]]:
    """(parsed call or None, errors): errors is empty exactly when the generation holds a schema-valid call."""
    text = extract_call(ids, tok)
    if text is None:
        return None, ["no <tool_call> in the generation"]
    try:
        call = json.loads(text)
    except json.JSONDecodeError as e:
        return None, [f"not JSON: {e}"]
    return call, validate_call(call)
