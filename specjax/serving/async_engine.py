"""Continuous batching over one `Engine`, driven by a single background thread.

Requests arrive at any time from any thread (`AsyncEngine.submit`); one thread owns the engine and
loops: move newly submitted requests into the engine (`add_request`; a ValueError there is reported
to that request alone), run `engine.step()` (admit waiting requests into free slots, then one
speculative round), and hand each request its new tokens (a streaming delta) and, when it ends, its
completion. A slot freed in a round is refilled at the next step, so prefills interleave with the
speculative rounds of the other requests.

Each request gets a `RequestStream`: iterate it (blocking, any thread), `await stream.aget()` /
`async for` it (asyncio: the engine thread wakes the event loop, no thread per waiting request), or
call `result()` to wait for the finished `EngineRequest`.

Back-pressure: with `max_waiting` set, `submit` refuses a request (`QueueFullError`) while that many
are already waiting for a slot. `drain()` waits until every submitted request has ended (for a
graceful shutdown); `abort()` ends one early and frees its slot.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import traceback
from typing import Any, AsyncIterator, Iterator

from specjax.decoding.engine import Engine, EngineRequest
from specjax.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)


class RequestError(RuntimeError):
    """A request failed: refused by the engine (`rejected`), or the engine stopped under it."""

    def __init__(self, message: str, *, rejected: bool = False):
        super().__init__(message)
        self.rejected = rejected


class QueueFullError(RequestError):
    """`submit` refused a request: `max_waiting` requests are already waiting for a slot."""


@dataclasses.dataclass
class StreamEvent:
    """New tokens of one request since the previous event; the last event has `finished` set.

    On the final event `output_ids` is the request's complete output (after stop-string trimming) and
    `finish_reason` is stop | length | abort; `error` is set instead when the request failed."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    output_ids: list[int] | None = None
    error: str | None = None
    rejected: bool = False
    field: str | None = None  # the request field the engine refused it for, when it names one


class RequestStream:
    """The consumer side of one submitted request (thread-safe)."""

    def __init__(self, request: EngineRequest, holdback_tokens: int = 0):
        self.request = request
        self.holdback_tokens = max(int(holdback_tokens), 0)
        self._q: queue.Queue[StreamEvent] = queue.Queue()
        try:  # made on an event loop: the engine thread wakes that loop on every event
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._ready = asyncio.Event() if self._loop is not None else None
        self.done = threading.Event()
        self.aborted = False
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.rejected = False
        self._on_end: Any = None  # set by AsyncEngine.submit: called once when the request ends
        # engine-thread bookkeeping
        self._sent = 0
        self._counted = 0

    # producer side (engine thread)
    def _push(self, ev: StreamEvent) -> None:
        if ev.finished:
            if self.done.is_set():
                return  # ended already (e.g. aborted, then failed by a shutdown)
            self.finish_reason, self.error, self.rejected = ev.finish_reason, ev.error, ev.rejected
        self._q.put(ev)
        if ev.finished:
            self.done.set()
            if self._on_end is not None:
                self._on_end()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the loop has closed: nobody is waiting any more
                pass

    def _fail(self, message: str, *, rejected: bool = False, field: str | None = None) -> None:
        self._push(StreamEvent([], finished=True, finish_reason=None, error=message, rejected=rejected, field=field))

    # consumer side
    def get(self, timeout: float | None = None) -> StreamEvent:
        """The next event; raises `queue.Empty` after `timeout` seconds."""
        return self._q.get(timeout=timeout)

    def __iter__(self) -> Iterator[StreamEvent]:
        while True:
            ev = self._q.get()
            yield ev
            if ev.finished:
                return

    async def aget(self, timeout: float | None = None) -> StreamEvent:
        """The next event, awaited on the loop the stream was made on; TimeoutError after `timeout` s."""
        if self._ready is None:
            raise RuntimeError("aget() needs a stream submitted from a running event loop")
        while True:
            try:
                return self._q.get_nowait()
            except queue.Empty:
                pass
            self._ready.clear()
            try:  # an event pushed between the first look and clear() has set _ready after it
                return self._q.get_nowait()
            except queue.Empty:
                pass
            await asyncio.wait_for(self._ready.wait(), timeout)

    async def __aiter__(self) -> AsyncIterator[StreamEvent]:
        while True:
            ev = await self.aget()
            yield ev
            if ev.finished:
                return

    def result(self, timeout: float | None = None) -> EngineRequest:
        """Wait for the end; the finished request, or RequestError (TimeoutError after `timeout`)."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request.request_id} did not finish within {timeout} s")
        if self.error is not None:
            raise RequestError(self.error, rejected=self.rejected)
        return self.request


class AsyncEngine:
    """Owns `engine` on one background thread (see module docstring).

    metrics: optional `ServingMetrics` fed with every round, admission, token and completion.
    idle_wait_s: how long the idle loop sleeps between checks when nothing arrives (it wakes at once
        on a submission).
    max_waiting: most requests waiting for a slot (submitted, not yet admitted); beyond it `submit`
        raises `QueueFullError`. None: unbounded.
    """

    def __init__(self, engine: Engine, *, metrics: ServingMetrics | None = None, idle_wait_s: float = 0.5,
                 max_waiting: int | None = None):
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {max_waiting}")
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self.max_waiting = max_waiting
        self._inbox: queue.Queue[tuple[str, RequestStream]] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._live: dict[int, RequestStream] = {}  # id(EngineRequest) -> stream, engine thread only
        self._thread: threading.Thread | None = None
        self._submit_lock = threading.Lock()
        self._ended = threading.Condition(self._submit_lock)  # notified when a request ends
        # guarded by _submit_lock: "add"s still in the inbox, requests in engine.queue, requests not ended
        self._n_inbox = self._n_queued = self._n_open = 0
        self.error: str | None = None  # set when the engine loop died
        self.steps = 0
        self._preemptions0 = engine.stats["preemptions"]  # the metrics count the engine's preemptions from here
        prev = self._prev_on_round = engine.on_round

        def on_round(info: dict[str, Any]) -> None:
            if prev is not None:
                prev(info)
            if self.metrics is not None:
                self.metrics.observe_round(info)
        self._on_round = engine.on_round = on_round

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "AsyncEngine":
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._thread = threading.Thread(target=self._run, name="specjax-engine", daemon=True)
        self._thread.start()
        return self

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted request has ended; False if some are still open after `timeout` s."""
        with self._ended:
            return self._ended.wait_for(lambda: self._n_open == 0, timeout)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop; requests still in flight end with an error ("engine shut down").
        Call `drain()` first to let them finish."""
        with self._submit_lock:
            self._stop.set()
        self._wake.set()
        if self._thread is None:
            with self._submit_lock:
                self._fail_all("engine shut down")
        else:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("engine thread still busy %.1f s after shutdown was asked", timeout)
                return
        if self.engine.on_round is self._on_round:  # hand the engine back as we found it
            self.engine.on_round = self._prev_on_round

    def __enter__(self) -> "AsyncEngine":
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ client API (any thread)
    def submit(self, request: EngineRequest, *, holdback_tokens: int = 0) -> RequestStream:
        """Queue a request; its events arrive on the returned stream.

        holdback_tokens: keep this many newest tokens out of the deltas until the request ends (a stop
        string may trim them: with stop strings of at most L characters, L tokens suffice).
        Raises RequestError when the engine is not running, QueueFullError when `max_waiting`
        requests are already waiting for a slot."""
        stream = RequestStream(request, holdback_tokens)
        with self._submit_lock:
            if self._stop.is_set() or self.error is not None:
                raise RequestError(f"engine is not running: {self.error or 'shut down'}")
            waiting = self._n_inbox + self._n_queued
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise QueueFullError(f"the server is at capacity: {waiting} requests are waiting for one of "
                                     f"{self.engine.cfg.max_slots} slots (limit {self.max_waiting}); retry later")
            stream._on_end = self._request_ended
            self._n_inbox += 1
            self._n_open += 1
            self._inbox.put(("add", stream))
        self._wake.set()
        return stream

    def _request_ended(self) -> None:
        with self._ended:
            self._n_open -= 1
            self._ended.notify_all()

    def abort(self, stream: RequestStream) -> None:
        """End a request early (finish_reason "abort"): dropped if it is still waiting, else its slot
        is freed after at most one more round. A no-op once it has finished."""
        if stream.done.is_set():
            return
        stream.aborted = True
        self._inbox.put(("abort", stream))
        self._wake.set()

    def reset_prefix_cache(self) -> bool:
        """vLLM's: the engine thread forgets the rows every slot keeps before it takes the next request
        submitted after this call. False (nothing to forget) when prefix caching is off."""
        if self.engine.prefixes is None:
            return False
        self._inbox.put(("reset", None))
        self._wake.set()
        return True

    def generate(self, request: EngineRequest, timeout: float | None = None) -> EngineRequest:
        """Submit and wait (blocking convenience)."""
        return self.submit(request).result(timeout)

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet in a slot."""
        return self._n_inbox + self._n_queued

    @property
    def num_open(self) -> int:
        """Requests submitted and not yet ended (waiting or running)."""
        return self._n_open

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._drain()
                if not self.engine.has_work():
                    self._update_gauges()
                    self._wake.wait(self.idle_wait_s)
                    continue
                finished = self.engine.step()
                self.steps += 1
                with self._submit_lock:
                    self._n_queued = len(self.engine.queue)
                self._deliver(finished)
                self._update_gauges()
        except Exception as e:  # the engine's device state is unknown now: stop serving
            self.error = f"{type(e).__name__}: {e}"
            log.error("engine loop failed:\n%s", traceback.format_exc())
            with self._submit_lock:
                self._fail_all(f"engine failed: {self.error}")
            return
        with self._submit_lock:
            self._fail_all("engine shut down")

    def _drain(self) -> None:
        """Move the inbox into the engine (adds and aborts)."""
        while True:
            try:
                kind, stream = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "reset":
                self.engine.prefixes.forget_all()
                continue
            req = stream.request
            if kind == "add":
                with self._submit_lock:
                    self._n_inbox -= 1
                    self._n_queued += 1  # until recounted below
                if stream.aborted:
                    self._finish_aborted(stream)
                    continue
                try:
                    self.engine.add_request(req)
                except ValueError as e:  # bad request: that request alone fails
                    if self.metrics is not None:
                        self.metrics.request_rejected("invalid_request")
                    stream._fail(str(e), rejected=True, field=getattr(e, "field", None))
                    continue
                self._live[id(req)] = stream
                if self.metrics is not None:
                    self.metrics.request_admitted(len(req.prompt_ids))
            elif kind == "abort" and id(req) in self._live and req.finish_reason is None:
                waiting = [i for i, r in enumerate(self.engine.queue) if r is req]
                if waiting:  # not admitted yet: drop it
                    del self.engine.queue[waiting[0]]
                    del self._live[id(req)]
                    self._finish_aborted(stream)
                else:  # in a slot: let it end after one more token (the engine frees the slot)
                    req.max_tokens = min(req.max_tokens, len(req.output_ids) + 1)
        with self._submit_lock:
            self._n_queued = len(self.engine.queue)

    def _finish_aborted(self, stream: RequestStream) -> None:
        req = stream.request
        req.finish_reason = "abort"
        req.metrics.finish_time = time.perf_counter()
        if self.metrics is not None:
            self.metrics.request_finished("abort")
        stream._push(StreamEvent([], finished=True, finish_reason="abort", output_ids=list(req.output_ids)))

    def _count(self, stream: RequestStream) -> None:
        n = len(stream.request.output_ids)
        if self.metrics is not None and n > stream._counted:
            self.metrics.tokens_generated(n - stream._counted)
        stream._counted = max(stream._counted, n)

    def _deliver(self, finished: list[EngineRequest]) -> None:
        for stream in self._live.values():
            req = stream.request
            if req.finish_reason is not None:
                continue
            self._count(stream)
            upto = len(req.output_ids) - stream.holdback_tokens
            if upto > stream._sent:
                stream._push(StreamEvent(list(req.output_ids[stream._sent:upto])))
                stream._sent = upto
        for req in finished:
            stream = self._live.pop(id(req), None)
            if stream is None:
                continue
            self._count(stream)
            reason = "abort" if stream.aborted else (req.finish_reason or "length")
            req.finish_reason = reason
            m = req.metrics
            if self.metrics is not None:
                self.metrics.request_finished(reason, m.latencies(len(req.output_ids)),
                                              (len(req.prompt_ids), len(req.output_ids)))
                if self.engine.prefixes is not None and req.slot >= 0:  # it reached a slot
                    self.metrics.prefix_cache_lookup(len(req.prompt_ids), m.cached_tokens)
            new = list(req.output_ids[stream._sent:])
            stream._sent = len(req.output_ids)
            stream._push(StreamEvent(new, finished=True, finish_reason=reason, output_ids=list(req.output_ids)))

    def _update_gauges(self) -> None:
        if self.metrics is not None:
            eng = self.engine
            held = sum(int(eng.lengths[i]) for i, r in enumerate(eng.slot_req) if r is not None)
            self.metrics.engine_preemptions(eng.stats["preemptions"] - self._preemptions0)
            self.metrics.set_queue(running=eng.num_active, waiting=self.num_waiting,
                                   cache_usage=held / (eng.cfg.max_slots * eng.cfg.max_len))

    def _fail_all(self, message: str) -> None:
        """End every open request with `message` (caller holds _submit_lock)."""
        streams = list(self._live.values())
        self._live.clear()
        while True:
            try:
                _, stream = self._inbox.get_nowait()
            except queue.Empty:
                break
            streams.append(stream)
        self._n_inbox = self._n_queued = 0
        for stream in streams:
            if not stream.done.is_set():
                stream._on_end = None  # counted here: the lock is held
                stream._fail(message)
                self._n_open -= 1
        self._ended.notify_all()
