"""`qwen38 serve MODEL`: one long-running engine behind an OpenAI-compatible chat endpoint.

    POST /v1/chat/completions   (streaming: SSE `data:` chunks, then `data: [DONE]`)
    GET  /v1/models             GET /health

Every call goes through the one engine path: the body becomes `build_request`'s arguments
(openai_api.py), so bad options, an over-window prompt or an unknown model are refused with
a 400 / 404 naming the numbers before any work. Calls then wait in one queue and run one at
a time on the engine; a small pool of sessions (and the prefix store under them) gives a
follow-up conversation its cached tokens; admission refuses what cannot fit. A client that
disconnects (or stops reading a stream) cancels its generation at the next prefill chunk or
token, or takes it out of the queue.

Under `mlx.launch` every rank runs this same program (SPMD): rank 0 listens, and for each
call sends its arguments (the token ids it rendered and the sampling seed it decided) to the
other ranks (spmd.py), which build the same request, check the ids, and run the same
generation; only rank 0 answers. Admission, state reuse and cancels are agreed on by all
ranks. With a sharded model (`load(path, group=...)`) the forward passes' all-reduces meet
because every rank makes the same calls.
"""

from __future__ import annotations

import inspect
import json
import os
import queue
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .errors import (
    AdmissionError,
    ContextWindowError,
    InvalidOptionError,
    ModelNotFoundError,
    Qwen38Error,
)
from .openai_api import ChatCall, Reply, error_body, models_body, parse_chat_request
from .prefix_store import PrefixStore, default_directory
from .request import Request, build_request
from .session import Session, default_store
from .session_pool import SessionPool
from .spmd import RankCancel, Ranks

POLL = 0.05  # seconds between looks at a waiting client's socket


class RankSession(Session):
    """A Session whose per-rank decisions are agreed on by every rank before any work:
    admission (each rank against its own memory; one refusal refuses on all) and the state
    to continue from (the live state or a state file; if the ranks would start from
    different offsets, all recompute the prompt)."""

    def __init__(self, model: Any, ranks: Ranks, **options: Any):
        super().__init__(model, **options)
        self.ranks = ranks

    def _admit(self, ids, params, kv) -> None:
        error = None
        try:
            super()._admit(ids, params, kv)
        except Qwen38Error as e:
            error = e
        self.ranks.agree(error)

    def _prepare_state(self, ids, kv):
        state = super()._prepare_state(ids, kv)
        if len(set(self.ranks.gather_int(state.offset))) > 1:
            state = self.model.new_state(**kv)
        return state


@dataclass
class Job:
    """One call waiting for (or on) the engine; `out` carries ("event", Event),
    ("error", exception) and finally ("end", None) back to its HTTP thread."""

    call: ChatCall
    request: Request
    cancel: threading.Event = field(default_factory=threading.Event)
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


class Busy(Qwen38Error):
    """The queue is full, or the server is stopping."""


class Engine:
    """The model, its sessions and the queue of calls; `loop()` runs them, on every rank."""

    def __init__(
        self,
        model: Any,
        ranks: Ranks | None = None,
        sessions: int = 2,
        max_queue: int = 16,
        defaults: dict[str, Any] | None = None,
    ):
        self.model = model
        # server-wide options (`qwen38 serve --kv-topk ...`); a request's own override them
        self.defaults = dict(defaults or {})
        self.name = str(model.name)
        self.ranks = ranks or Ranks()
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.stopping = threading.Event()
        self.current: Job | None = None
        self.counts = {"answered": 0, "cancelled": 0, "failed": 0}  # rank 0's calls (/health)
        store = default_store() if self.ranks.size == 1 else self._rank_store()
        self.pool = SessionPool(lambda: RankSession(model, self.ranks, cache=store), sessions)

    def _rank_store(self) -> PrefixStore:
        # each rank writes its own state files (its shard of the state), never another's
        r = self.ranks
        return PrefixStore(default_directory() / f"serve-rank{r.rank}-of-{r.size}")

    # ----- rank 0: calls in ------------------------------------------------------------------
    def prepare(self, call: ChatCall) -> Job:
        """Decide the call now (refusals before it queues); a sampling call without a seed
        gets one here, so every rank draws the same tokens."""
        call.args = {**self.defaults, **call.args}  # the other ranks get the merged options
        request = build_request(self.model, **call.args)
        if not request.params.greedy and request.params.seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
            request.params.seed = seed
            call.args["seed"] = seed
        return Job(call, request)

    def submit(self, job: Job) -> None:
        if self.stopping.is_set():
            raise Busy("the server is stopping")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise Busy(f"{self.jobs.maxsize} calls are already waiting; try again later") from None

    # ----- every rank: the loop ------------------------------------------------------------
    def loop(self) -> None:
        """Run calls until stopped (rank 0: from the queue; other ranks: from rank 0)."""
        if not self.ranks.leader:
            while True:
                message = self.ranks.broadcast_json()
                if message.get("op") == "stop":
                    return
                self._run(message, None)
        while not self.stopping.is_set():
            try:
                job = self.jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            if job.cancel.is_set():  # its client left while it waited
                self.counts["cancelled"] += 1
                job.out.put(("end", None))
                continue
            message = {"op": "generate", "args": job.call.args, "ids": job.request.ids}
            if self.ranks.size > 1:
                self.ranks.broadcast_json(message)
            self.current = job
            try:
                self._run(message, job)
            finally:
                self.current = None
        self._drain()
        if self.ranks.size > 1:
            self.ranks.broadcast_json({"op": "stop"})

    def _drain(self) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            job.out.put(("error", Busy("the server is stopping")))
            job.out.put(("end", None))

    def _run(self, message: dict, job: Job | None) -> None:
        """One call on this rank; rank 0 passes its job and sends events back through it."""
        try:
            if job is not None:
                request = job.request
                self.ranks.agree(None)  # the other ranks' _rebuild
            else:
                request = self._rebuild(message)
            session = self.pool.acquire(request.ids)
            cancel = RankCancel(self.ranks, job.cancel if job is not None else None)
            events = session.generate(request, cancel=cancel)
            for event in events:
                if job is not None:
                    if event.type == "done" and session.last_stats is not None:
                        job.out.put(("stats", session.last_stats))
                    job.out.put(("event", event))
            if job is not None:
                stats = session.last_stats
                done = "cancelled" if stats and stats.finish_reason == "cancelled" else "answered"
                self.counts[done] += 1
        except Exception as e:  # noqa: BLE001 - reported to the client; the server goes on
            if job is not None:
                self.counts["failed"] += 1
                job.out.put(("error", e))
            else:
                sys.stderr.write(f"qwen38 serve (rank {self.ranks.rank}): {e}\n")
        finally:
            if job is not None:
                job.out.put(("end", None))

    def _rebuild(self, message: dict) -> Request:
        """The call as rank 0 decided it (ranks other than 0); agreed on by all ranks."""
        error = None
        request = None
        try:
            request = build_request(self.model, **message["args"])
            if request.ids != message["ids"]:
                raise InvalidOptionError(
                    f"rank {self.ranks.rank} rendered the prompt to other token ids than "
                    "rank 0 (different weights or tokenizer on this rank?)"
                )
        except Qwen38Error as e:
            error = e
        self.ranks.agree(error)
        assert request is not None
        return request


# ----- HTTP -------------------------------------------------------------------------------


STATUS = (
    (ModelNotFoundError, 404, "not_found_error", "model_not_found"),
    (ContextWindowError, 400, "invalid_request_error", "context_length_exceeded"),
    (InvalidOptionError, 400, "invalid_request_error", "invalid_option"),
    (AdmissionError, 400, "invalid_request_error", "admission_refused"),
    (Busy, 503, "server_error", "busy"),
    (Qwen38Error, 500, "server_error", "engine_error"),
)


def status_of(exc: BaseException) -> tuple[int, str, str]:
    for cls, status, kind, code in STATUS:
        if isinstance(exc, cls):
            return status, kind, code
    return 500, "server_error", "internal_error"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    engine: Engine  # set on the server's subclass (make_server)
    started: int = 0
    quiet = False

    def log_message(self, format: str, *args: Any) -> None:
        if not self.quiet:
            sys.stderr.write(f"qwen38 serve: {self.address_string()} {format % args}\n")

    # ----- plumbing ------------------------------------------------------------------------
    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: BaseException) -> None:
        status, kind, code = status_of(exc)
        self._json(status, error_body(str(exc), kind, code))

    def _gone(self) -> bool:
        """Whether the client closed its end (a readable socket with nothing to read)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _next(self, job: Job) -> tuple[str, Any]:
        """The job's next item; a client gone meanwhile cancels the job."""
        while True:
            try:
                return job.out.get(timeout=POLL)
            except queue.Empty:
                if not job.cancel.is_set() and self._gone():
                    job.cancel.set()

    # ----- routes --------------------------------------------------------------------------
    def do_GET(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path in ("/v1/models", "/models"):
            self._json(200, models_body(self.engine.name, self.started))
        elif path in ("/health", "/v1/health"):
            engine = self.engine
            body = {"status": "ok", "model": engine.name, "ranks": engine.ranks.size}
            self._json(200, {**body, "waiting": engine.jobs.qsize(), **engine.counts})
        else:
            self._json(404, error_body(f"no route GET {self.path}", "not_found_error"))

    def do_POST(self) -> None:
        path = self.path.split("?")[0].rstrip("/")
        if path not in ("/v1/chat/completions", "/chat/completions"):
            self._json(404, error_body(f"no route POST {self.path}", "not_found_error"))
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"null")
        except ValueError as e:
            self._json(400, error_body(f"the body is not JSON: {e}", "invalid_request_error"))
            return
        try:
            call = parse_chat_request(body, self.engine.name)
            job = self.engine.prepare(call)
            self.engine.submit(job)
        except Qwen38Error as e:
            self._error(e)
            return
        reply = Reply(self.engine.name)
        kind, item = self._next(job)  # errors before the first event answer with a status
        if kind == "error":
            self._error(item)
            self._finish(job)
            return
        if call.stream:
            self._stream(job, reply, call, (kind, item))
        else:
            self._whole(job, reply, (kind, item))

    def _finish(self, job: Job) -> None:
        kind = None
        while kind != "end":
            kind, _ = self._next(job)

    def _whole(self, job: Job, reply: Reply, item: tuple[str, Any]) -> None:
        error = None
        while item[0] != "end":
            kind, payload = item
            if kind == "event":
                reply.feed(payload)
            elif kind == "stats":
                reply.extra = _figures(payload)
            elif kind == "error":
                error = payload
            item = self._next(job)
        if job.cancel.is_set():
            self.close_connection = True
            return
        if error is not None:
            self._error(error)
        else:
            self._json(200, reply.completion())

    def _stream(self, job: Job, reply: Reply, call: ChatCall, item: tuple[str, Any]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

        def send(obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        try:
            send(reply.first_chunk())
            while item[0] != "end":
                kind, payload = item
                if kind == "event":
                    for chunk in reply.feed(payload):
                        send(chunk)
                elif kind == "stats":
                    reply.extra = _figures(payload)
                elif kind == "error":  # after the headers: an error object in the stream
                    status, what, code = status_of(payload)
                    send(error_body(str(payload), what, code))
                item = self._next(job)
            if reply.done is not None:
                for chunk in reply.last_chunks(call.include_usage):
                    send(chunk)
            send("[DONE]")
        except (BrokenPipeError, ConnectionResetError):
            job.cancel.set()
            self._finish(job)


def _figures(stats: Any) -> dict[str, Any]:
    """The engine's own figures of one call (beside OpenAI's usage): speeds, the KV store's
    counters (pages spilled / fetched, ...) and the drafting figures."""
    return {
        "finish_reason": stats.finish_reason,
        "prefill_tokens_per_second": round(stats.prefill_tokens_per_second, 2),
        "decode_tokens_per_second": round(stats.decode_tokens_per_second, 2),
        "prefill_seconds": round(stats.prefill_seconds, 4),
        "decode_seconds": round(stats.decode_seconds, 4),
        "kv": dict(stats.kv or {}),
        "draft": stats.draft_stats(),
    }


def make_server(
    engine: Engine | None, host: str, port: int, quiet: bool = False
) -> ThreadingHTTPServer:
    """An HTTP server for `engine` (not started; set `RequestHandlerClass.engine` before
    starting it if None); port 0 picks a free port."""
    handler = type(
        "BoundHandler", (Handler,), {"engine": engine, "started": int(time.time()), "quiet": quiet}
    )
    try:
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise InvalidOptionError(f"cannot listen on {host}:{port}: {e}") from e
    server.daemon_threads = True
    return server


def load_for_ranks(model: str, ranks: Ranks, dtype: str | None = None) -> Any:
    """The model on this rank: split over the ranks where `load` can shard, else whole."""
    import qwen38_backend

    options: dict[str, Any] = {"dtype": dtype}
    if ranks.size > 1 and "group" in inspect.signature(qwen38_backend.load).parameters:
        options["group"] = ranks.group
    return qwen38_backend.load(model, **options)


def serve(
    model: str,
    host: str = "127.0.0.1",
    port: int = 8080,
    dtype: str | None = None,
    sessions: int = 2,
    max_queue: int = 16,
    quiet: bool = False,
    defaults: dict[str, Any] | None = None,
) -> int:
    """Load `model` and serve it until SIGINT / SIGTERM (every rank of an mlx.launch job
    calls this; rank 0 listens on host:port)."""
    import mlx.core as mx

    if not 0 <= port <= 65535:
        raise InvalidOptionError(f"--port {port}: must be 0-65535 (0: any free port)")
    if sessions < 1 or max_queue < 1:
        raise InvalidOptionError("--sessions and --max-queue must be at least 1")
    group = mx.distributed.init()
    ranks = Ranks(group if group.size() > 1 else None)
    # rank 0 claims its port before loading, so a taken port fails at once
    server = make_server(None, host, port, quiet) if ranks.leader else None
    engine = Engine(load_for_ranks(model, ranks, dtype), ranks, sessions, max_queue, defaults)
    if server is None:
        # rank 0 says when to stop (a signal to the whole job reaches it too)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        engine.loop()
        return 0
    server.RequestHandlerClass.engine = engine  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, name="qwen38-http", daemon=True)
    thread.start()

    def stop(signum: int, frame: Any) -> None:
        engine.stopping.set()
        if engine.current is not None:
            engine.current.cancel.set()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    bound_host, bound_port = server.server_address[:2]
    sys.stderr.write(
        f"qwen38 serve: {engine.name} on http://{bound_host}:{bound_port}/v1 "
        f"({ranks.size} rank{'s' if ranks.size > 1 else ''}); Ctrl-C stops\n"
    )
    sys.stderr.flush()
    try:
        engine.loop()
    finally:
        server.shutdown()
        server.server_close()
    return 0
