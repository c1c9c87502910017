"""The tinylm scheduler: one thread that batches every active request into each forward.

HTTP handler threads ``submit`` requests and block on the returned ``Pending``; the scheduler
thread owns the ``TinyLMRuntime`` (and so the KV cache) and loops:

1. take new requests, aborts, pauses and weight swaps from its inbox (blocking only when nothing
   is running or it is paused); a weight swap (``update_weights``) therefore lands between two
   forwards, and every reply's ``meta_info["weight_version"]`` is the version loaded when it
   finished, as in SGLang (``TokenizerManager`` reads ``weight_version`` when it builds
   ``meta_info``);
2. admit waiting requests while KV slots are free (a prompt is prefilled whole, and at most
   ``max_prefill_tokens`` of new prompt tokens join one step, so long prompts cannot starve
   running decodes indefinitely);
3. run **one** forward for all running sequences: a prefill chunk for each new one, a one-token
   decode chunk for each of the others;
4. sample, record logprobs, apply stop conditions, and resolve finished requests.

Output mirrors SGLang's ``/generate`` (``GenerateOutput.meta_info``, shaped by ``replies.py``):
logprob entries are ``[logprob, token_id, text_or_null]`` triples; ``input_token_logprobs``
covers prompt positions ``logprob_start_len .. prompt_len - 1`` and its first entry (the token
at ``logprob_start_len``) has a ``null`` logprob, as SGLang 0.5.23 writes it
(``managers/scheduler_components/logprob_result_processor.py``,
``_process_input_token_logprobs``: ``[None] + input_token_logprobs[:-1]``; the same for
``input_top_logprobs``); ``finish_reason`` is ``{"type": "stop", "matched": id_or_str}``,
``{"type": "length", "length": n}`` or an abort. ``weight_versions`` says which weight version
produced which output tokens: the version changes under a running request only when an update
lands while generation is paused in place (``Scheduler.record_weight_version_change`` records
the change for every live request with output).

An aborted request (``abort``, or the scheduler closing) resolves with what it had generated so
far and an abort finish reason. ``abort(rid)`` aborts every request whose rid *starts with*
``rid``, as SGLang's ``Scheduler.abort_request`` does (``req.rid.startswith(recv_req.rid)``);
whether an ``/abort_request`` reaches the scheduler at all is the server's decision
(``TokenizerManager.abort_request``, see ``server.py``). A running request ends with
``FINISH_ABORT()``'s reason; one aborted while still queued is answered as SGLang's
``TokenizerManager._handle_abort_req`` answers it (message ``Abort in waiting queue``, no
``prompt_tokens`` or ``cached_tokens``).

Only ids the tokenizer can decode are ever sampled or reported: the model's vocabulary is padded
past the tokenizer's size (``init_model`` rounds it up to a multiple of 64, as real checkpoints
do), and the spare logits are cut off before sampling and ``log_softmax``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from tinylm.replies import (
    LogprobPairs,
    TopRows,
    abort_reason,
    logprob_fields,
    meta_info,
    queued_abort_meta,
    version_spans,
)
from tinylm.runtime import Chunk, ModelShape, TinyLMRuntime
from tinylm.sampling import LogprobMode, SamplingParams, next_token

__all__ = [
    "GenerateOutput",
    "GenerateRequest",
    "GenerationScheduler",
    "Pending",
    "SchedulerClosed",
    "TokenEvent",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

SHUTDOWN_REASON = {"type": "abort", "message": "server is shutting down"}


class SchedulerClosed(RuntimeError):
    """The scheduler is shut down and takes no more requests."""


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One validated ``/generate`` request (a batch request is several of these)."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False  # publish each sampled token on the Pending as it is drawn


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """One sampled token of a streamed request, with its logprob (and top-k) when asked."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[float, int], ...] | None = None


@dataclass(frozen=True, kw_only=True)
class GenerateOutput:
    """A finished request, shaped like one SGLang ``/generate`` reply."""

    rid: str
    text: str
    output_ids: tuple[int, ...]
    meta_info: dict[str, Any]

    @property
    def finish_type(self) -> str:
        return str(self.meta_info["finish_reason"]["type"])

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self.meta_info}


class Pending:
    """Handle on a submitted request; ``wait`` returns its ``GenerateOutput``."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        # A ``stream`` request's prompt logprobs, set before its first token is published.
        self.input_logprobs: tuple[LogprobPairs, TopRows] = ((), ())
        self._done = threading.Event()
        self._output: GenerateOutput | None = None
        self._error: str | None = None
        self._tokens: list[TokenEvent] = []
        self._progress_cv = threading.Condition()
        self._callbacks: list[Callable[[], None]] = []
        self._watchers: list[Callable[[], None]] = []

    def watch(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (on the scheduler thread) after every token a ``stream`` request
        publishes and once it has finished: how an event loop learns there is news."""
        with self._progress_cv:
            self._watchers.append(fn)
            done = self._done.is_set()
        if done:
            fn()

    def on_done(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the request has finished (at once if it has)."""
        with self._progress_cv:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def _resolve(self, output: GenerateOutput | None, error: str | None = None) -> None:
        with self._progress_cv:
            self._output, self._error = output, error
            self._done.set()
            self._progress_cv.notify_all()
            callbacks, self._callbacks = self._callbacks, []
            watchers = list(self._watchers)
        for fn in [*callbacks, *watchers]:
            fn()

    def _publish(self, event: TokenEvent, prefill: tuple[LogprobPairs, TopRows] | None) -> None:
        with self._progress_cv:
            if prefill is not None:
                self.input_logprobs = prefill
            self._tokens.append(event)
            self._progress_cv.notify_all()
            watchers = list(self._watchers)
        for fn in watchers:
            fn()

    def progress(self, seen: int, timeout: float) -> tuple[list[TokenEvent], bool]:
        """Tokens published after the first ``seen`` (waiting up to ``timeout`` for one), and
        whether the request has finished. Only a ``stream`` request publishes tokens."""
        with self._progress_cv:
            if len(self._tokens) <= seen and not self._done.is_set():
                self._progress_cv.wait(timeout)
            return self._tokens[seen:], self._done.is_set()

    def wait(self, timeout: float | None = None) -> GenerateOutput:
        """Block until finished; ``TimeoutError`` if ``timeout`` passes first."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.rid} still running after {timeout}s")
        if self._output is None:
            raise RuntimeError(f"request {self.rid} failed: {self._error}")
        return self._output

    def wait_done(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True once the request has finished."""
        return self._done.wait(timeout)


@dataclass(eq=False)
class _Seq:
    """Scheduler-thread state of one request."""

    req: GenerateRequest
    pending: Pending
    generator: torch.Generator
    max_new: int
    started: float
    slot: int = -1
    prefilled: bool = False
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    out_top: list[list[tuple[float, int]]] = field(default_factory=list)
    in_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    in_top: list[list[tuple[float, int]] | None] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    stop_text: str | None = None
    # (old weight version, output tokens then): the versions this request's tokens came from
    version_changes: list[tuple[str, int]] = field(default_factory=list)


def _top(row: torch.Tensor, k: int) -> list[tuple[float, int]]:
    values, ids = row.topk(min(k, row.shape[-1]))
    return list(zip(values.tolist(), ids.tolist(), strict=True))


class GenerationScheduler:
    """Continuous batching over a ``TinyLMRuntime`` (see the module docstring)."""

    def __init__(
        self,
        runtime: TinyLMRuntime,
        tokenizer: Any,
        *,
        eos_token_ids: Sequence[int],
        logprob_mode: LogprobMode = LogprobMode.ORIGINAL,
        max_prefill_tokens: int = 4096,
        weight_version: str = "default",
    ) -> None:
        self._runtime = runtime
        self._tok = tokenizer  # a ``tokenizers.Tokenizer``: its methods are safe across threads
        # Ids at or past this are padding rows of the embedding: never sampled (module docstring).
        self.decodable = min(
            int(tokenizer.get_vocab_size(with_added_tokens=True)), runtime.shape.vocab_size
        )
        self._eos = frozenset(eos_token_ids)
        self._mode = logprob_mode
        self._max_prefill = max_prefill_tokens
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._free_slots = list(range(runtime.max_slots))
        # Guards ``_accepting`` and ``_live_rids``: once the thread has taken its last look at
        # the inbox, nothing can be put there any more.
        self._lock = threading.Lock()
        self._accepting = True
        self._live_rids: set[str] = set()
        self._ids = itertools.count()
        self.steps = 0
        # Read by handler threads, written only on the scheduler thread together with the
        # weights (``update_weights``): every reply carries the version of the weights that
        # were loaded when it finished, as SGLang's ``meta_info["weight_version"]``.
        self.weight_version = weight_version
        # When the scheduler last produced anything (a forward, a reply, a weight swap): what
        # a health check waits for, as SGLang's ``TokenizerManager.last_receive_tstamp``.
        self.last_output_at = time.monotonic()
        self._paused = False  # ``pause``: no admission, no forward; the inbox is still read
        self._thread = threading.Thread(target=self._loop, name="tinylm-scheduler", daemon=True)
        self._thread.start()

    @property
    def max_context(self) -> int:
        return self._runtime.max_len

    def running_rids(self) -> list[str]:
        """Ids of requests submitted and not yet finished (a snapshot)."""
        with self._lock:
            return sorted(self._live_rids)

    def is_live(self, rid: str) -> bool:
        """Whether a request submitted under exactly ``rid`` has not finished yet."""
        with self._lock:
            return rid in self._live_rids

    def new_rid(self) -> str:
        return f"tinylm-{next(self._ids)}-{secrets.token_hex(4)}"

    def submit(self, req: GenerateRequest) -> Pending:
        """Queue ``req``; ``ValueError`` if it can never run (bad length, duplicate rid)."""
        n = len(req.input_ids)
        if n == 0:
            raise ValueError("input_ids is empty")
        if n >= self._runtime.max_len:
            raise ValueError(
                f"the input ({n} tokens) is longer than the model's context length "
                f"({self._runtime.max_len} tokens)"
            )
        vocab = self._runtime.shape.vocab_size
        bad = next((t for t in req.input_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"input_ids contains {bad}, outside the vocabulary [0, {vocab})")
        if req.return_logprob and req.logprob_start_len >= n:
            raise ValueError(
                f"logprob_start_len ({req.logprob_start_len}) is higher than the number of "
                f"input tokens ({n}); use a smaller logprob_start_len"
            )
        seed = req.sampling.sampling_seed
        generator = torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)
        seq = _Seq(
            req=req,
            pending=Pending(req.rid),
            generator=generator,
            # As SGLang: leave room in the context for the whole output (and its stop token).
            max_new=min(req.sampling.max_new_tokens, self._runtime.max_len - n - 1),
            started=time.perf_counter(),
        )
        with self._lock:
            if not self._accepting:
                raise SchedulerClosed("tinylm scheduler is shut down")
            if req.rid in self._live_rids:
                raise ValueError(f"a request with rid {req.rid!r} is already running")
            self._live_rids.add(req.rid)
            self._inbox.put(("submit", seq))
        return seq.pending

    def abort(self, rid: str | None = None) -> None:
        """Abort every request whose rid starts with ``rid``, or all when ``rid`` is None.

        Prefix matching is SGLang's (see the module docstring): aborting ``x_1`` also aborts
        ``x_10``. Unknown rids are a no-op.
        """
        self._inbox.put(("abort", rid))

    def pause(self, paused: bool) -> None:
        """Stop (or resume) admitting and stepping requests; those in flight keep their state
        and KV cache (SGLang's ``pause_generation(mode="in_place")``). Aborts still apply."""
        self._inbox.put(("pause", paused))

    def call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the scheduler thread between two forwards and return its result (or
        raise its exception): how the weights change under running requests."""
        box: Future[T] = Future()
        with self._lock:
            if not self._accepting:
                raise SchedulerClosed("tinylm scheduler is shut down")
            self._inbox.put(("call", (fn, box)))
        return box.result(timeout)

    def update_weights(
        self, weights: Mapping[str, torch.Tensor], shape: ModelShape, version: str | None
    ) -> bool:
        """Swap in new weights (and their version, when given) between two forwards; whether
        the scheduler was idle then, as SGLang's ``flush_cache`` needs it (no request running,
        none queued unless generation is paused)."""

        def swap() -> bool:
            self._runtime.replace_weights(weights, shape)
            self._change_version(version)
            return not self._running and (self._paused or not self._waiting)

        return self.call(swap)

    def set_weight_version(self, version: str) -> None:
        """Report ``version`` from now on (SGLang's ``/update_weight_version``)."""
        self.call(lambda: self._change_version(version))

    def close(self, timeout: float = 10.0) -> None:
        """Abort everything in flight, resolve its waiters, and stop the thread."""
        with self._lock:
            if self._accepting:
                self._accepting = False
                self._inbox.put(("close", None))
        self._thread.join(timeout)

    # -- scheduler thread -------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                idle = self._paused or not (self._running or self._waiting)
                if not self._drain(block=idle):
                    break
                if self._paused:
                    continue
                self._admit()
                if self._running:
                    self._step()
        except BaseException as exc:  # pragma: no cover - a bug; never leave waiters hanging
            log.exception("tinylm scheduler crashed")
            for seq in [*self._running, *self._waiting]:
                self._fail(seq, f"scheduler crashed: {exc!r}")
            raise
        finally:
            with self._lock:
                self._accepting = False
            self._shutdown_drain()

    def _change_version(self, version: str | None) -> None:
        """Scheduler thread: the loaded weights are ``version`` from now on."""
        if version is None or version == self.weight_version:
            return
        for seq in [*self._waiting, *self._running]:
            if seq.out_ids:
                seq.version_changes.append((self.weight_version, len(seq.out_ids)))
        self.weight_version = version

    def _drain(self, *, block: bool) -> bool:
        """Apply inbox messages; False once ``close`` was received."""
        try:
            kind, payload = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if kind == "submit":
                self._waiting.append(payload)
            elif kind == "abort":
                waiting = set(self._waiting)
                for seq in [*self._waiting, *self._running]:
                    if payload is None or seq.req.rid.startswith(payload):
                        seq.finish = abort_reason()
                        self._finish(seq, queued=seq in waiting)
            elif kind == "pause":
                self._paused = payload
            elif kind == "call":
                fn, box = payload
                try:
                    box.set_result(fn())
                except Exception as exc:
                    box.set_exception(exc)
                self.last_output_at = time.monotonic()
            elif kind == "close":
                for seq in [*self._waiting, *self._running]:
                    seq.finish = dict(SHUTDOWN_REASON)
                    self._finish(seq)
                return False
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _shutdown_drain(self) -> None:
        """Resolve anything that raced ``close`` into the inbox."""
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                payload.finish = dict(SHUTDOWN_REASON)
                self._finish(payload)
            elif kind == "call":
                payload[1].set_exception(SchedulerClosed("tinylm scheduler is shut down"))

    def _admit(self) -> None:
        budget = self._max_prefill
        while self._waiting and self._free_slots:
            seq = self._waiting[0]
            n = len(seq.req.input_ids)
            if n > budget and budget != self._max_prefill:
                break
            self._waiting.popleft()
            seq.slot = self._free_slots.pop()
            self._running.append(seq)
            budget -= n

    def _logits_from(self, seq: _Seq) -> int | None:
        """First prompt position whose logits the prefill must return (None: the last only)."""
        req = seq.req
        if req.return_logprob and 0 <= req.logprob_start_len < len(req.input_ids):
            # Row i predicts token i + 1; the entry at logprob_start_len itself is null.
            return req.logprob_start_len
        return None

    def _step(self) -> None:
        chunks: list[Chunk] = []
        for seq in self._running:
            prompt = seq.req.input_ids
            if not seq.prefilled:
                chunks.append(Chunk(seq.slot, 0, prompt, logits_from=self._logits_from(seq)))
            else:
                chunks.append(Chunk(seq.slot, len(prompt) + len(seq.out_ids) - 1, seq.out_ids[-1:]))
        try:
            logits = self._runtime.forward(chunks)
        except Exception as exc:
            log.exception("tinylm forward failed")
            for seq in list(self._running):
                self._fail(seq, f"forward failed: {exc!r}")
            return
        self.steps += 1
        self.last_output_at = time.monotonic()
        for seq, rows in zip(list(self._running), logits, strict=True):
            self._advance(seq, rows[:, : self.decodable])

    def _advance(self, seq: _Seq, rows: torch.Tensor) -> None:
        req = seq.req
        if not seq.prefilled:
            seq.prefilled = True
            first = self._logits_from(seq)
            if first is not None:
                self._record_input_logprobs(seq, rows, first)
            if seq.max_new <= 0:
                seq.finish = {"type": "length", "length": 0}
                self._finish(seq)
                return
        token, logprobs = next_token(rows[-1], req.sampling, seq.generator, mode=self._mode)
        seq.out_ids.append(token)
        if req.return_logprob:
            seq.out_logprobs.append(float(logprobs[token]))
            if req.top_logprobs_num > 0:
                seq.out_top.append(_top(logprobs, req.top_logprobs_num))
        if req.stream:
            seq.pending._publish(
                TokenEvent(
                    token,
                    seq.out_logprobs[-1] if req.return_logprob else None,
                    tuple(seq.out_top[-1]) if req.return_logprob and req.top_logprobs_num else None,
                ),
                (tuple(seq.in_logprobs), tuple(seq.in_top)) if len(seq.out_ids) == 1 else None,
            )
        params = req.sampling
        if (token in self._eos and not params.ignore_eos) or token in params.stop_token_ids:
            seq.finish = {"type": "stop", "matched": token}
        elif params.stop and (matched := self._stop_string(seq)) is not None:
            seq.finish = {"type": "stop", "matched": matched}
        elif len(seq.out_ids) >= seq.max_new:
            seq.finish = {"type": "length", "length": len(seq.out_ids)}
        if seq.finish is not None:
            self._finish(seq)

    def _record_input_logprobs(self, seq: _Seq, rows: torch.Tensor, first: int) -> None:
        """``rows[j]`` are the logits at prompt position ``first + j`` (predicting the next)."""
        prompt, start = seq.req.input_ids, seq.req.logprob_start_len
        lsm = torch.log_softmax(rows, dim=-1)
        k = seq.req.top_logprobs_num
        for i in range(start, len(prompt)):
            if i == start:  # SGLang leaves the first scored position empty (module docstring)
                seq.in_logprobs.append((None, prompt[i]))
                seq.in_top.append(None)
            else:
                row = lsm[i - 1 - first]
                seq.in_logprobs.append((float(row[prompt[i]]), prompt[i]))
                seq.in_top.append(_top(row, k) if k > 0 else None)

    def _stop_string(self, seq: _Seq) -> str | None:
        text = self._tok.decode(
            seq.out_ids, skip_special_tokens=seq.req.sampling.skip_special_tokens
        )
        for stop in seq.req.sampling.stop:
            at = text.find(stop)
            if at >= 0:
                seq.stop_text = text if seq.req.sampling.no_stop_trim else text[:at]
                return stop
        return None

    def _release(self, seq: _Seq) -> None:
        if seq in self._running:
            self._running.remove(seq)
            self._free_slots.append(seq.slot)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        with self._lock:
            self._live_rids.discard(seq.req.rid)

    def _fail(self, seq: _Seq, error: str) -> None:
        self._release(seq)
        seq.pending._resolve(None, error)

    def _finish(self, seq: _Seq, *, queued: bool = False) -> None:
        self._release(seq)
        self.last_output_at = time.monotonic()
        try:
            seq.pending._resolve(self._output(seq, queued=queued))
        except Exception as exc:  # pragma: no cover - decoding a finished request failed
            seq.pending._resolve(None, repr(exc))

    def _output(self, seq: _Seq, *, queued: bool = False) -> GenerateOutput:
        req, finish = seq.req, seq.finish
        assert finish is not None
        params = req.sampling
        ids = seq.out_ids
        if seq.stop_text is not None:
            text = seq.stop_text
        else:
            # A matched stop token is not part of the text unless no_stop_trim asks for it.
            kept = ids[:-1] if finish.get("type") == "stop" and not params.no_stop_trim else ids
            text = self._tok.decode(kept, skip_special_tokens=params.skip_special_tokens)
        logprobs = None
        if req.return_logprob:
            # An abort can land between sampling a token and recording its logprob.
            logprobs = logprob_fields(
                top_logprobs_num=req.top_logprobs_num,
                input_logprobs=seq.in_logprobs,
                input_top=seq.in_top,
                output_logprobs=list(zip(seq.out_logprobs, ids, strict=False)),
                output_top=seq.out_top,
                text_of=self.token_text if req.return_text_in_logprobs else None,
            )
        latency = time.perf_counter() - seq.started
        if queued:  # SGLang's reply for a request that never left the waiting queue
            meta = queued_abort_meta(
                rid=req.rid, weight_version=self.weight_version, e2e_latency=latency,
                logprobs=logprobs,
            )  # fmt: skip
        else:
            meta = meta_info(
                rid=req.rid,
                finish_reason=finish,
                prompt_tokens=len(req.input_ids),
                completion_tokens=len(ids),
                weight_version=self.weight_version,
                logprobs=logprobs,
                spans=version_spans(seq.version_changes, self.weight_version, len(ids)),
                e2e_latency=latency,
            )
        meta["response_sent_to_client_ts"] = time.time()
        return GenerateOutput(rid=req.rid, text=text, output_ids=tuple(ids), meta_info=meta)

    def token_text(self, token_id: int) -> str:
        """One token's text, as ``return_text_in_logprobs`` reports it."""
        return str(self._tok.decode([token_id], skip_special_tokens=False))
