"""Chat templates of Hugging Face checkpoints, rendered with jinja2 as ``transformers``' ``apply_chat_template``
renders them, so a server needs no ``transformers`` to serve a checkpoint's chats.

The environment matches the one chat templates are written for: a sandbox (a template is data shipped with a
checkpoint, never trusted code), ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension
(``{% break %}``), a ``tojson`` filter that keeps non-ASCII text as is (``ensure_ascii=False``) and takes
``indent``, ``separators`` and ``sort_keys``, and the globals ``raise_exception(message)`` (a template's way of
refusing a conversation: a ``ValueError`` here, which the server answers with a 400) and ``strftime_now(format)``.
Variables: ``messages``, ``tools`` (None when none are offered), ``add_generation_prompt`` and the special tokens
by name (``bos_token``, ``eos_token``, ...).

Where a checkpoint keeps its template (:func:`read_chat_template`): ``chat_template.jinja`` beside the tokenizer
(what transformers 5 writes), else ``chat_template.json``, else ``tokenizer_config.json``'s ``chat_template`` --
a string, or a list of named templates of which the one named ``default`` is used.
"""

from __future__ import annotations

import datetime
import functools
import json
from pathlib import Path
from typing import Any


def read_chat_template(directory: str | Path, config: dict) -> str | None:
    """The checkpoint's chat template text, or None (module docstring: where it is looked for)."""
    d = Path(directory)
    if (d / "chat_template.jinja").exists():
        return (d / "chat_template.jinja").read_text()
    template: Any = config.get("chat_template")
    if (d / "chat_template.json").exists():
        template = json.loads((d / "chat_template.json").read_text()).get("chat_template", template)
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _raise(message: str) -> None:
    raise ValueError(f"the chat template refused the conversation: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """The compiled template (cached per source text; a template error is a ``ValueError``)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template does not compile: {e}") from None


def render(source: str, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
           **special_tokens: str) -> str:
    """The chat as text: ``source`` rendered over ``messages`` (and ``tools``) with the generation prompt."""
    import jinja2

    try:
        return compile_template(source).render(messages=messages, tools=tools,
                                                add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.TemplateError as e:  # a sandbox violation or an undefined call: the template's own fault
        raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from None
