"""The OpenAI-compatible HTTP application (FastAPI): completions, chat completions, models, health, metrics.

``create_app(backend, tokenizer, model_name, stream_interval)`` wraps an
:class:`~phaseserve.server.loop.EngineBackend` (an in-process or a Ray engine) in an
:class:`~phaseserve.server.loop.EngineLoop` thread; handlers only submit, await and format, so no handler blocks the
engine and every client's requests share its continuous batch. ``backend`` may also be a list -- data-parallel
replicas behind one endpoint (e.g. the engines of a :class:`phaseserve.ReplicatedEngine`), one loop thread each:
a new request goes to the loop that holds its prompt's longest cached prefix unless that loop is much busier, else
to the one with the fewest tokens in flight (:class:`~phaseserve.server.routing.Balancer`), and ``/metrics`` sums the
replicas' gauges and totals. A stream writes one server-sent-events batch per
update the loop hands over (every token, or every ``stream_interval`` tokens; the last text delta carries the
``finish_reason``, and the usage chunk and ``[DONE]`` go in the same write).

Errors, in OpenAI's body (``{"error": {"message", "type", "param", "code"}}``):

- 400 ``invalid_request_error``: a body beyond the JSON bounds (:mod:`phaseserve.server.jsonbounds`: nesting
  depth, ...) or one that fails the schemas (:mod:`phaseserve.server.schemas`), or a request
  the engine refuses on arrival (a :class:`~phaseserve.RequestError`: token outside the vocabulary, prompt +
  max_tokens beyond the context, ...); a streamed request is refused before its stream starts;
- 404 ``model_not_found``: ``model`` names another model;
- 503 ``server_overloaded``: ``max_in_flight`` requests are already open (nothing was queued);
- 500 ``server_error``: this request failed in the engine (an integrity abort, a device failure narrowed to it);
  other requests are unaffected. Mid-stream, the error is sent as an SSE ``data: {"error": ...}`` event.

A client that disconnects (mid-stream, or while waiting for a non-streamed reply) cancels its request: the engine
releases its pages at once.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from phaseserve.data.tokenizer import ByteTokenizer
from phaseserve.engine import Request, RequestError, RequestOutput
from phaseserve.engine.request import validate
from phaseserve.server.chat import TextStream, forced_prefix, render_chat, usage
from phaseserve.server.jsonbounds import BoundedRoute
from phaseserve.server.logprobs import chat_logprobs, completion_logprobs, token_string
from phaseserve.server.loop import EngineLoop, Update
from phaseserve.server.metrics import ServerMetrics
from phaseserve.server.routing import Balancer
from phaseserve.server.schemas import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    validation_message,
)
from phaseserve.server.security import DEFAULT_MAX_BODY_BYTES, Auth, Gate, cache_tenant
from phaseserve.server.sse import DONE, EventStream, Template, event

DISCONNECT_POLL_S = 0.25  # non-streamed requests: how often the client's connection is checked
DEFAULT_MAX_IN_FLIGHT = 1024  # requests open at once (streams and waits) before 503: bounds the engines' queues
HTTP_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _failure(out: RequestOutput) -> ApiError | None:
    """The HTTP error of a request that ended without a reply (None: it finished normally or was cut by a stop)."""
    if out.finish_reason == "error" and isinstance(out.error, RequestError):
        return ApiError(400, f"{type(out.error).__name__}: {out.error}")
    if out.finish_reason in ("error", "aborted"):
        return ApiError(500, f"{type(out.error).__name__}: {out.error}", "server_error")
    return None


class Generation:
    """One request in flight on the loop the balancer picks: token ids in, text deltas out (:meth:`deltas`), the
    output at the end. :meth:`close` (always, once the handler is done with it) cancels it if unfinished and gives
    its load back to the balancer."""

    def __init__(self, balancer: Balancer, req: Request, text: TextStream):
        self.balancer, self.req, self.text = balancer, req, text
        self.index = balancer.acquire(req)
        self.loop = balancer.loops[self.index]
        self.handle = self.loop.submit(req)
        self.output: RequestOutput | None = None
        self._first: Update | None = None
        self._closed = False

    async def start(self) -> None:
        """Wait for the first update; raise the request's :class:`ApiError` if it was refused or failed at once
        (then, or if the handler is cancelled meanwhile, the request is closed)."""
        try:
            self._first = await self.handle.get()
            err = self._error(self._first)
        except BaseException:
            self.close()
            raise
        if err is not None:
            self.output = self._first.done  # it ended in the engine already: nothing to cancel
            self.close()
            raise err

    def _error(self, up: Update) -> ApiError | None:
        if up.failed is not None:
            return ApiError(500, f"the engine loop stopped: {up.failed!r}", "server_error")
        if up.done is not None and not self.text.stopped:
            return _failure(up.done)
        return None

    async def deltas(self) -> AsyncIterator[tuple[str, bool]]:
        """``(text delta, final)`` per update until the request ends (a stop string cancels it in the engine); the
        final delta includes what was held back; sets :attr:`output`. A delta may be "" (a special token, part of a
        character): one per update, i.e. per engine step while the handler keeps up, several steps' worth if not."""
        up, self._first = self._first or await self.handle.get(), None
        while True:
            was_stopped = self.text.stopped
            delta = "" if was_stopped else self.text.feed(up.tokens)
            if self.text.stopped and not was_stopped:
                self.handle.stop_string = True  # set before the cancel is queued: the loop thread sees it
                self.loop.cancel(self.req.id)
            if not up.final:
                if not was_stopped:
                    yield delta, False
                up = await self.handle.get()
                continue
            err = self._error(up)
            if err is not None:
                if delta:
                    yield delta, False
                raise err
            self.output = up.done
            yield delta + self.text.flush(), True
            return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.output is None:
            self.loop.cancel(self.req.id)
        self.balancer.release(self.index, self.req)

    @property
    def finish_reason(self) -> str:
        if self.text.stopped:
            return "stop"
        return self.output.finish_reason

    def usage(self) -> dict:
        return usage(len(self.req.prompt), len(self.text.ids))


def create_app(backend: Any, tokenizer: Any, model_name: str, stream_interval: int = 1, *,
               api_keys: dict[str, str] | None = None, metrics_key: str | None = None,
               max_body_bytes: int | None = DEFAULT_MAX_BODY_BYTES,
               max_in_flight: int | None = DEFAULT_MAX_IN_FLIGHT, replica_fill: int | None = None) -> FastAPI:
    """The app over ``backend`` (one, or a list of replicas: one engine loop each); ``app.state.loops`` holds the
    loops while it runs. ``api_keys`` (key -> tenant) turns authentication on; ``metrics_key`` guards ``/metrics``;
    ``max_body_bytes`` caps a request body (None: no cap); see :mod:`phaseserve.server.security`.
    ``max_in_flight`` caps the requests open at once (more get 503 ``server_overloaded``; None: no cap).
    ``replica_fill``: requests packed on the first replicas, up to this many each, before the next takes any
    (:class:`~phaseserve.server.routing.Balancer`'s ``fill``; None: spread from the first request)."""
    if max_in_flight is not None and max_in_flight < 1:
        raise ValueError(f"max_in_flight must be >= 1 or None, got {max_in_flight}")
    backends = list(backend) if isinstance(backend, list | tuple) else [backend]
    if not backends:
        raise ValueError("create_app needs at least one backend")
    limits = backends[0].limits  # the replicas serve the same model
    metrics = ServerMetrics(model_name)
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loops = [EngineLoop(b, on_finish=metrics.on_finish, on_step=functools.partial(metrics.on_step, source=i),
                            stream_interval=stream_interval) for i, b in enumerate(backends)]
        app.state.loops = loops
        capacity = getattr(getattr(backends[0], "engine", None), "max_batch", None)  # each replica's batch
        state["balancer"] = Balancer(loops, max_in_flight, page_size=limits.page_size, capacity=capacity,
                                     fill=replica_fill)
        yield
        for loop in loops:
            loop.close()

    app = FastAPI(title="phaseserve", lifespan=lifespan)
    app.router.route_class = BoundedRoute  # bodies decoded within jsonbounds' limits (a 400 past them)
    app.state.metrics = metrics
    app.add_middleware(Gate, auth=Auth(api_keys, metrics_key), max_body_bytes=max_body_bytes)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_, exc: StarletteHTTPException):  # unknown route, wrong method, body too large, ...
        return JSONResponse(error_body(str(exc.detail), code=HTTP_CODES.get(exc.status_code)),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _server_error(_, exc: Exception):  # a server bug: OpenAI's shape (Starlette still logs it)
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}", "server_error"),
                            status_code=500)

    @app.exception_handler(ApiError)
    async def _api_error(_, exc: ApiError):
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, exc: RequestValidationError):
        msg, param = validation_message(exc.errors())
        return JSONResponse(error_body(msg, param=param), status_code=400)

    def check_model(name: str | None) -> None:
        if name not in (None, model_name):
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    ids = itertools.count()
    id_prefix = uuid.uuid4().hex[:16]  # request ids: unique per server (a counter), not guessable across servers

    byte_level = isinstance(tokenizer, ByteTokenizer)

    def chars_fit(text_len: int) -> None:
        """A byte-level tokenizer makes at least one token per character: a text that cannot fit is refused
        before it is encoded (other tokenizers: checked once encoded)."""
        if byte_level:
            fits(text_len)

    def fits(n: int) -> None:
        """Cheap first: a prompt of ``n`` tokens (a lower bound for a string) that cannot fit the context is
        refused before anything reads it token by token."""
        if n >= limits.max_context:
            raise ApiError(400, f"PromptTooLongError: prompt of {n} tokens does not fit the context of "
                                f"{limits.max_context}", param="prompt", code="context_length_exceeded")

    async def new_request(prompt: list[int], body: Any, max_tokens: int, http: HttpRequest, choice: int = 0,
                          **extra: Any) -> Request:
        """The engine request for choice ``choice`` (its seed: ``seed + choice``, or a fresh one), validated here
        (in a worker thread, not the engine loop's): a bad one is a 400 before it reaches the loop. Its prefix-cache
        tenant is the authenticated caller's, narrowed by ``user``; ``extra``: more :class:`Request` fields."""
        fits(len(prompt))
        req = Request(id=f"{id_prefix}{next(ids):08x}", prompt=prompt, **body.sampling(max_tokens, choice),
                      tenant=cache_tenant(getattr(http.state, "tenant", ""), body.user), **extra)
        try:
            return await asyncio.to_thread(validate, req, limits)
        except RequestError as e:
            raise ApiError(400, f"{type(e).__name__}: {e}") from None

    async def open_all(specs: list[tuple[Request, TextStream]]) -> list[Generation]:
        """Submit every choice's request and wait for each to start; if one is refused, all are closed."""
        gens: list[Generation] = []
        try:
            for req, text in specs:
                gens.append(Generation(state["balancer"], req, text))
            for g in gens:
                await g.start()
        except BaseException:
            for g in gens:
                g.close()
            raise
        return gens

    async def run_all(gens: list[Generation], http: HttpRequest) -> list[str]:
        """All the text of each non-streamed choice; every request is cancelled if the client goes away (or one
        fails)."""
        async def collect(gen: Generation) -> str:
            return "".join([d async for d, _ in gen.deltas()])

        task = asyncio.ensure_future(asyncio.gather(*map(collect, gens)))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await http.is_disconnected():
                    task.cancel()
                    raise ApiError(499, "client disconnected", "client_closed")
        finally:
            for g in gens:
                g.close()

    async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, str, bool]]:
        """``(choice index, text delta, final)`` of every choice as they come (one choice: its own order)."""
        if len(gens) == 1:
            async for d, final in gens[0].deltas():
                yield 0, d, final
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, g: Generation) -> None:
            try:
                async for d, final in g.deltas():
                    queue.put_nowait((i, d, final, None))
            except ApiError as e:
                queue.put_nowait((i, "", True, e))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        try:
            left = len(gens)
            while left:
                i, d, final, err = await queue.get()
                if err is not None:
                    raise err
                left -= final
                yield i, d, final
        finally:
            for t in tasks:
                t.cancel()

    def sse(batches: AsyncIterator[str], gens: list[Generation]) -> EventStream:
        """Server-sent events: one write per batch of events (an update's, and ``[DONE]`` with the last)."""
        async def body():
            done = False
            try:
                async for text in batches:
                    done = all(g.output is not None for g in gens)
                    yield text + DONE if done else text
            except ApiError as e:
                yield event(e.body)
            finally:
                for g in gens:
                    g.close()  # a disconnect (or any early end) frees the requests' pages now
            if not done:
                yield DONE

        return EventStream(body())

    def total_usage(gens: list[Generation], n: int) -> dict:
        """Usage over the choices: each prompt counted once (``n`` choices share it)."""
        return usage(sum(len(g.req.prompt) for g in gens[::n]), sum(len(g.text.ids) for g in gens))

    def chat_prompt(messages: list) -> list[int]:
        try:
            return render_chat(messages, tokenizer)
        except ValueError as e:  # e.g. a checkpoint tokenizer without a chat template
            raise ApiError(400, f"cannot render the chat: {e}", param="messages") from None

    # ---- endpoints --------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        balancer = state.get("balancer")
        if balancer is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        for loop in balancer.loops:
            if not loop.alive:
                return JSONResponse({"status": "engine loop stopped", "error": repr(loop.error)}, status_code=503)
            down = loop.backend.health()
            if down:
                return JSONResponse({"status": "backend down", "error": down}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's ``/tokenize``: a prompt's ids as ``/v1/completions`` encodes it (``add_special_tokens``: with
        ``<bos>``), or a chat's as ``/v1/chat/completions`` renders it."""
        check_model(body.model)
        if body.prompt is not None:
            chars_fit(len(body.prompt))
            encode = tokenizer.encode_prompt if body.add_special_tokens else tokenizer.encode
            ids = await asyncio.to_thread(encode, body.prompt)
        else:
            chars_fit(sum(len(m.text) for m in body.messages))
            ids = await asyncio.to_thread(chat_prompt, body.messages)
        strs = [token_string(tokenizer, t) for t in ids] if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": limits.max_context, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """vLLM's ``/detokenize``: ids -> text (special tokens by name)."""
        check_model(body.model)
        bad = [t for t in body.tokens if t >= limits.vocab_size]
        if bad:
            raise ApiError(400, f"token ids outside the vocabulary of {limits.vocab_size}: {bad[:5]}",
                           param="tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's ``/tokenizer_info``: the tokenizer's configuration, ``model_max_length`` the server's context."""
        return {**tokenizer.info(), "model_max_length": limits.max_context}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "phaseserve", "max_model_len": limits.max_context}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        check_model(body.model)
        prompts = []
        for p in body.prompts:
            if isinstance(p, str):
                chars_fit(len(p))
                encode = tokenizer.encode_prompt if body.add_special_tokens else tokenizer.encode
                prompts.append((await asyncio.to_thread(encode, p), p))  # <bos>: as trained
            else:
                prompts.append((list(p), None))
        scored = body.echo and body.logprobs is not None
        extra = {"logprobs": body.logprobs,
                 "prompt_logprobs": body.logprobs if scored else 0 if body.max_tokens == 0 else None}
        specs = [(await new_request(ids, body, body.max_tokens, http, j, **extra),
                  TextStream(tokenizer, body.stops, min_tokens=body.min_tokens))
                 for ids, _ in prompts for j in range(body.n)]
        gens = await open_all(specs)
        rid, created = f"cmpl-{gens[0].req.id}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": model_name}
        echoes = [(text if text is not None else tokenizer.decode(ids, skip_special=True)) if body.echo else ""
                  for ids, text in prompts for _ in range(body.n)]
        if not body.stream:
            texts = await run_all(gens, http)
            return {**head, "choices": [completion_choice(i, g, echoes[i], texts[i], body)
                                        for i, g in enumerate(gens)], "usage": total_usage(gens, body.n)}

        async def chunks():
            extra = {"usage": None} if body.include_usage else {}

            def chunk(i: int, text: str, reason: str | None = None) -> dict:
                c = {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                return {**head, "choices": [c | {"seed": gens[i].req.seed} if reason else c], **extra}

            deltas = [Template(chunk(i, Template.SLOT)) for i in range(len(gens))]
            first = set()
            async for i, d, final in merged(gens):  # a choice's last text delta carries its finish_reason
                if i not in first:
                    first.add(i)
                    d = echoes[i] + d
                if not final:
                    yield deltas[i](d)
                    continue
                last = event(chunk(i, d, gens[i].finish_reason))
                if body.include_usage and all(g.output is not None for g in gens):
                    last += event({**head, "choices": [], "usage": total_usage(gens, body.n)})
                yield last

        return sse(chunks(), gens)

    def completion_choice(i: int, g: Generation, echo: str, text: str, body: CompletionRequest) -> dict:
        """Choice ``i`` of a non-streamed completion: the echoed prompt and the text, the logprobs of their tokens
        (the prompt's when echoed; the generated tokens' up to a stop string), the seed it ran with."""
        lp = None
        if body.logprobs is not None:
            out, n = g.output, len(g.text.ids)
            ids, entries = list(g.text.ids), list(out.logprobs[:n])
            if body.echo:
                ids, entries = g.req.prompt + ids, out.prompt_logprobs + entries
            lp = completion_logprobs(tokenizer, ids, entries)
        ids = {"prompt_token_ids": list(g.req.prompt), "token_ids": list(g.text.ids)} if body.return_token_ids else {}
        return {"index": i, "text": echo + text, "logprobs": lp, "finish_reason": g.finish_reason,
                "seed": g.req.seed, **ids}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest):
        check_model(body.model)
        if body.tools and not byte_level:
            raise ApiError(400, "tools are not supported for this checkpoint: tool calls are parsed in the default "
                                "model's format only", param="tools")
        forced = forced_prefix(body, tokenizer)
        chars_fit(sum(len(m.text) for m in body.messages))  # cheap first
        prompt = await asyncio.to_thread(chat_prompt, body.messages) + forced
        budget = body.token_budget(max(limits.max_context - len(prompt), 1))
        extra = {"logprobs": (body.top_logprobs or 0) if body.logprobs else None}
        specs = [(await new_request(prompt, body, budget, http, j, **extra),
                  TextStream(tokenizer, body.stops, tools=body.offered_tools, forced=forced,
                             min_tokens=body.min_tokens)) for j in range(body.n)]
        gens = await open_all(specs)
        rid, created = f"chatcmpl-{gens[0].req.id}", int(time.time())
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model_name}
        if not body.stream:
            await run_all(gens, http)
            return {**head, "choices": [chat_choice(i, g, body) for i, g in enumerate(gens)],
                    "usage": total_usage(gens, body.n)}

        head["object"] = "chat.completion.chunk"

        async def chunks():
            extra = {"usage": None} if body.include_usage else {}

            def chunk(i: int, delta: dict, reason: str | None = None) -> dict:
                c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason}
                return {**head, "choices": [c | {"seed": gens[i].req.seed} if reason else c], **extra}

            content_events = [Template(chunk(i, {"content": Template.SLOT})) for i in range(len(gens))]
            pending = [[chunk(i, {"role": "assistant", "content": ""})] for i in range(len(gens))]
            async for i, d, final in merged(gens):
                if not final and not pending[i]:
                    yield content_events[i](d)
                    continue
                batch, pending[i] = pending[i] + [chunk(i, {"content": d})], []
                if final:
                    text = gens[i].text
                    content, calls = text.reply()
                    if calls:
                        batch.append(chunk(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}))
                    elif text.call_ids is not None:  # a call that did not parse comes back as text
                        batch.append(chunk(i, {"content": content[len(text.text):]}))
                    batch.append(chunk(i, {}, "tool_calls" if calls else gens[i].finish_reason))
                    if body.include_usage and all(g.output is not None for g in gens):
                        batch.append({**head, "choices": [], "usage": total_usage(gens, body.n)})
                yield "".join(map(event, batch))

        return sse(chunks(), gens)

    def chat_choice(i: int, g: Generation, body: ChatCompletionRequest) -> dict:
        """Choice ``i`` of a non-streamed chat completion: the message (content, or tool calls), the generated
        tokens' logprobs (up to a stop string), the seed it ran with."""
        content, calls = g.text.reply()
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        lp = chat_logprobs(tokenizer, g.output.logprobs[:len(g.text.ids)]) if body.logprobs else None
        return {"index": i, "message": message, "logprobs": lp,
                "finish_reason": "tool_calls" if calls else g.finish_reason, "seed": g.req.seed}

    return app
