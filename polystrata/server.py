"""`polystrata serve`: an OpenAI-compatible HTTP server (aiohttp) over one engine, decoding up to N requests at once.

Endpoints: POST /v1/chat/completions and /v1/completions (whole answers, or server-sent events with `stream`),
GET /v1/models and /health. Errors are JSON bodies in OpenAI's shape, {"error": {"message", "type", "param",
"code"}}, never a traceback: 400 for a bad request (with the parameter at fault), 401 for a missing or wrong API
key (where one is set; /health needs none), 404, 405, 413 for a body over `MAX_BODY`, 503 when `MAX_WAITING`
requests already wait.

Two threads: the event loop (HTTP, parsing, chat templates, tokenizing) and the `Scheduler`, which owns the engine
(the thread that made it, the command's main thread) and runs batched decoding (polystrata/batch.py):
waiting requests take a slot between steps while slots are free; each step decodes one token of every decoding
request and fills its remaining rows (up to the step size, -ub) with prompt tokens of the joining ones (continuous
batching: `Scheduler`); tokens are sampled per request (its own sampler and seed) and cut at its stop strings.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
import queue
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from aiohttp import web

from polystrata.batch import BatchDecoder
from polystrata.chat import StopStrings, chat_template_from_metadata, encode_chat
from polystrata.engine import Engine
from polystrata.errors import PolystrataError
from polystrata.sampling import Sampler, SamplerConfig

MAX_BODY = 1 << 20  # bytes of a request body (413 beyond)
MAX_WAITING = 256  # requests waiting for a slot (503 beyond)
MAX_STOPS = 16  # stop strings a request may give, each at most MAX_STOP_CHARS long
MAX_STOP_CHARS = 256
ROLES = ("system", "developer", "user", "assistant")


class BadRequest(Exception):
    """A request the server refuses: an HTTP status and an OpenAI-style error."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = message, param, status, kind, code


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Job:
    """One request's generation: filled in by the event loop, run by the scheduler, answered through `events`
    (("text", str), ("done", finish reason) or ("error", message)), which the scheduler hands to the job's event
    loop (`Scheduler._flush`)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplerConfig
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    ignore_eos: bool = False  # generate max_tokens whatever comes (llama-server's option, for benchmarks)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    n_generated: int = 0
    cancelled: bool = False  # the client went away: the scheduler drops the job at its next look


def _deliver(events: list[tuple[Job, str, Any]]) -> None:
    """In the event loop: put events into their jobs' queues."""
    for job, kind, value in events:
        job.events.put_nowait((kind, value))


class _Running:
    """A job in a sequence slot: its prompt tokens fed so far, history, detokenizer, stop strings and the logits
    of its next token."""

    def __init__(self, job: Job, slot: int, tokenizer):
        self.job, self.slot = job, slot
        self.fed = 0  # prompt tokens in the slot's cache rows; all of them once the job decodes
        self.logits: np.ndarray | None = None
        self.sampler = Sampler(job.sampling)
        self.history = list(job.prompt_ids)
        self.decoder = tokenizer.stream()
        self.cut = StopStrings(job.stops)
        self.next_token = -1


@dataclass
class BusyPeriod:
    """The scheduler's work from its first step after being idle to its going idle again, logged then as one line,
    as llama-server logs its timings: where a step's time goes, the model's step (launches, handing the previous
    step's events to the event loop, device, logits back), the host's sampling, detokenizing and stop strings, or
    between steps (admitting requests, waiting for the interpreter while the event loop's thread holds it)."""

    start: float
    steps: int = 0
    rows: int = 0  # tokens the steps took in: decode rows and prompt tokens
    generated: int = 0
    finished: int = 0
    step_s: float = 0.0  # in `Scheduler._step`
    model_s: float = 0.0  # of that, in `BatchDecoder.step`
    longest_s: float = 0.0  # the longest of those

    def summary(self, now: float) -> str:
        wall = max(now - self.start, 1e-9)
        per = 1e3 / max(self.steps, 1)
        return (f"served {self.finished} requests: {self.generated} tokens in {wall:.2f} s "
                f"({self.generated / wall:.1f} tok/s), {self.steps} steps of {self.rows / max(self.steps, 1):.1f} "
                f"rows; a step {self.model_s * per:.2f} ms in the model, {(self.step_s - self.model_s) * per:.2f} ms "
                f"sampling and sending, {(wall - self.step_s) * per:.2f} ms between steps; the longest step "
                f"{self.longest_s * 1e3:.1f} ms")


class Scheduler:
    """Runs jobs on an engine, up to `n_seq` at once, in shared steps (`BatchDecoder.step`): each step takes every
    decoding job's next token, then fills the step's remaining rows with prompt tokens of the joining jobs (oldest
    first, a prompt in chunks over several steps where it does not fit), as llama-server's continuous batching and
    vLLM's chunked prefill do: a long prompt joining does not stall the running streams, and joining prompts share
    steps."""

    def __init__(self, engine: Engine, n_seq: int, log: Callable[[str], None] | None = None):
        self.engine = engine
        self.batch = BatchDecoder(engine, n_seq)
        self.waiting: queue.Queue[Job | None] = queue.Queue()
        self.running: dict[int, _Running] = {}  # slot -> a decoding job
        self.joining: list[_Running] = []  # jobs in a slot whose prompts are being fed, oldest first
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.stopped = False
        # Events of the jobs, handed to their event loops together after each step (`_flush`): one wake-up of the
        # loop's thread a step, however many jobs it serves, not one a token.
        self.outbox: list[tuple[Job, str, Any]] = []
        self.busy: BusyPeriod | None = None

    def emit(self, job: Job, kind: str, value: Any) -> None:
        """Queue an event of a job for the next `_flush`."""
        self.outbox.append((job, kind, value))

    def _flush(self) -> None:
        loops: dict[asyncio.AbstractEventLoop, list] = {}
        for ev in self.outbox:
            loops.setdefault(ev[0].loop, []).append(ev)
        self.outbox = []
        for loop, events in loops.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # the loop is closed: the server is stopping
                pass

    def submit(self, job: Job) -> None:
        """Queue a job (from any thread); refused with 503 when `MAX_WAITING` wait already."""
        if self.waiting.qsize() >= MAX_WAITING:
            raise BadRequest(f"the server is busy: {MAX_WAITING} requests are waiting", status=503,
                             kind="server_error", code="server_busy")
        self.waiting.put(job)

    def stop(self) -> None:
        """End `run` (from any thread)."""
        self.waiting.put(None)

    def run(self) -> None:
        """Serve jobs until `stop`: in the engine's thread."""
        while not self.stopped:
            self._admit()
            if self.running or self.joining:
                start = time.perf_counter()
                self.busy = self.busy or BusyPeriod(start)
                self._step()  # hands the events so far to the event loops once its work is on the device
                self.busy.step_s += time.perf_counter() - start
            if not (self.running or self.joining):  # idle: no next step hands the events on
                self._flush()
                if self.busy:
                    self.log(self.busy.summary(time.perf_counter()))
                    self.busy = None

    def _admit(self) -> None:
        """Jobs take a slot while slots are free, to join at the next step; with nothing running, wait for one."""
        while self.batch.free and not self.stopped:
            try:
                job = self.waiting.get(block=not self.running and not self.joining and not self.outbox)
            except queue.Empty:
                return
            if job is None:
                self.stopped = True
                return
            if job.cancelled:
                continue
            try:  # the prompt's own problems reach its job alone, not the step it would join
                self.engine.check_tokens(job.prompt_ids, 0, self.batch.n_ctx)
            except PolystrataError as e:
                self.emit(job, "error", str(e))
                continue
            self.joining.append(_Running(job, self.batch.open(), self.engine.tokenizer))

    def _step(self) -> None:
        for r in [r for r in (*self.running.values(), *self.joining) if r.job.cancelled]:
            self._finish(r, None)
        # The decoding jobs' rows first (at most n_seq <= n_ubatch), then prompt tokens up to the step's size.
        decoding = list(self.running.values())
        runs: list[tuple[int, list[int]]] = [(r.slot, [r.next_token]) for r in decoding]
        need = [True] * len(runs)
        fed: list[tuple[_Running, int]] = []  # joining jobs in this step, and the prompt tokens each gives it
        room = self.engine.n_ubatch - len(runs)
        for r in self.joining:
            if room <= 0:
                break
            chunk = r.job.prompt_ids[r.fed : r.fed + room]
            runs.append((r.slot, chunk))
            need.append(r.fed + len(chunk) == len(r.job.prompt_ids))
            fed.append((r, len(chunk)))
            room -= len(chunk)
        if not runs:
            return
        busy = self.busy
        busy.steps += 1
        busy.rows += sum(len(ids) for _, ids in runs)
        start = time.perf_counter()
        try:
            # The previous step's tokens go to their clients while the device computes this one: the event loop's
            # work (one text chunk a request) would otherwise hold the interpreter between two steps.
            out = self.batch.step(runs, need, launched=self._flush)
        except Exception as e:  # a failure of the device or the engine: every job in the step learns it
            self.log(f"error: step failed: {type(e).__name__}: {e}")
            for r in (*decoding, *(r for r, _ in fed)):
                self.emit(r.job, "error", "the model step failed")
                self._finish(r, None)
            self._flush()
            return
        finally:
            spent = time.perf_counter() - start
            busy.model_s += spent
            busy.longest_s = max(busy.longest_s, spent)
        for row, r in enumerate(decoding):
            r.logits = out[row]
            self._advance(r)
        row = len(decoding)
        for r, n in fed:
            r.fed += n
            if r.fed == len(r.job.prompt_ids):  # its prompt is in: the step's logits give its first token
                self.joining.remove(r)
                self.running[r.slot] = r
                r.logits = out[row]
                row += 1
                self._advance(r)

    def _advance(self, r: _Running) -> None:
        """Sample the job's next token, send its text, and end the job or leave the token for the next step."""
        job = r.job
        try:
            tok = r.sampler.sample(r.logits, r.history)
        except PolystrataError as e:
            self.emit(job, "error", str(e))
            self._finish(r, None)
            return
        if not job.ignore_eos and self.engine.tokenizer.is_eog(tok):
            self._finish(r, "stop")
            return
        job.n_generated += 1
        self.busy.generated += 1
        r.history.append(tok)
        text = r.cut.feed(r.decoder.feed(tok))
        if text:
            self.emit(job, "text", text)
        if r.cut.hit:
            self._finish(r, "stop")
        elif job.n_generated >= job.max_tokens or self.batch.n_past[r.slot] >= self.batch.n_ctx:
            self._finish(r, "length")
        else:
            r.next_token = tok

    def _finish(self, r: _Running, reason: str | None) -> None:
        """Free the job's slot; with a `reason`, send the text still held and the end."""
        if self.running.get(r.slot) is r:
            del self.running[r.slot]
        else:
            self.joining.remove(r)
        self.batch.close(r.slot)
        if reason is None:
            return
        if not r.cut.hit:  # the detokenizer's and the stop strings' held text, unless it completes a stop string
            text = r.cut.feed(r.decoder.flush())
            if r.cut.hit:
                reason = "stop"
            else:
                text += r.cut.flush()
            if text:
                self.emit(r.job, "text", text)
        self.emit(r.job, "done", reason)
        self.busy.finished += 1


# --- request parsing -------------------------------------------------------------------------------------------


def _get(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    """Field `name` of the request, None or absent giving `default`; of one of `kinds` or a 400."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
                 dict: "an object"}
        want = " or ".join(dict.fromkeys(names[k] for k in kinds))
        raise BadRequest(f"'{name}' must be {want}", name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float = math.inf) -> float:
    value = float(_get(body, name, (int, float), default))
    if not (low <= value <= high and math.isfinite(value)):
        bounds = f"between {low:g} and {high:g}" if math.isfinite(high) else f"at least {low:g}"
        raise BadRequest(f"'{name}' must be {bounds}, not {value:g}", name)
    return value


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = _get(body, name, (int,), default)
    if value is not None and not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low} and {high}, not {value}", name)
    return value


@dataclass
class Request:
    """What a completion request asks for, checked."""

    stream: bool
    include_usage: bool
    max_tokens: int
    sampling: SamplerConfig
    stops: list[str]
    ignore_eos: bool


def parse_common(body: dict, n_ctx: int, defaults: SamplerConfig) -> Request:
    """The fields chat and text completions share, checked against the server's limits (`n_ctx`: the most
    tokens a sequence holds, prompt included)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise BadRequest(f"'{name}' is not supported (use repeat_penalty)", name)
    if _integer(body, "n", 1, 1, 2**31 - 1) != 1:
        raise BadRequest("'n' must be 1: one choice a request", "n")
    for name in ("logprobs", "top_logprobs", "echo", "logit_bias", "tools", "response_format", "suffix"):
        if body.get(name) not in (None, False):
            raise BadRequest(f"'{name}' is not supported", name)
    stop = _get(body, "stop", (str, list), [])
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > MAX_STOPS or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise BadRequest(f"'stop' must be a string or up to {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} "
                         "characters", "stop")
    max_tokens = _integer(body, "max_completion_tokens", None, 1, n_ctx)
    max_tokens = _integer(body, "max_tokens", max_tokens, 1, n_ctx)
    seed = _integer(body, "seed", defaults.seed, -1, 2**64 - 1)
    sampling = SamplerConfig(
        temperature=_number(body, "temperature", defaults.temperature, 0.0),
        top_k=_integer(body, "top_k", defaults.top_k, 0, 2**31 - 1),
        top_p=_number(body, "top_p", defaults.top_p, 0.0, 1.0),
        min_p=_number(body, "min_p", defaults.min_p, 0.0, 1.0),
        repeat_penalty=_number(body, "repeat_penalty", defaults.repeat_penalty, 1e-6),
        repeat_last_n=_integer(body, "repeat_last_n", defaults.repeat_last_n, -1, 2**31 - 1),
        seed=None if seed == -1 else seed,  # -1: a fresh one, as llama.cpp has it
    )
    options = _get(body, "stream_options", (dict,), {})
    return Request(stream=_get(body, "stream", (bool,), False),
                   include_usage=bool(_get(options, "include_usage", (bool,), False)),
                   max_tokens=max_tokens or n_ctx, sampling=sampling, stops=stops,
                   ignore_eos=_get(body, "ignore_eos", (bool,), False))


def chat_messages(body: dict) -> list[dict]:
    """The `messages` of a chat request as the chat template takes them: role and text content."""
    messages = _get(body, "messages", (list,))
    if not messages:
        raise BadRequest("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"{where} must be an object with a 'role' of {', '.join(ROLES)}", where)
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"{where}.content: only text parts are supported", f"{where}.content")
            content = "".join(p["text"] for p in content)
        elif content is None and m["role"] == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise BadRequest(f"{where}.content must be a string or an array of text parts", f"{where}.content")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def completion_prompt(body: dict, tokenizer) -> list[int]:
    """The token ids of a text completion's `prompt`: a string (BOS added as the model wants), one string in an
    array, or an array of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise BadRequest(f"'prompt' holds token ids outside the vocabulary (0 to {tokenizer.vocab_size - 1})",
                             "prompt")
        return list(prompt)
    raise BadRequest("'prompt' must be a string, or an array of token ids", "prompt")


# --- HTTP ------------------------------------------------------------------------------------------------------


class Server:
    """The HTTP side: aiohttp handlers putting jobs to a `Scheduler` and answering from their events."""

    def __init__(self, scheduler: Scheduler, model_id: str, api_key: str | None = None,
                 defaults: SamplerConfig | None = None):
        self.scheduler = scheduler
        self.engine = scheduler.engine
        self.model_id = model_id
        self.api_key = api_key
        self.defaults = defaults or SamplerConfig()
        self.created = int(time.time())
        self.template = chat_template_from_metadata(self.engine.metadata)
        self.n_ctx = scheduler.batch.n_ctx
        self.runner: web.AppRunner | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(client_max_size=MAX_BODY, middlewares=[self._errors, self._auth])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        return app

    def start(self, sock: socket.socket) -> str:
        """Serve on the listening socket `sock` (`listen`) from a thread of its own; returns the base URL."""
        started = threading.Event()
        failure: list[BaseException] = []
        url: list[str] = []

        def serve() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            try:
                # A client that goes away cancels its handler, and so its job (`_answer`), streamed or not.
                self.runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
                self.loop.run_until_complete(self.runner.setup())
                site = web.SockSite(self.runner, sock)
                self.loop.run_until_complete(site.start())
                h, p = self.runner.addresses[0][:2]
                url.append(f"http://{f'[{h}]' if ':' in h else h}:{p}")
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                failure.append(e)
                started.set()
                return
            started.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self.runner.cleanup())
            self.loop.close()

        threading.Thread(target=serve, name="polystrata-http", daemon=True).start()
        started.wait()
        if failure:
            raise failure[0]
        return url[0]

    def close(self) -> None:
        """Stop listening (from any thread)."""
        if self.loop is not None and self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)

    # middlewares

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except BadRequest as e:
            return web.json_response(error_body(e.message, e.kind, e.param, e.code), status=e.status)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            message = {404: f"no such endpoint: {request.method} {request.path}",
                       405: f"{request.method} is not allowed on {request.path}",
                       413: f"the request body is larger than {MAX_BODY} bytes"}.get(e.status, e.reason)
            return web.json_response(error_body(message, kind), status=e.status)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:  # never a traceback to the client
            print(f"error: {request.method} {request.path}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return web.json_response(error_body("internal server error", "server_error"), status=500)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key is not None and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                raise BadRequest("invalid API key: send 'Authorization: Bearer KEY'", status=401,
                                 code="invalid_api_key")
        return await handler(request)

    # endpoints

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "polystrata",
             "meta": {"n_ctx": self.n_ctx, "n_parallel": self.scheduler.batch.n_seq, "target": self.engine.target}}]})

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        req = parse_common(body, self.n_ctx, self.defaults)
        messages = chat_messages(body)
        if not self.template:
            raise BadRequest("the model has no chat template; use /v1/completions", "messages")
        ids = await self._off_loop(encode_chat, self.engine.tokenizer, self.template, messages)
        return await self._answer(request, req, ids, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        req = parse_common(body, self.n_ctx, self.defaults)
        ids = await self._off_loop(completion_prompt, body, self.engine.tokenizer)
        return await self._answer(request, req, ids, chat=False)

    # helpers

    @staticmethod
    async def _body(request: web.Request) -> dict:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        _get(body, "model", (str,))
        return body

    @staticmethod
    async def _off_loop(fn, *args):
        """Run a template rendering or tokenization in a worker thread; its PolystrataError becomes a 400."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        except PolystrataError as e:
            raise BadRequest(str(e)) from None

    async def _answer(self, request: web.Request, req: Request, ids: list[int], chat: bool) -> web.StreamResponse:
        if not ids:
            raise BadRequest("the prompt has no tokens", "prompt")
        if len(ids) > self.n_ctx:
            raise BadRequest(f"the prompt has {len(ids)} tokens, more than the {self.n_ctx} a sequence holds "
                             f"(context {self.engine.n_ctx} / {self.scheduler.batch.n_seq} parallel sequences)",
                             "messages" if chat else "prompt", code="context_length_exceeded")
        job = Job(ids, req.max_tokens, req.sampling, req.stops, asyncio.get_running_loop(), req.ignore_eos)
        self.scheduler.submit(job)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_id}
        try:
            if req.stream:
                return await self._stream(request, req, job, head, chat)
            return await self._whole(job, head, chat)
        finally:
            job.cancelled = True  # a no-op once it is done; else the scheduler frees its slot

    def _usage(self, job: Job) -> dict:
        n = len(job.prompt_ids)
        return {"prompt_tokens": n, "completion_tokens": job.n_generated, "total_tokens": n + job.n_generated}

    async def _whole(self, job: Job, head: dict, chat: bool) -> web.Response:
        parts = []
        while True:
            kind, value = await job.events.get()
            if kind == "text":
                parts.append(value)
            elif kind == "error":
                return web.json_response(error_body(value, "server_error"), status=500)
            else:
                break
        text = "".join(parts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": value} if chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": value})
        return web.json_response({**head, "choices": [choice], "usage": self._usage(job)})

    async def _stream(self, request: web.Request, req: Request, job: Job, head: dict,
                      chat: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        async def send(obj: dict | str) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await resp.write(f"data: {data}\n\n".encode())

        def chunk(text: str | None, reason: str | None = None, role: bool = False) -> dict:
            if chat:
                delta = ({"role": "assistant", "content": ""} if role else
                         {"content": text} if text is not None else {})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            return {**head, "choices": [choice]}

        try:
            if chat:
                await send(chunk(None, role=True))
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    await send(chunk(value))
                elif kind == "error":
                    await send(error_body(value, "server_error"))
                    break
                else:
                    await send(chunk(None, value))
                    if req.include_usage:
                        await send({**head, "choices": [], "usage": self._usage(job)})
                    break
            await send("[DONE]")
            await resp.write_eof()
        except ConnectionResetError:  # the client went away; `_answer` cancels the job
            pass
        return resp


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (0: any free port), taken before the model loads, so that an address in use
    or not allowed is refused at once rather than after the compile; connections wait in its backlog until
    `Server.start` serves it."""
    try:
        name = host.strip("[]")  # [::1], as URLs write IPv6 addresses
        family = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((name, port), family=family, backlog=128)
    except OSError as e:
        # create_server's message adds the address: the reason alone is os.strerror's (name resolution's errors,
        # negative numbers, carry theirs in strerror).
        reason = os.strerror(e.errno) if e.errno and e.errno > 0 else e.strerror or e
        raise PolystrataError(f"cannot listen on {host}:{port}: {reason}") from None


def serve(engine: Engine, n_seq: int, sock: socket.socket, model_id: str, api_key: str | None = None,
          ready: Callable[[str], None] | None = None) -> None:
    """Serve `engine` over HTTP on the listening socket `sock` (`listen`) until interrupted: the scheduler runs in
    this thread, the event loop in another. `ready` is called with the base URL once the server answers."""
    scheduler = Scheduler(engine, n_seq)
    server = Server(scheduler, model_id, api_key)
    url = server.start(sock)
    if ready:
        ready(url)
    try:
        scheduler.run()
    finally:
        server.close()
