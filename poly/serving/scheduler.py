"""The continuous-batching scheduler: one loop over many requests on one model.

Each ``step()``:
1. admits waiting requests while the batch has room (a request with ``n`` choices takes n rows);
2. drops cancelled requests (their KV is freed at once);
3. runs one decode token for every generating sequence through the fused multi-row step
   (``forward_batch``, up to ``ckernels.MAX_N`` rows per call); when whole waiting prompts fit
   the same call's rows (``MAX_ROWS`` in all), they ride along: one pass over the weights for
   both instead of two (requests joining a running batch; each row computes as it would alone);
4. otherwise runs one prefill chunk (``prefill_chunk`` tokens) of the oldest request still
   prefilling and, within the same token budget, the whole prompts of the requests after it, in
   one pass over the weights (``batch_prefill``; `poly.runtime.batch.forward_batch`): a long
   prompt delays the others by one chunk at most; a burst of short prompts costs one pass.
   When a prompt is done, the last position's logits give every choice its first token
   (choices 2..n fork the prompt's KV).

A sequence's greedy output equals single-sequence generation token for token whenever its
prompt fits one chunk and was prefilled alone (the multi-row decode step computes each row
exactly as the one-row step); prompts prefilled together share matmuls over all their rows,
whose float32 rounding differs from a one-prompt pass in the last bits (~1e-6 relative), which
can change a greedy choice only at an exact near-tie. ``batch_prefill=False`` keeps one prompt
per pass.
Drive it by hand (``step()``) or on its own thread (``start()`` / ``shutdown()``)."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

from poly.errors import ContextOverflowError, PolyError, QueueFullError
from poly.runtime import fused
from poly.serving.handle import RequestDone, RequestFailed, RequestHandle, Usage
from poly.serving.metrics import Metrics
from poly.serving.params import SamplingParams
from poly.serving.sequence import Sequence
from poly.text.generation import check_prompt, model_lock
from poly.text.sampling import Sampler

MAX_ROWS = 16  # rows of one fused decode call (ckernels.MAX_N)


def _chunk(a, n: int) -> list[int]:
    """The next n prompt tokens of request `a` (its first choice holds the prompt's KV)."""
    s = a.seqs[0]
    return s.tokens[s.computed : s.computed + n]


class _Active:
    """A request inside the batch."""

    def __init__(self, handle: RequestHandle, seqs: list[Sequence], cached: int = 0):
        self.handle = handle
        self.seqs = seqs
        self.prefilled = False
        self.cached = cached  # prompt tokens taken from the prefix cache


class Scheduler:
    """Batches requests on ``model``; ``submit`` is thread-safe, ``step`` runs on one thread."""

    def __init__(self, model, *, max_batch: int = 16, prefill_chunk: int = 512,
                 max_queue: int = 64, max_context: int | None = None, kv=None,
                 batch_prefill: bool = True, gather_s: float = 0.002, spec=None):  # fmt: skip
        from poly.serving.kv import make_kv

        self.model = model
        self.max_batch = max(1, int(max_batch))
        self.prefill_chunk = max(1, int(prefill_chunk))
        self.batch_prefill = bool(batch_prefill)
        # requests arriving within gather_s of one that woke an idle loop share its first
        # prefill pass (8 clients starting together: one pass instead of one, then seven)
        self.gather_s = max(0.0, float(gather_s))
        self.max_queue = int(max_queue)
        limit = int(model.config.max_seq_len)
        self.max_context = min(limit, int(max_context)) if max_context else limit
        if kv is None:
            kv = make_kv(model, max_batch=self.max_batch, ctx=self.max_context)
        self.kv = kv
        self.spec = spec  # poly.serving.speculate.ServerSpeculation: one lone sequence's passes
        self.metrics = Metrics()
        self._waiting: deque[tuple[RequestHandle, Callable | None]] = deque()
        self._active: list[_Active] = []
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._thread: threading.Thread | None = None
        self._stop = False
        self.eos = tuple(getattr(model, "eos_token_ids", ()) or ())

    # --- submitting ---------------------------------------------------------------------------

    def submit(self, prompt_ids, params: SamplingParams | None = None, *,
               mask_factory: Callable | None = None, notify: Callable | None = None,
               rid: str | None = None) -> RequestHandle:  # fmt: skip
        """Queue a request; raises ``ContextOverflowError`` (prompt + max_tokens past the
        context), ``InvalidTokenError`` or ``QueueFullError`` before anything runs.
        ``mask_factory()`` builds one token mask per choice (structured output)."""
        params = params or SamplingParams()
        prompt = check_prompt(prompt_ids, self.model.config.vocab_size)
        room = self.max_context - len(prompt)
        if room < 1 or (params.max_tokens is not None and params.max_tokens > room):
            want = params.max_tokens or 1
            raise ContextOverflowError(
                f"this model's context is {self.max_context} tokens; the prompt has "
                f"{len(prompt)} and max_tokens asks for {want} more"
            )
        self.kv.check(len(prompt), params.max_tokens or room, params.n)
        handle = RequestHandle(rid or f"req-{next(self._ids)}", prompt, params, notify)
        with self._cv:
            if len(self._waiting) >= self.max_queue or self._stop:
                self.metrics.rejected += 1
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting)")
            self._waiting.append((handle, mask_factory))
            self.metrics.requests += 1
            self._cv.notify_all()
        return handle

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def rows(self) -> int:
        return sum(len(a.seqs) for a in self._active)

    def idle(self) -> bool:
        return not self._waiting and not self._active

    @contextlib.contextmanager
    def exclusive(self):
        """The KV store and the model between two steps (a slot's save or restore) -> the store."""
        with self._cv, model_lock(self.model):
            yield self.kv

    # --- one step -------------------------------------------------------------------------------

    def step(self) -> bool:
        """One scheduler iteration; False when there was nothing to do."""
        with self._cv:
            self._admit()
        if not self._active:
            return False
        with model_lock(self.model):
            self._drop_cancelled()
            spec = self.spec is not None and self.spec.step(self)  # a lone sequence's pass
            if not spec and not self._mixed():
                self._decode()
                self._prefill()
        return True

    def _new_seqs(self, handle: RequestHandle, mask_factory) -> list[Sequence]:
        p, prompt = handle.params, handle.prompt
        budget = p.max_tokens or (self.max_context - len(prompt))
        tok = getattr(self.model, "tokenizer", None)
        seqs = []
        for i in range(p.n):
            opts = p.gen_options(i, budget)
            sampler = Sampler(opts, self.model.config.vocab_size, self.eos, tok)
            dec = None
            if tok is not None:
                from poly.text.tokenizer import StreamDecoder

                dec = StreamDecoder(tok)
            mask = mask_factory() if mask_factory is not None else None
            seqs.append(Sequence(i, prompt, sampler, budget, p, dec, mask, self.max_context))
        return seqs

    def _drop_cancelled_waiting(self) -> None:
        """Every cancelled request in the queue, not just its head: a client gone while queued
        behind a request that cannot be admitted yet must not keep its place."""
        if not any(h.cancelled for h, _ in self._waiting):
            return
        keep = deque(w for w in self._waiting if not w[0].cancelled)
        gone = [h for h, _ in self._waiting if h.cancelled]
        self._waiting = keep
        for handle in gone:
            self._finish(_Active(handle, []), cancelled=True)

    def _admit(self) -> None:
        self._drop_cancelled_waiting()
        while self._waiting:
            handle, mask_factory = self._waiting[0]
            if handle.cancelled:
                self._waiting.popleft()
                self._finish(_Active(handle, []), cancelled=True)
                continue
            if self._active and self.rows + handle.params.n > self.max_batch:
                return
            budget = handle.params.max_tokens or (self.max_context - len(handle.prompt))
            try:
                got = self.kv.reserve(handle.prompt, budget, handle.params.n)
                if got is None:
                    return  # the KV pool cannot promise the pages yet: others finish first
                kv, cached = got
                try:
                    seqs = self._new_seqs(handle, mask_factory)
                except PolyError:
                    self.kv.free(kv)
                    raise
            except PolyError as err:
                self._waiting.popleft()
                handle.put(RequestFailed(err))
                continue
            self._waiting.popleft()
            seqs[0].kv, seqs[0].computed = kv, cached
            self.metrics.prefix_hit_tokens += cached
            self._active.append(_Active(handle, seqs, cached))

    def _drop_cancelled(self) -> None:
        for a in [a for a in self._active if a.handle.cancelled]:
            self._finish(a, cancelled=True)

    def _decode_rows(self) -> list[tuple[_Active, Sequence]]:
        return [(a, s) for a in self._active if a.prefilled for s in a.seqs if not s.finish_reason]

    def _mixed(self) -> bool:
        """The decode rows and the whole prompts that fit beside them (MAX_ROWS rows in all) in
        one fused call; False (nothing run) when there are not both. Rows past MAX_ROWS would
        take the prompt GEMM, whose sums differ from a decode row's own."""
        rows = self._decode_rows()
        if not rows or len(rows) >= MAX_ROWS or not self.batch_prefill:
            return False
        if not fused.rows_alike(self.model):
            return False
        group = self._prefill_group(MAX_ROWS - len(rows), whole=True)
        if not group:
            return False
        chunks = [[s.tokens[-1]] for _, s in rows] + [_chunk(a, n) for a, n in group]
        t0 = time.perf_counter()
        kvs = [s.kv for _, s in rows] + [a.seqs[0].kv for a, _ in group]
        logits = self.kv.prefill_many(kvs, chunks)
        dt = time.perf_counter() - t0
        share = len(rows) / (len(rows) + sum(n for _, n in group))  # the pass's time by rows
        self.metrics.decode_step(len(rows), dt * share)
        self.metrics.prefill(sum(n for _, n in group), dt * (1 - share))
        self._decoded(rows, logits[: len(rows)])
        self._finish_decoded()
        for (a, n), row in zip(group, logits[len(rows) :]):
            self._prefilled(a, n, row)
        return True

    def _decode(self) -> None:
        rows = self._decode_rows()
        for g in range(0, len(rows), MAX_ROWS):
            group = rows[g : g + MAX_ROWS]
            t0 = time.perf_counter()
            logits = self.kv.decode([s.tokens[-1] for _, s in group], [s.kv for _, s in group])
            self.metrics.decode_step(len(group), time.perf_counter() - t0)
            self._decoded(group, logits)
        self._finish_decoded()

    def _decoded(self, rows: list[tuple[_Active, Sequence]], logits) -> None:
        """Each decode row's next token from its logits row."""
        for (a, s), row in zip(rows, logits):
            s.computed += 1
            self._sample(a, s, row)

    def _finish_decoded(self) -> None:
        for a in [a for a in self._active if a.prefilled and all(s.finish_reason for s in a.seqs)]:
            self._finish(a)

    def _prefill(self) -> None:
        group = self._prefill_group()
        if not group:
            return
        t0 = time.perf_counter()
        chunks = [_chunk(a, n) for a, n in group]
        if len(group) == 1:
            logits = [self.kv.prefill(group[0][0].seqs[0].kv, chunks[0])]
        else:  # one pass over the weights for every waiting prompt
            logits = self.kv.prefill_many([a.seqs[0].kv for a, _ in group], chunks)
        self.metrics.prefill(sum(n for _, n in group), time.perf_counter() - t0)
        for (a, n), row in zip(group, logits):
            self._prefilled(a, n, row)

    def _prefill_group(self, budget: int = 0, whole: bool = False) -> list[tuple[_Active, int]]:
        """The oldest prompt still prefilling (its next chunk), then, while `prefill_chunk`
        tokens (or ``budget``) last, the whole remaining prompts of the next ones
        (`batch_prefill`); ``whole``: whole remaining prompts only."""
        group, budget = [], min(budget or self.prefill_chunk, self.prefill_chunk)
        for a in self._active:
            if a.prefilled:
                continue
            left = a.seqs[0].n_prompt - a.seqs[0].computed
            if (group or whole) and left > budget or group and not self.batch_prefill:
                break
            group.append((a, min(left, budget)))
            budget -= group[-1][1]
            if budget <= 0:
                break
        return group

    def _prefilled(self, a: _Active, n: int, logits) -> None:
        first = a.seqs[0]
        first.computed += n
        if first.computed < first.n_prompt:
            return
        a.prefilled = True
        for s in a.seqs[1:]:
            s.kv, s.computed = self.kv.fork(first.kv, first.computed, s.budget), first.computed
        for s in a.seqs:
            self._sample(a, s, logits)
        if all(s.finish_reason for s in a.seqs):
            self._finish(a)

    def _sample(self, a: _Active, s: Sequence, logits) -> None:
        try:
            out = s.accept(logits)
        except PolyError as err:
            a.handle.cancel()
            a.handle.put(RequestFailed(err))
            return
        self.metrics.tokens += 1
        if s.finish_reason and s.kv is not None:
            self.kv.free(s.kv, s.tokens)
            s.kv = None
        a.handle.put(out)

    def _finish(self, a: _Active, cancelled: bool = False) -> None:
        if a in self._active:
            self._active.remove(a)
        for s in a.seqs:
            if s.kv is not None:
                self.kv.free(s.kv, s.tokens)
                s.kv = None
        if a.handle.finished:
            return  # failed earlier
        if cancelled:
            self.metrics.cancelled += 1
        n_gen = sum(len(s.generated) for s in a.seqs)
        usage = Usage(len(a.handle.prompt), n_gen, a.cached)
        reasons = tuple(s.finish_reason or "cancelled" for s in a.seqs)
        if not a.seqs:
            reasons = ("cancelled",) * a.handle.params.n
        self.metrics.finished += 1
        a.handle.put(RequestDone(usage, reasons))

    # --- the loop thread ------------------------------------------------------------------------

    def start(self) -> Scheduler:
        """Run the loop on a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="poly-scheduler", daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while True:
            with self._cv:
                was_idle = self.idle()
                while not self._stop and self.idle():
                    self._cv.wait(0.5)
                if was_idle and not self._stop:  # a burst: let the rest of it arrive first
                    deadline = time.monotonic() + self.gather_s
                    while (left := deadline - time.monotonic()) > 0:
                        self._cv.wait(left)
                if self._stop and (self.idle() or time.monotonic() > self._drain_deadline):
                    break
            try:
                self.step()
            except Exception as err:  # noqa: BLE001 - one bad step fails its requests, not the loop
                self._fail_all(err)
        self._fail_all(None)

    _drain_deadline: float = 0.0

    def _fail_all(self, err: BaseException | None) -> None:
        with self._cv:
            pending = list(self._active) + [_Active(h, []) for h, _ in self._waiting]
            self._waiting.clear()
        for a in pending:
            if err is None:
                self._finish(a, cancelled=True)
                continue
            e = err if isinstance(err, PolyError) else PolyError(f"internal error: {err}")
            self._finish_failed(a, e)

    def _finish_failed(self, a: _Active, err: PolyError) -> None:
        if a in self._active:
            self._active.remove(a)
        for s in a.seqs:
            if s.kv is not None:
                self.kv.free(s.kv)
                s.kv = None
        if not a.handle.finished:
            a.handle.put(RequestFailed(err))

    def shutdown(self, drain: float | None = 30.0) -> None:
        """Stop taking requests; finish running ones for up to ``drain`` seconds (None: cancel
        at once), then stop the loop."""
        with self._cv:
            self._stop = True
            self._drain_deadline = time.monotonic() + (drain or 0.0)
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
