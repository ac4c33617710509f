"""The engine loop: one step at a time, for every request from every caller.

``EngineCore.step`` takes what was submitted since the last step, lets the
scheduler admit, place and compact, runs the model once (``ModelRunner``),
samples one token for every active row (the prefilled rows on a prefill step,
else every running sequence), and hands each request that
changed its cumulative output. Requests join the running batch at the next
step and leave it when they finish.

Callers never touch the scheduler: ``submit`` and ``abort`` leave their
requests in an inbox, under a lock of their own, which the next step empties
in the order things happened (an abort and a new request of the same id are
taken in that order). A request id is taken from ``submit`` until the request
ends or ``abort`` is called: a second request with an id still taken is refused
at once, and never disturbs the first.
Steps themselves are serialised by a second lock, so any thread may drive the
loop (``LLM.generate`` steps in its caller's thread, ``AsyncLLM`` in a thread
of its own), and requests of several callers share every step. A step only
changes a sequence once its forward pass and sampling succeeded, so a step
interrupted half-way (Ctrl-C) can simply be run again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from pluginhost.engine.loader import LoadedModel
from pluginhost.engine.request import EngineRequest, Sequence
from pluginhost.engine.runner import ModelOutputError, ModelRunner, PromptScores
from pluginhost.engine.sampler import NoTokenLeft, choices_given, sample
from pluginhost.engine.scheduler import ScheduledStep, Scheduler
from pluginhost.errors import (
    EngineOverloadedError,
    InvalidParameterError,
    KVCacheMemoryError,
    ModelRunError,
    PluginHookError,
    PluginhostError,
    RequestRefusedError,
)
from pluginhost.logits_processors import AddedRequest, BatchUpdate, LogitsProcessor, RegisteredProcessor, step_rows

if TYPE_CHECKING:
    from pluginhost.engine.parallel import Ranks
    from pluginhost.outputs import RequestOutput

__all__ = ["EngineCore", "EngineStats", "blame"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """What one step did (``record_stats`` hooks and ``/metrics`` read it)."""

    #: Sequences in the running batch during the step, and still waiting after it.
    num_running: int
    num_waiting: int
    #: Tokens sampled this step (one per active row), and prompt tokens prefilled for the first time (a
    #: preempted sequence's recomputation is not counted again).
    num_generated_tokens: int
    num_prompt_tokens: int
    #: Sequences (and requests) that finished this step.
    num_finished: int
    step_time_s: float
    #: The KV cache's (rows, slots) after the step.
    cache_shape: tuple[int, int]
    #: Sequences preempted for memory since the last step's figures (they wait, to be prefilled again).
    num_preempted: int = 0
    #: Seconds since its previous token, for each sequence that got its second token or a later one this step:
    #: vLLM's inter-token latencies (a stall, such as a decode waiting on newcomers' prefill, shows here).
    token_gaps_s: tuple[float, ...] = ()


class EngineCore:
    """Scheduler, model runner and sampler, stepped by whoever drives."""

    def __init__(self, loaded: LoadedModel, ranks: Ranks | None = None) -> None:
        config = loaded.config
        self.loaded = loaded
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_waiting=config.max_waiting_seqs,
        )
        limits = {
            "max_num_seqs": config.max_num_seqs,
            "max_model_len": loaded.max_model_len,
            "compile_decode": config.compile_decode,
            "pass_tokens": config.max_num_batched_tokens,  # a long prompt's prefill, in pieces
            "kv_cache_dtype": loaded.kv_cache_dtype,
        }
        if ranks is None:
            self.runner = ModelRunner(loaded.model, loaded.device, **limits)
        else:  # tensor parallelism: every step also runs on the other ranks
            from pluginhost.engine.parallel import DistributedRunner

            self.runner = DistributedRunner(ranks, loaded.model, loaded.device, **limits)
        self._step_lock = threading.RLock()
        self._inbox_lock = threading.Lock()
        #: What callers did since the last step, in order: a request to add, or one to abort.
        self._inbox: list[tuple[str, EngineRequest]] = []
        #: Request ids taken (submitted, not yet ended or aborted), under the inbox lock.
        self._live: dict[str, EngineRequest] = {}
        #: The requests the engine loop has taken in and not yet ended (the loop's own).
        self._requests: dict[str, EngineRequest] = {}
        self._work = threading.Condition(self._inbox_lock)
        #: Called after every step with its stats (by the thread that stepped).
        self.stats_listeners: list[Callable[[EngineStats], None]] = []
        self._host = loaded.host
        self._hooked = {hook: loaded.host.has_implementations(hook) for hook in ("on_output", "record_stats")}
        self.processors = [_LiveProcessor.create(entry, loaded) for entry in loaded.logits_processors]
        #: Sequences preempted since the last step's figures.
        self._preempted = 0
        #: Sequences taken from the inbox and not yet queued (under the inbox lock): ``_check_room`` counts them.
        self._in_transit = 0
        #: Set by ``abort_all(close=True)`` (a shutdown): no request is taken any more.
        self._closed = False

    @property
    def stopped(self) -> Exception | None:
        """The error that stopped this engine for good (a tensor-parallel rank lost), else ``None``."""
        return self.runner.stopped

    # -- callers ----------------------------------------------------------------------

    def submit(self, requests: Iterable[EngineRequest], *, bounded: bool = True) -> None:
        """Queue requests for the next step, all or none (a full queue refuses them all).

        The bound counts only what cannot start at the next step: the sequences not yet admitted
        (waiting, or submitted since the last step) may exceed ``max_waiting_seqs`` by the rows the
        running batch has free, so an idle engine takes a burst as large as its batch plus its queue.
        ``bounded=False`` (offline ``LLM.generate``, whose caller holds the whole list already)
        queues them whatever the queue holds: ``max_waiting_seqs`` protects a server. A
        request id still taken by a running request (or repeated) is a ``ValueError``.
        """
        requests = list(requests)
        with self._inbox_lock:
            if self._closed:
                raise RuntimeError("this engine was shut down: it takes no more requests")
            ids = [r.request_id for r in requests]
            taken = sorted({i for i in ids if i in self._live} | {i for i, k in Counter(ids).items() if k > 1})
            if taken:
                raise ValueError(
                    f"request id(s) {', '.join(map(repr, taken[:5]))} already running; give each request its own id "
                    "(or abort the running one first)"
                )
            if bounded:
                self._check_room(sum(len(r.sequences) for r in requests))
            for request in requests:
                self._live[request.request_id] = request
                self._inbox.append(("add", request))
            self._work.notify_all()

    def _check_room(self, wanted: int) -> None:
        """Refuse ``wanted`` more sequences (``EngineOverloadedError``) if they could not all start or wait.

        Called under the inbox lock. The batch's figures are read without the step lock: an estimate, off
        by what the step under way admits or ends, which only moves sequences between the two counts
        (those taken from the inbox and not yet queued count as waiting: ``_in_transit``).
        ``scheduler.max_num_seqs`` is the cap in force (lowered while memory is short), so rows the
        memory cannot give are not counted as free.
        """
        scheduler = self.scheduler
        not_admitted = self._not_admitted()
        free_rows = max(0, scheduler.max_num_seqs - scheduler.num_running)
        most = scheduler.max_waiting + free_rows
        if not_admitted + wanted > most:
            raise EngineOverloadedError(
                f"the engine's queue is full: {not_admitted} sequences wait to start, {wanted} more asked for, and at "
                f"most {most} may ({free_rows} free rows of the running batch + max_waiting_seqs="
                f"{scheduler.max_waiting} waiting); try again later, or raise max_waiting_seqs (--max-waiting-seqs) "
                "or max_num_seqs (--max-num-seqs)"
            )

    def _not_admitted(self) -> int:
        """Sequences accepted and not yet in a row (under the inbox lock): waiting, on their way to the queue
        (``_in_transit``), or in the inbox since the last step began."""
        inbox = sum(len(r.sequences) for what, r in self._inbox if what == "add")
        return self.scheduler.num_waiting + self._in_transit + inbox

    def queue_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences now, waiting as the queue's bound counts it: a request accepted during a
        long step waits too (the scheduler's count alone showed 0 while the server was refusing requests as full)."""
        with self._inbox_lock:
            return self.scheduler.num_running, self._not_admitted()

    def is_running(self, request_id: str) -> bool:
        """Whether a request under this id has been submitted and has not ended (nor been aborted)."""
        return request_id in self._live

    def abort(self, request_ids: Iterable[str]) -> None:
        """End the requests running under these ids at the next step (unknown or finished ones are ignored).

        The ids are free again at once: a new request may take one before the step ends the old one.
        """
        with self._inbox_lock:
            for request_id in request_ids:
                request = self._live.get(request_id)
                if request is not None:
                    self._abort_locked(request)
            self._work.notify_all()

    def abort_request(self, request: EngineRequest) -> None:
        """End this request at the next step, unless it has ended (never another request with its id)."""
        with self._inbox_lock:
            if self._live.get(request.request_id) is request:
                self._abort_locked(request)
                self._work.notify_all()

    def abort_all(self, *, close: bool = False) -> None:
        """End every request at the next step; ``close``: and take no more (``submit`` then raises ``RuntimeError``).

        Both at once, under the inbox lock: a request submitted while a shutdown begins is either aborted with the
        others or refused, never taken after them and left running.
        """
        with self._inbox_lock:
            self._closed = self._closed or close
            for request in list(self._live.values()):
                self._abort_locked(request)
            self._work.notify_all()

    def _abort_locked(self, request: EngineRequest) -> None:
        """Free the request's id now and queue its end for the next step (the inbox lock is held)."""
        del self._live[request.request_id]
        self._inbox.append(("abort", request))

    def fail_all(self, error: BaseException) -> None:
        """End every request now with ``error`` (after a failure of the loop itself)."""
        with self._step_lock:
            self._take_inbox()
            for request in list(self._requests.values()):
                self._end(request, error)

    def has_work(self) -> bool:
        with self._inbox_lock:
            return bool(self._inbox) or self.scheduler.has_work()

    def wait_for_work(self, timeout: float) -> bool:
        """Block until something was submitted or aborted (or ``timeout``); whether there is work."""
        with self._inbox_lock:
            if not (self._inbox or self.scheduler.has_work()):
                self._work.wait(timeout)
            return bool(self._inbox) or self.scheduler.has_work()

    @contextlib.contextmanager
    def between_steps(self, timeout: float) -> Iterator[bool]:
        """Run the body with no step in flight: the one running is waited for, up to ``timeout`` seconds.

        Yields whether it was (``False``: the step outlasted ``timeout``, and the body runs beside it).
        """
        held = self._step_lock.acquire(timeout=timeout)
        try:
            yield held
        finally:
            if held:
                self._step_lock.release()

    def run_until(self, done: Callable[[], bool]) -> None:
        """Step until ``done()``; other threads' requests are served by the same steps."""
        while not done():
            with self._step_lock:
                if done():
                    return
                if not self.step():
                    time.sleep(0.001)  # another thread holds our requests' step; let it finish

    # -- the loop ----------------------------------------------------------------------

    def step(self, *, timeout: float | None = None) -> bool:
        """Run one step; whether anything ran (``False`` too when another thread's step outlasted ``timeout``)."""
        if not self._step_lock.acquire(timeout=-1 if timeout is None else timeout):
            return False
        plan = None
        try:
            self._take_inbox()
            plan = self.scheduler.schedule()
            if plan is None:
                return False
            start = time.perf_counter()
            # First, before anything that may fail or be interrupted: the scheduler has placed the sequences, and a
            # moved one would read another row's keys and values from its next step on.
            self.runner.apply_moves(plan)
            if not self._update_processors(plan):
                return True
            try:
                tokens, logprobs, prompt_scores = self._run(plan)
            except KVCacheMemoryError as full:  # nothing ran: make the batch fit, and go on next step
                self._fit_memory(plan, full)
                return True
            except _ProcessorFailure as failure:
                self._processor_failed(failure, plan, plan.active_rows)  # apply saw every row of the step
                return True
            except _NonFiniteLogits as nonfinite:
                self._nonfinite(plan, nonfinite.rows, nonfinite.in_prompt)
                return True
            except NoTokenLeft as emptied:
                self._processors_emptied(plan, emptied)
                return True
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - a plugin's sys.exit() in a forward hook is its failure too
                self._fail(plan, blame(self.loaded, exc))
                return True
            self._lift_row_cap()
            # Prompt tokens of the sequences prefilled for the first time (not those recomputed after a preemption).
            first = [plan.rows[r] for r in plan.prefill_rows if not plan.rows[r].token_ids]
            prompt_tokens = sum(len(s.prompt_token_ids) for s in first)
            for row, scores in prompt_scores.items():
                plan.rows[row].request.score_prompt(scores)
            deliveries, gaps = self._advance(plan, tokens, logprobs)
            stats = EngineStats(
                num_running=len(plan.rows),
                num_waiting=self.scheduler.num_waiting,
                num_generated_tokens=len(tokens),
                num_prompt_tokens=prompt_tokens,
                num_finished=sum(1 for r in plan.active_rows if plan.rows[r].finished),
                step_time_s=time.perf_counter() - start,
                cache_shape=self.runner.cache_shape,
                num_preempted=self._preempted,
                token_gaps_s=gaps,
            )
            self._preempted = 0
            # Under the step lock: another thread's step (shutdown's, handing out aborts) must not hand a request's
            # last output out before this step hands out an earlier one.
            for callback, output, error in deliveries:
                callback(output, error)
        except KeyboardInterrupt:
            # Interrupted while the moves were applied (the step holds them until they are): their cache rows follow
            # before the Ctrl-C goes on, or a moved sequence (another caller's) reads another row's keys and values
            # from its next step, silently. Copying the same slots again changes nothing.
            if plan is not None and plan.moves and self.runner.stopped is None:
                try:
                    self.runner.apply_moves(plan)
                except Exception:  # noqa: BLE001 - the Ctrl-C is what the caller must see (a lost rank, say)
                    logger.exception("the cache rows of an interrupted step could not be moved")
            raise
        finally:
            if self.scheduler.num_running == 0 and self.scheduler.max_num_seqs < self.loaded.config.max_num_seqs:
                self.runner.lift_row_cap()  # a cap set for memory holds no more once nothing runs: an idle
                self._lift_row_cap()  # engine takes a whole batch again, at once
            self._step_lock.release()
        for listener in self.stats_listeners:
            listener(stats)
        if self._hooked["record_stats"]:
            self._host.record_stats(stats)
        return True

    def _run(self, plan: ScheduledStep) -> tuple[list[int], torch.Tensor | None, dict[int, PromptScores]]:
        """Tokens and log-probabilities (of the model's own distribution) of the active rows; the prompts scored,
        by row."""
        computed = self.runner.execute(plan)
        logits = computed.logits  # (A, V): the active rows
        active = plan.active_rows
        if logits.shape != (len(active), self.loaded.vocab_size):
            raise ModelOutputError(
                f"its compute_logits returned logits of shape {tuple(logits.shape)} for {len(active)} token(s): it "
                f"must return one row per token, one column per token of the vocabulary ({self.loaded.vocab_size}, "
                "the config's vocab_size)"
            )
        # NaN or +inf anywhere in a row (a float16 overflow, say), or nothing but -inf: greedy decoding would
        # pick token 0 for ever, sampling would fail. One pass over the logits; NaN propagates through amax.
        broken = ~logits.amax(dim=-1).isfinite()  # (A,)
        # A prompt scored (prompt_logprobs) is checked at every position: a NaN there is a NaN in its answer. (-inf is
        # a token the model gives no chance; a position of NaN, +inf or nothing but -inf makes its every entry NaN.)
        in_prompt = [row for row, scores in computed.prompt_scores.items() if scores.chosen.isnan().any()]
        if broken.any() or in_prompt:
            raise _NonFiniteLogits([active[i] for i in broken.nonzero().flatten().tolist()], in_prompt)
        wanted = any(plan.rows[r].params.logprobs is not None for r in active)
        logprobs = logits.log_softmax(dim=-1) if wanted else None  # before the sampler changes the logits
        if not self.processors:
            try:
                tokens = sample(logits, [plan.rows[r].sampling for r in active])
            except NoTokenLeft as emptied:  # its rows count the active rows only: say which of the plan's
                raise emptied.renumbered(active) from None
            return tokens, logprobs, computed.prompt_scores  # type: ignore[return-value]  # every state given
        # Processors see the whole batch, row i being the sequence in row i (idle rows hold no values).
        B = len(plan.rows)
        full = logits
        if len(active) < B:
            full = logits.new_zeros((B, logits.shape[-1])).index_copy_(
                0, torch.tensor(active, device=logits.device), logits
            )
        states = [None] * B
        for r in active:
            states[r] = plan.rows[r].sampling  # type: ignore[call-overload]
        with step_rows(active if len(active) < B else None):
            chosen = sample(full, states, self.processors)
        return [chosen[r] for r in active], logprobs, computed.prompt_scores  # type: ignore[misc]

    # -- logits processors --------------------------------------------------------------

    def _update_processors(self, plan: ScheduledStep) -> bool:
        """Tell every processor how the batch changed; on a failure, end what it was processing. Whether to go on."""
        failures = []
        for processor in self.processors:
            try:
                processor.instance.update_state(plan.batch_update)
            except Exception as exc:  # noqa: BLE001 - a plugin's code may raise anything
                failures.append(_ProcessorFailure(processor, "update_state", exc))
        for failure in failures:
            added = [a[0] for a in plan.batch_update.added] if plan.batch_update is not None else []
            causes = {added[0]: failure.cause} if len(added) == 1 else {}  # one joiner: the failure is its own
            if len(added) > 1:  # several joined at once: end only those it fails to take alone
                causes = self._joiners_refused(failure.processor, plan, added)
            self._processor_failed(failure, plan, list(causes) or added or plan.active_rows, causes)
        return not failures

    def _joiners_refused(
        self, processor: _LiveProcessor, plan: ScheduledStep, added: list[int]
    ) -> dict[int, BaseException]:
        """Of the rows that joined this step, those ``processor`` fails on when each joins the others alone,
        with what it raised for each.

        ``update_state`` takes a step's joiners together, so its failure does not say whose it was: each is
        tried again with the rows it kept (a fresh instance each time; only on a failure).
        """
        joined = set(added)
        kept = [
            _as_added(plan, row) for row, seq in enumerate(plan.rows) if row not in joined and not seq.request.finished
        ]
        refused = {}
        for row in added:
            try:
                processor.rebuild(self.loaded, BatchUpdate(len(plan.rows), added=[*kept, _as_added(plan, row)]))
            except Exception as exc:  # noqa: BLE001 - a plugin's code may raise anything
                refused[row] = exc
        return refused

    def _nonfinite(self, plan: ScheduledStep, rows: list[int], in_prompt: list[int] = ()) -> None:
        """End the requests of ``rows``, whose logits are not numbers, and of ``in_prompt``, whose prompt scored
        (``prompt_logprobs``) has such logits at a position; the others run this step again."""
        if self.loaded.dtype == torch.float16:
            hint = "float16's range (up to 65504) overflowed: use dtype bfloat16 or float32"
        else:
            hint = "check the model's weights and configuration (hf_overrides?), or use dtype float32"

        def error(where: str) -> ModelRunError:
            return ModelRunError(
                f"The model {self.loaded.describe()} gave logits that are not finite numbers (NaN or infinity) "
                f"{where}: {hint}. The request was ended; the others go on."
            )

        ended = {id(plan.rows[r].request): (plan.rows[r].request, error("for this request")) for r in rows}
        for r in in_prompt:
            request = plan.rows[r].request
            ended.setdefault(id(request), (request, error("at a position of this request's prompt (prompt_logprobs)")))
        logger.warning(
            "ended %d of a step's %d rows: their logits were not finite numbers",
            len({*rows, *in_prompt}),
            len(plan.active_rows),
        )
        for request, cause in ended.values():
            self._end(request, cause)

    def _processors_emptied(self, plan: ScheduledStep, emptied: NoTokenLeft) -> None:
        """End the requests of the rows logits processors left no token to choose, naming them; the others run again.

        Nothing was sampled: the step runs again without them, as after non-finite logits (the processors stay
        as they are, for the requests they did not empty).
        """
        for row, processors in emptied.rows.items():
            request = plan.rows[row].request
            if request.error is not None:  # another of its samples ended it already
                continue
            if row in emptied.by_request:
                self._end(request, _choices_emptied(request, plan.rows[row], row in emptied.by_min_tokens))
                continue
            entries = [p.entry for p in processors]  # type: ignore[attr-defined]  # the engine's _LiveProcessors
            if row in emptied.by_min_tokens:
                what = (
                    f"{' and '.join(e.describe() for e in entries)} left this request only tokens that would end "
                    f"it, which min_tokens={request.params.min_tokens} forbids this early: no token was left to "
                    "choose"
                )
            else:
                what = (
                    f"{entries[0].describe()} left this request no token to choose: every logit of its row was -inf "
                    "or NaN after its apply"
                )
            error = PluginHookError(
                f"{what}. The request was ended; the others go on. {entries[0].registered_by.remedy()}",
                plugin=entries[0].registered_by.name,
                hook="register_logits_processors",
            )
            logger.error("%s", error)
            self._end(request, error)

    def _processor_failed(
        self,
        failure: _ProcessorFailure,
        plan: ScheduledStep,
        rows: list[int],
        joiners: Mapping[int, BaseException] | None = None,
    ) -> None:
        """End the requests of ``rows`` with an error naming the plugin; rebuild the processor for the rest.

        ``joiners``: what ``update_state`` raised for each row that joined, tried alone. A ``ValueError`` there
        refuses that request, as one from ``validate_params`` does (a ``RequestRefusedError``: a server's 400):
        what the processor can only judge with its state (a word its tokenizer cannot spell). Anything else is
        the plugin's failure, told with what it raised for that request.
        """
        processor, entry = failure.processor, failure.processor.entry
        failed: dict[int, PluginHookError] = {}  # by id of the cause: each failure is logged once

        def failure_of(cause: BaseException) -> PluginHookError:
            if id(cause) not in failed:
                error = failed[id(cause)] = PluginHookError(
                    f"{entry.describe()} failed in {failure.method}: {type(cause).__name__}: {cause}. The requests "
                    f"it was processing were ended; the others go on. {entry.registered_by.remedy()}",
                    plugin=entry.registered_by.name,
                    hook="register_logits_processors",
                )
                error.__cause__ = cause
                logger.error("%s", error)
            return failed[id(cause)]

        ended = {}
        for row in rows:
            request = ended[id(plan.rows[row].request)] = plan.rows[row].request
            if request.error is not None:  # n > 1: another of its samples ended it
                continue
            cause = (joiners or {}).get(row)
            if isinstance(cause, ValueError):
                refused = RequestRefusedError(
                    f"{entry.describe()} refused the request: {cause}",
                    plugin=entry.registered_by.name,
                    hook="register_logits_processors",
                )
                logger.info("%s: %s", request.request_id, refused)
                self._end(request, refused)
            else:
                self._end(request, failure_of(cause or failure.cause))
        remaining = [
            _as_added(plan, row)
            for row, seq in enumerate(plan.rows)
            if id(seq.request) not in ended and not seq.request.finished
        ]
        try:
            processor.rebuild(self.loaded, BatchUpdate(len(plan.rows), added=remaining) if remaining else None)
        except Exception as exc:  # noqa: BLE001 - broken for everyone: end everyone it was processing
            logger.error(
                "%s could not be rebuilt (%s: %s): ending its requests", entry.describe(), type(exc).__name__, exc
            )
            for row, *_ in remaining:
                if not plan.rows[row].request.finished:
                    self._end(plan.rows[row].request, failure_of(failure.cause))
            try:
                processor.rebuild(self.loaded, None)
            except Exception:  # noqa: BLE001, S110 - its stand-in fails each later step, naming it, and tries again
                pass

    def _advance(
        self, plan: ScheduledStep, tokens: list[int], logprobs: torch.Tensor | None
    ) -> tuple[list, tuple[float, ...]]:
        """Give every active sequence its token; free the finished; collect the outputs to hand out, and the gaps
        since each sequence's previous token."""
        prefilled = bool(plan.prefill_rows)
        now = time.monotonic()
        changed: dict[int, EngineRequest] = {}
        gaps = []
        for i, row in enumerate(plan.active_rows):
            sequence = plan.rows[row]
            if prefilled:
                sequence.num_computed = len(sequence.prefill_token_ids)
            else:
                sequence.num_computed += 1
            wants = logprobs is not None and sequence.params.logprobs is not None
            sequence.append(tokens[i], logprobs[i] if wants else None)
            if sequence.last_token_time is not None:
                gaps.append(now - sequence.last_token_time)
            sequence.last_token_time = now
            request = sequence.request
            if request.first_token_time is None:
                request.first_token_time = now
            if sequence.finished:
                self.scheduler.free(sequence)
            changed[id(request)] = request
        deliveries = []
        for request in changed.values():
            error = None
            if request.finished:
                self._forget(request)
                try:
                    error = self._finish(request)
                except Exception as exc:  # noqa: BLE001 - forgotten already: unended here, its stream never ended
                    request.error = error = exc
            if request.on_output is not None:
                deliveries.append((request.on_output, None if error else self._output(request), error))
        return deliveries, tuple(gaps)

    def _output(self, request: EngineRequest) -> RequestOutput:
        """What a step hands out of ``request``: its output, where ``on_output`` hooks will still change it with no
        sample shown finished before the request is (a stream ended a sample that finished first, and the hooks'
        change of it never reached its client)."""
        output = request.output()
        if not request.finished and self._hooked["on_output"]:
            for sample in output.outputs:
                sample.finish_reason = sample.stop_reason = None
        return output

    def _finish(self, request: EngineRequest) -> BaseException | None:
        """Fix the request's final output, through the ``on_output`` hook; the error that ended it instead, if any."""
        output = request.output()
        if self._hooked["on_output"]:
            try:
                self._host.call(
                    "on_output", request=request, output=output, consequence="The request ended with this error."
                )
            except PluginHookError as exc:
                request.error = exc
                return exc
            uneven = [c.index for c in output.outputs if not _paired(c.logprobs, c.token_ids)]
            if uneven:  # one log-probability per token: answers pair them up
                plugins = self._host.implementers("on_output")
                request.error = PluginHookError(
                    f"the on_output hook of {' or '.join(p.describe() for p in plugins)} left sample(s) {uneven} "
                    "with logprobs that are not one per token of token_ids (lists of the same length): change both "
                    "together, or neither. The request ended with this error.",
                    plugin=plugins[0].name,
                    hook="on_output",
                )
                return request.error
        request.final_output = output
        return None

    def _take_inbox(self) -> None:
        with self._inbox_lock:
            events, self._inbox = self._inbox, []
            self._in_transit = sum(len(r.sequences) for what, r in events if what == "add")
        try:
            self._take(events)
        finally:
            with self._inbox_lock:
                self._in_transit = 0

    def _take(self, events: list[tuple[str, EngineRequest]]) -> None:
        """Queue the requests added, end those aborted, in the order it happened.

        Interrupted (Ctrl-C in a caller's step, a callback raising), what is not taken yet goes back to the head
        of the inbox, the event under way included, for the next step: dropped, another caller's requests held
        their ids and never ran, and its ``generate`` waited for ever. Taking an event again finishes what it
        had not done and repeats nothing it had.
        """
        taken = 0
        try:
            for what, request in events:
                self._take_one(what, request)
                taken += 1
        except BaseException:
            with self._inbox_lock:
                self._inbox[:0] = events[taken:]
            raise

    def _take_one(self, what: str, request: EngineRequest) -> None:
        if what == "add":
            self._requests[request.request_id] = request
            with self._inbox_lock:  # from in transit to waiting at once, as ``_check_room`` counts them
                self.scheduler.add(request.sequences)
                self._in_transit -= len(request.sequences)
            return
        if not request.aborted:
            if self._requests.get(request.request_id) is not request or request.finished:
                return  # ended before its abort was taken
            del self._requests[request.request_id]
            request.aborted = True
            request.end_time = time.monotonic()
        for sequence in request.sequences:
            if not sequence.finished:
                sequence.finish_reason = "abort"
            self.scheduler.free(sequence)
        # Each callback marked before it is called: one that was interrupted is not called again.
        if "on_end" not in request.abort_called:
            request.abort_called.add("on_end")
            if request.on_end is not None:
                request.on_end()
        if "on_output" not in request.abort_called:
            request.abort_called.add("on_output")
            if request.on_output is not None:
                request.on_output(request.output(), None)

    def _fit_memory(self, plan: ScheduledStep, full: KVCacheMemoryError) -> None:
        """Make the batch fit the cache ``full`` says can be had: preempt, hold back, or end.

        A running sequence the cache cannot grow for makes room by preemption, as in vLLM: the newest
        running sequences leave the cache until the others fit, and wait at the head of the queue with
        their tokens (``Scheduler.preempt``), while fewer run at once. Only one longer than the memory
        can hold even alone is ended. Every row counts: while newcomers are prefilled, a running
        sequence asks for the slot of its next token too, so newcomers are not let into the room it
        is about to need. A newcomer whose prompt fits no row beside the running sequences waits for
        one of them to leave; alone, it is ended.
        """
        running = [s for s in plan.rows if s.num_computed and _live(s)]
        # Running sequences the cache cannot grow for: room is made for them, and newcomers wait.
        squeezed = any(s.num_computed + 1 > full.slots or s.row >= full.rows for s in running)
        changed, preempted = self._make_room(running, full) if squeezed else (False, [])
        staying = [s for s in running if _live(s) and s not in preempted]
        held: list[Sequence] = []
        waits_for_room = 0
        for row, sequence in enumerate(plan.rows):
            if sequence.num_computed or not _live(sequence):
                continue
            too_long = len(sequence.prefill_token_ids) > full.slots
            if squeezed or row >= full.rows or (too_long and staying):
                held.append(sequence)
                waits_for_room += row < full.rows
            elif too_long:
                self._end(sequence.request, full)
                changed = True
        # Newest first, each to the head of the queue: they wait in the order they came (in row order when
        # they came together, as a request's prompts do).
        for sequence in reversed(sorted([*held, *preempted], key=_arrival)):
            (self.scheduler.preempt if sequence.num_computed else self.scheduler.hold_back)(sequence)
            changed = True
        self._preempted += len(preempted)
        if waits_for_room and not squeezed:
            self.scheduler.pause_admission()
        if not changed:  # the same step would be refused again: end its requests rather than spin
            for row in plan.active_rows:
                if not plan.rows[row].request.finished:
                    self._end(plan.rows[row].request, full)
        if squeezed and staying:  # no one joins them until the cache gives slots back (``_give_back``)
            self.runner.cap_rows(len(staying), max(s.num_computed + 1 for s in staying))
            self.scheduler.max_num_seqs = len(staying)
            if preempted:
                logger.warning(
                    "The KV cache cannot grow for %d running sequences in the memory available: %d preempted (they "
                    "wait, keeping their tokens, and are recomputed when they run again); at most %d run at once "
                    "(max_num_seqs is %d) until the long ones have ended.",
                    len(running),
                    len(preempted),
                    len(staying),
                    self.loaded.config.max_num_seqs,
                )
        elif held and full.rows < self.scheduler.max_num_seqs:
            if full.fitting_rows < full.rows:  # not even these can reach that length: they run as far as they can
                at_once = f"{full.rows} {'runs' if full.rows == 1 else 'run'} at once, until the memory runs out"
            else:
                at_once = f"at most {full.rows} run at once"
            logger.warning(
                "The KV cache has room for %d sequences of up to %d tokens in the memory available: %s "
                "(max_num_seqs is %d) while these run; the others wait.",
                full.fitting_rows,
                full.slots,
                at_once,
                self.loaded.config.max_num_seqs,
            )
            self.scheduler.max_num_seqs = full.rows

    def _make_room(self, running: list[Sequence], full: KVCacheMemoryError) -> tuple[bool, list[Sequence]]:
        """Choose the running sequences to preempt, newest first; end the last one if it cannot grow even alone.

        Whether a request was ended, and the sequences to preempt: as few as leave the others room to
        grow to their next tokens. The oldest (first to arrive; in row order when they came together)
        always keeps running, so every sequence is served in turn. A sequence is ended only once it runs
        alone: until then, the rows the others hold are not given back (``ModelRunner._give_back_rows``
        frees them at the next refused growth), so the memory it could have alone is not known.
        """
        keep = sorted(running, key=_arrival)
        if len(keep) == 1:
            alone = keep[0]
            if alone.num_computed + 1 > full.slots and not self.runner.rows_that_fit(alone.num_computed + 1):
                self._end(alone.request, full)
                return True, []
            return False, []
        preempted: list[Sequence] = []
        while len(keep) > 1 and len(keep) > (self.runner.rows_that_fit(max(s.num_computed + 1 for s in keep)) or 0):
            preempted.append(keep.pop())
        return False, preempted

    def _lift_row_cap(self) -> None:
        """Let as many sequences run again as the cache's rows may grow to, once its cap is lifted."""
        most = min(self.loaded.config.max_num_seqs, self.runner.row_cap)
        if self.scheduler.max_num_seqs < most:
            logger.info("The KV cache may grow again: up to %d sequences run at once.", most)
            self.scheduler.max_num_seqs = most

    def _fail(self, plan: ScheduledStep, error: BaseException) -> None:
        """End every request the failed step touched (its active rows), with ``error``; the others go on."""
        failed = {id(plan.rows[r].request): plan.rows[r].request for r in plan.active_rows}
        for request in failed.values():
            self._end(request, error)

    def _end(self, request: EngineRequest, error: BaseException) -> None:
        if request.error is not None:
            return
        request.error = error
        for sequence in request.sequences:
            self.scheduler.free(sequence)
        self._forget(request)
        if request.on_output is not None:
            request.on_output(None, error)

    def _forget(self, request: EngineRequest) -> None:
        """The request has ended (finished or failed): its id is free (unless a newer request has it already)."""
        if request.end_time is None:
            request.end_time = time.monotonic()
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
        with self._inbox_lock:
            if self._live.get(request.request_id) is request:
                del self._live[request.request_id]
        if request.on_end is not None:
            request.on_end()


def _choices_emptied(request: EngineRequest, sequence: Sequence, by_min_tokens: bool) -> InvalidParameterError:
    """The error ending a request whose own ``allowed_token_ids`` and ``bad_words`` (with ``logit_bias`` and
    ``min_tokens``) left a sample no token to choose: what the engine could not see when it took the request (a
    bad word of several tokens bans its last only once the others are out)."""
    params = request.params
    given = choices_given(params)
    held = f", and min_tokens={params.min_tokens} holds back the tokens that would end it," if by_min_tokens else ""
    return InvalidParameterError(
        f"this request's {' and '.join(given)}{held} left no token to choose after {len(sequence.token_ids)} "
        "generated tokens. The request was ended; the others go on. Allow more tokens, or ban fewer.",
        param=given[0] if given else "min_tokens",
    )


def _paired(logprobs: object, token_ids: object) -> bool:
    """Whether a sample's ``logprobs`` (``None``, or one per token) pair up with its ``token_ids``."""
    if logprobs is None:
        return True
    try:
        return len(logprobs) == len(token_ids)  # type: ignore[arg-type]
    except TypeError:  # an iterator, a number: what an on_output hook may leave
        return False


def blame(loaded: LoadedModel, exc: BaseException) -> Exception:
    """A failure in the model's code, or in code a plugin installed, as a ``ModelRunError`` naming it.

    The innermost frame that is the model's or a plugin's decides: a plugin's forward hook or patched
    method raising inside the model's forward is the plugin's fault. The engine's own errors stay as
    they are (and are logged as internal); one that is no ``Exception`` (``SystemExit``) becomes a
    ``RuntimeError``, which a request's caller can be given.
    """
    if isinstance(exc, PluginhostError):  # already says what failed (a rank of a tensor-parallel engine)
        return exc
    if isinstance(exc, ModelOutputError):
        error = ModelRunError(f"The model {loaded.describe()} does not follow the model interface: {exc}.")
        error.__cause__ = exc
        return error
    what = f"{type(exc).__name__}: {exc}"
    for filename in reversed(_traceback_files(exc.__traceback__)):
        if filename in loaded.code_files:
            error = ModelRunError(f"The model {loaded.describe()} failed while generating: {what}")
            break
        plugins = loaded.host.plugins_of_file(filename)
        if plugins:
            names = " or ".join(p.describe() for p in plugins)
            error = ModelRunError(
                f"Code of {names} (in {filename}) failed while the model {loaded.describe()} was generating, "
                f"code the plugin installed (a forward hook, a replaced method): {what}. The requests of the step "
                f"were ended. {plugins[0].remedy() if len(plugins) == 1 else 'Fix the plugin, or disable it.'}"
            )
            break
    else:
        logger.error("internal error in an engine step", exc_info=exc)
        if isinstance(exc, Exception):
            return exc
        error = RuntimeError(f"internal error in an engine step: {what}")
    error.__cause__ = exc
    return error


def _traceback_files(tb: TracebackType | None) -> list[str]:
    """The source file of every frame of a traceback, outermost first."""
    return [frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb)]


def _as_added(plan: ScheduledStep, row: int) -> AddedRequest:
    """Row ``row`` of the step as a processor meets a joining request: what a rebuilt processor is replayed."""
    seq = plan.rows[row]
    return (row, seq.params, seq.prompt_token_ids, seq.token_ids)


class _LiveProcessor:
    """One engine's instance of a registered logits processor, with failures traced to it."""

    def __init__(self, entry: RegisteredProcessor, instance: LogitsProcessor) -> None:
        self.entry, self.instance = entry, instance

    @classmethod
    def create(cls, entry: RegisteredProcessor, loaded: LoadedModel) -> _LiveProcessor:
        try:
            return cls(entry, entry.instantiate(loaded.config, loaded.device))
        except Exception as exc:
            raise PluginHookError(
                f"{entry.describe()} could not be created: {type(exc).__name__}: {exc}. The engine was not built. "
                f"{entry.registered_by.remedy()}",
                plugin=entry.registered_by.name,
                hook="register_logits_processors",
            ) from exc

    def rebuild(self, loaded: LoadedModel, replay: BatchUpdate | None) -> None:
        """A fresh instance, told about the rows still running; if none can be made, one that says so."""
        try:
            self.instance = self.entry.instantiate(loaded.config, loaded.device)
        except Exception as exc:
            self.instance = _Unbuilt(exc)
            raise
        if replay is not None:
            self.instance.update_state(replay)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        try:
            result = self.instance.apply(logits)
        except Exception as exc:  # noqa: BLE001 - a plugin's code may raise anything
            raise _ProcessorFailure(self, "apply", exc) from exc
        if not isinstance(result, torch.Tensor) or result.shape != logits.shape:
            raise _ProcessorFailure(
                self, "apply", TypeError(f"apply must return the (batch, vocab) logits, got {result!r:.60}")
            )
        return result

    def is_argmax_invariant(self) -> bool:
        try:
            return bool(self.instance.is_argmax_invariant())
        except Exception as exc:  # noqa: BLE001 - a plugin's code may raise anything
            raise _ProcessorFailure(self, "is_argmax_invariant", exc) from exc


class _Unbuilt:
    """In place of a processor that could not be created again: each step's call fails, naming the cause.

    The engine then ends that step's requests with an error naming the plugin, and tries to create
    the processor anew, as after any failure of it.
    """

    def __init__(self, cause: Exception) -> None:
        self.cause = cause

    def _fail(self, *args: object) -> None:
        raise RuntimeError(f"it could not be created again after failing: {type(self.cause).__name__}: {self.cause}")

    update_state = apply = is_argmax_invariant = _fail


class _NonFiniteLogits(Exception):
    def __init__(self, rows: list[int], in_prompt: list[int]) -> None:
        super().__init__(f"logits not finite in rows {rows}, and in the prompts scored of rows {in_prompt}")
        self.rows, self.in_prompt = rows, in_prompt


class _ProcessorFailure(Exception):
    def __init__(self, processor: _LiveProcessor, method: str, cause: BaseException) -> None:
        super().__init__(f"{processor.entry.describe()} failed in {method}")
        self.processor, self.method, self.cause = processor, method, cause


def _arrival(sequence: Sequence) -> tuple[float, int]:
    """Sorts sequences in the order their requests came (a request's samples in index order)."""
    return sequence.request.arrival_time, sequence.index


def _live(sequence: Sequence) -> bool:
    """Whether a sequence of the batch still runs: its request has neither finished nor failed."""
    return not sequence.request.finished and sequence.request.error is None
