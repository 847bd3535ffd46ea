"""Synthetic function-calling data: tool schemas and their validation (``jsonschema``), a seeded
generator of (request in words, expected tool call) pairs with a fixed held-out split, and the parser that
reads a tool call back out of generated tokens.

A tool call is the JSON object ``{"name": <tool>, "arguments": {...}}``; an example is laid out as::

    <bos>What's the weather in Lisbon in celsius?\\n<tool_call>{"name": "get_weather", ...}</tool_call><eos>
    |--------------------- prompt ----------------|------------------- completion -------------------|

Argument values are drawn half from small fixed lists (real city names, topics, people) and half invented
(syllable names, random word pairs, random numbers), so a model cannot answer from memorised values alone:
it has to copy the argument out of the request, which is what exact match measures. Every argument value is
written in the request (or, for an enum, named there), so copying is always enough.

Kinds of example (``KINDS``) and the mixes drawn from them (``MIXES``):

- ``basic``: the five original tools (the stream the first shipped model was trained and measured on);
- ``long``: ``add_note`` / long ``search_web`` queries, an argument of at least 40 characters copied whole;
- ``numbers``: ``set_thermostat`` (signed decimals) and large / decimal currency amounts;
- ``multi_arg``: ``book_flight``, five arguments (two places, a date, a count, an enum);
- ``nested``: ``create_event``, a nested ``when`` object and an integer;
- ``multi_turn``: a conversation -- a note naming a value, at least ``FAR_TOKENS`` tokens of earlier answered
  requests, then a request that refers back to the note; the argument must be copied from far back.

A multi-turn example is laid out as the server's chat format renders it (``phaseserve.server.chat``)::

    <bos>Note: my home city is Kalora.\n{request}\n<tool_call>{json}</tool_call><eos>...{request}\n<tool_call>..

Split: a request belongs to the held-out set when the SHA-1 of its text (for a conversation: every message)
is 0 mod 10 (about 10% of all requests), so a held-out request never occurs in training and the split needs no
stored list.

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
_DATE = r"^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])(?![\s\S])"
_TIME = r"^([01][0-9]|2[0-3]):[0-5][0-9](?![\s\S])"
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
    "add_note": {"type": "object", "properties": {
        "text": {"type": "string", "minLength": 1}},
        "required": ["text"], "additionalProperties": False},
    "set_thermostat": {"type": "object", "properties": {
        "room": {"type": "string", "minLength": 1},
        "temperature": {"type": "number", "minimum": -30, "maximum": 40}},
        "required": ["room", "temperature"], "additionalProperties": False},
    "book_flight": {"type": "object", "properties": {
        "origin": {"type": "string", "minLength": 1},
        "destination": {"type": "string", "minLength": 1},
        "date": {"type": "string", "pattern": _DATE},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "cabin": {"type": "string", "enum": ["economy", "business", "first"]}},
        "required": ["origin", "destination", "date", "passengers", "cabin"], "additionalProperties": False},
    "create_event": {"type": "object", "properties": {
        "title": {"type": "string", "minLength": 1},
        "when": {"type": "object", "properties": {
            "date": {"type": "string", "pattern": _DATE},
            "time": {"type": "string", "pattern": _TIME}},
            "required": ["date", "time"], "additionalProperties": False},
        "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 600}},
        "required": ["title", "when", "duration_minutes"], "additionalProperties": False},
}
BASIC_TOOLS = ("convert_currency", "get_weather", "search_web", "send_email", "set_timer")


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
    """One request and the call that answers it, after ``history``: earlier messages of the conversation, each
    ``(text, call)`` (``call`` None for a message with no answer, e.g. a note)."""

    request: str
    call: dict
    history: tuple[tuple[str, dict | None], ...] = ()
    kind: str = "basic"  # one of KINDS

    @property
    def call_json(self) -> str:
        return json.dumps(self.call)

    @property
    def key(self) -> str:
        """The text that decides the split and uniqueness: every message of the conversation."""
        return "\n".join([*(m for m, _ in self.history), self.request])

    def prompt_ids(self, tok: ByteTokenizer) -> list[int]:
        """``<bos>[history]request\\n`` — what the model is given (history as the server's chat renders it)."""
        ids = [tok.bos_id]
        for text, call in self.history:
            ids += tok.encode(text + "\n")
            if call is not None:
                ids += [tok.tool_start_id, *tok.encode(json.dumps(call)), tok.tool_end_id, tok.eos_id]
        return ids + tok.encode(self.request + "\n")

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


def _basic(rng: random.Random) -> ToolExample:
    """One request to one of the five original tools (uniform)."""
    tool = rng.choice(BASIC_TOOLS)
    if tool == "get_weather":
        city, unit = _city(rng), rng.choice(["celsius", "fahrenheit"])
        text = rng.choice(_WEATHER)
        args = {"city": city, "unit": unit} if "{unit}" in text else {"city": city}
        return ToolExample(text.format(city=city, unit=unit), {"name": tool, "arguments": args})
    if tool == "convert_currency":
        return _convert(rng, _amount(rng))
    if tool == "set_timer":
        m = rng.choice([rng.randint(1, 60), rng.randint(1, 180), rng.choice([90, 120, 240, 480, 720])])
        return ToolExample(rng.choice(_TIMER).format(m=m), {"name": tool, "arguments": {"minutes": m}})
    if tool == "search_web":
        return _search(rng, _query(rng), "basic")
    to, s = _address(rng), _subject(rng)
    return _email(rng, to, s, "basic")


def _convert(rng: random.Random, amount: int | float, kind: str = "basic") -> ToolExample:
    src, dst = rng.sample(sorted(_CURRENCIES), 2)
    text = rng.choice(_CONVERT).format(amount=json.dumps(amount), from_name=_CURRENCIES[src],
                                       to_name=_CURRENCIES[dst], from_code=src, to_code=dst)
    return ToolExample(text, {"name": "convert_currency", "arguments": {"amount": amount, "from": src, "to": dst}},
                       kind=kind)


def _search(rng: random.Random, q: str, kind: str) -> ToolExample:
    return ToolExample(rng.choice(_SEARCH).format(q=q), {"name": "search_web", "arguments": {"query": q}}, kind=kind)


def _email(rng: random.Random, to: str, s: str, kind: str) -> ToolExample:
    return ToolExample(rng.choice(_EMAIL_T).format(to=to, s=s), {"name": "send_email", "arguments": {"to": to,
                                                                                                     "subject": s}},
                       kind=kind)


# ---- the harder kinds (see module docstring) -------------------------------------------------------------
_NOTE_T = ["Take a note: {t}", "Add a note that says \"{t}\".", "Please write this down: {t}",
           "Save a note: \"{t}\"", "Make a note saying {t}"]
_THERMO_T = ["Set the {room} thermostat to {t} degrees.", "Make the {room} {t} degrees.",
             "Change the temperature in the {room} to {t}.", "Heat the {room} to {t} degrees, please."]
_ROOMS = ["kitchen", "bedroom", "living room", "office", "garage", "basement", "attic", "bathroom", "nursery",
          "studio", "hallway", "guest room"]
_FLIGHT_T = ["Book a flight from {o} to {d} on {date} for {n} passengers in {cabin}.",
             "Fly {n} people from {o} to {d} on {date}, {cabin} class.",
             "I need {n} {cabin} seats from {o} to {d} for {date}.",
             "Get {n} {cabin} tickets on {date} flying {o} to {d}."]
_EVENT_T = ["Schedule {title} on {date} at {time} for {dur} minutes.",
            "Create an event called {title} on {date} at {time}, {dur} minutes long.",
            "Put {title} in my calendar for {date} at {time} ({dur} minutes).",
            "Add {title} to the calendar: {date}, {time}, {dur} minutes."]


def _long_text(rng: random.Random, lo: int = 40, hi: int = 90) -> str:
    """Random words (real and invented) joined by spaces, at least ``lo`` characters (about ``lo..hi``)."""
    target, words = rng.randint(lo, hi), []
    while len(" ".join(words)) < target:
        words.append(rng.choice(_WORDS) if rng.random() < 0.7 else _invented_name(rng, (1, 3)))
    return " ".join(words)


def _date(rng: random.Random) -> str:
    return f"20{rng.randint(24, 29)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _time(rng: random.Random) -> str:
    return f"{rng.randint(0, 23):02d}:{rng.choice([0, 15, 30, 45, rng.randint(0, 59)]):02d}"


def _room(rng: random.Random) -> str:
    return rng.choice(_ROOMS) if rng.random() < 0.5 else f"{rng.choice(_WORDS)} room"


def _long(rng: random.Random) -> ToolExample:
    text = _long_text(rng)
    if rng.random() < 0.5:
        return _search(rng, text, "long")
    return ToolExample(rng.choice(_NOTE_T).format(t=text), {"name": "add_note", "arguments": {"text": text}},
                       kind="long")


def _numbers(rng: random.Random) -> ToolExample:
    if rng.random() < 0.4:
        return _convert(rng, round(rng.randint(1, 9999999) / 100, 2), "numbers")
    t = rng.randint(-30, 40) if rng.random() < 0.4 else round(rng.randint(-300, 400) / 10, 1)
    room = _room(rng)
    return ToolExample(rng.choice(_THERMO_T).format(room=room, t=json.dumps(t)),
                       {"name": "set_thermostat", "arguments": {"room": room, "temperature": t}}, kind="numbers")


def _flight(rng: random.Random, date: str | None = None, date_text: str | None = None,
            kind: str = "multi_arg") -> ToolExample:
    o, d = _city(rng), _city(rng)
    while d == o:
        d = _city(rng)
    date, n, cabin = date or _date(rng), rng.randint(1, 9), rng.choice(["economy", "business", "first"])
    text = rng.choice(_FLIGHT_T).format(o=o, d=d, date=date_text or date, n=n, cabin=cabin)
    return ToolExample(text, {"name": "book_flight", "arguments": {"origin": o, "destination": d, "date": date,
                                                                   "passengers": n, "cabin": cabin}}, kind=kind)


def _event(rng: random.Random) -> ToolExample:
    title = _subject(rng) if rng.random() < 0.5 else " ".join(rng.sample(_WORDS, rng.randint(2, 4)))
    date, time, dur = _date(rng), _time(rng), rng.choice([15, 30, 45, 60, 90, 120, rng.randint(5, 600)])
    return ToolExample(rng.choice(_EVENT_T).format(title=title, date=date, time=time, dur=dur),
                       {"name": "create_event", "arguments": {"title": title, "when": {"date": date, "time": time},
                                                              "duration_minutes": dur}}, kind="nested")


FAR_TOKENS = 512  # a multi-turn argument is at least this many tokens before the answer
MAX_PROMPT_TOKENS = 840  # multi-turn prompts stay below this (room for a 160-token answer in 1,024 positions)


def _recall(rng: random.Random, slot: str, value) -> ToolExample:
    """The final request of a conversation: it names the noted ``slot`` instead of the value."""
    ref = f"my {slot}"
    if slot == "home city":
        return ToolExample(f"What's the weather in {ref}?", {"name": "get_weather", "arguments": {"city": value}})
    if slot == "research topic":
        return ToolExample(rng.choice(["Search the web for {r}.", "Look up {r} online."]).format(r=ref),
                           {"name": "search_web", "arguments": {"query": value}})
    if slot == "manager's address":
        s = _subject(rng)
        return ToolExample(f"Email {ref} about {s}.", {"name": "send_email", "arguments": {"to": value, "subject": s}})
    if slot == "shopping list":
        return ToolExample(f"Save {ref} as a note.", {"name": "add_note", "arguments": {"text": value}})
    if slot == "travel date":
        return _flight(rng, value, ref)
    return ToolExample(f"Set a timer for {ref}.", {"name": "set_timer", "arguments": {"minutes": value}})


_SLOTS = {"home city": _city, "research topic": _query, "manager's address": _address,
          "shopping list": lambda rng: _long_text(rng, 40, 70), "travel date": _date,
          "tea time": lambda rng: rng.randint(1, 60)}


def _note(slot: str, value) -> str:
    return f"Note: my {slot} is {value} minutes." if slot == "tea time" else f'Note: my {slot} is "{value}".'


def _multi_turn(rng: random.Random) -> ToolExample:
    """Notes (the one asked about, sometimes a second), at least FAR_TOKENS tokens of answered requests, then a
    request that refers to the note; resampled until the prompt is under MAX_PROMPT_TOKENS."""
    tok = ByteTokenizer()
    while True:
        slots = rng.sample(sorted(_SLOTS), 2)
        values = [_SLOTS[s](rng) for s in slots]
        notes = [(_note(s, v), None) for s, v in zip(slots, values, strict=True)][: rng.choice([1, 2])]
        rng.shuffle(notes)
        turns, far = [], 0
        while far < FAR_TOKENS:
            ex = _single(rng)
            turns.append((ex.request, ex.call))
            far += len(ex.ids(tok)) - 1
        last = _recall(rng, slots[0], values[0])
        ex = ToolExample(last.request, last.call, tuple(notes + turns), "multi_turn")
        if len(ex.prompt_ids(tok)) <= MAX_PROMPT_TOKENS:
            return ex


_SINGLE = ((_basic, 0.4), (_long, 0.15), (_numbers, 0.15), (lambda rng: _flight(rng), 0.15), (_event, 0.15))
KINDS = ("basic", "long", "numbers", "multi_arg", "nested", "multi_turn")
MIXES = ("basic", "single", "multi_turn", "full")  # full: 30% multi-turn, 70% single


def _single(rng: random.Random) -> ToolExample:
    r, acc = rng.random(), 0.0
    for fn, w in _SINGLE:
        acc += w
        if r < acc:
            return fn(rng)
    return _SINGLE[-1][0](rng)


def sample_example(rng: random.Random, mix: str = "basic") -> ToolExample:
    """One random request of a mix (``MIXES``; ``basic`` is uniform over the five original tools)."""
    if mix == "basic":
        return _basic(rng)
    if mix == "single":
        return _single(rng)
    if mix == "multi_turn":
        return _multi_turn(rng)
    if mix == "full":
        return _multi_turn(rng) if rng.random() < 0.3 else _single(rng)
    raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")


def split_of(request: str) -> str:
    """``"heldout"`` for about 10% of requests (by SHA-1 of the text), else ``"train"``."""
    return "heldout" if int(hashlib.sha1(request.encode()).hexdigest(), 16) % 10 == 0 else "train"


def iter_examples(split: str, seed: int, mix: str = "basic") -> Iterator[ToolExample]:
    """Endless seeded stream of the examples of one split (``"train"`` or ``"heldout"``) and mix."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(seed)
    while True:
        ex = sample_example(rng, mix)
        if split_of(ex.key) == split:
            yield ex


def examples(n: int, split: str = "heldout", seed: int = 0, unique: bool = True,
             mix: str = "basic") -> list[ToolExample]:
    """The first ``n`` examples of a split's stream (distinct conversations when ``unique``)."""
    out: list[ToolExample] = []
    seen: set[str] = set()
    for ex in iter_examples(split, seed, mix):
        if unique and ex.key in seen:
            continue
        seen.add(ex.key)
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
