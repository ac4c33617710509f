"""Tensor parallelism: one model split over N processes (ranks), rank 0 scheduling.

Rank 0 is the caller's process. It runs the engine loop (scheduler, sampler,
runtime hooks) and, at every step, sends the step's ``StepInputs`` to the other
ranks; every rank then runs the same forward passes on its shard of the model
(``builtin_models.tp``), meeting the others in the model's all-reduces, and all
end with the whole logits, which only rank 0 samples from.

Processes: ``LLM(tensor_parallel_size=N)`` spawns ranks 1..N-1 on this machine
(``multiprocessing``, spawn) with a rendezvous on 127.0.0.1; under ``torchrun``
the ranks and the rendezvous come from its environment, so the same command
runs over several machines. Communication is ``torch.distributed``: gloo on
CPU, NCCL on CUDA, in two groups: the model's collectives, bounded by
``PLUGINHOST_DIST_TIMEOUT`` seconds (60), and the control group that carries
the steps (gloo): unbounded where the other ranks wait on it (an idle engine
waits for work), bounded by the same timeout where rank 0 hands a step over.

Building: every rank builds its own engine through the whole hook pipeline,
loading its plugins itself. The ranks compare notes twice (``Agreement``):
once the plugins are loaded and the configuration settled (what was loaded,
what registered which architecture, the configuration), and once the model
is built. A failure on any rank, or a difference, stops every rank with one
error naming the ranks and the plugin. A rank that dies or stops answering is
named too, within the timeout, and every process of the engine is ended.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import inspect
import logging
import math
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any

import torch
import torch.distributed as dist

from pluginhost import distributed
from pluginhost.distributed import torchrun_rank
from pluginhost.engine.memory import keep_freed_memory
from pluginhost.engine.runner import ModelRunner, StepInputs
from pluginhost.errors import ConfigError, PluginhostError, TensorParallelError

__all__ = [
    "TIMEOUT_ENV",
    "Agreement",
    "DistributedRunner",
    "Ranks",
    "build_parallel",
    "fingerprint",
    "free_port",
    "serve_steps",
    "start_ranks",
    "torchrun_rank",
]

logger = logging.getLogger(__name__)

#: Seconds a collective (or the rendezvous) may take before the ranks give up on each other.
TIMEOUT_ENV = "PLUGINHOST_DIST_TIMEOUT"
_DEFAULT_TIMEOUT_S = 60.0
#: How long an idle rank waits for the next step: "forever", in practice.
_CONTROL_TIMEOUT = datetime.timedelta(days=365)


def dist_timeout() -> float:
    """``PLUGINHOST_DIST_TIMEOUT``: how long ranks wait for each other, in seconds (finite, above 0)."""
    value = os.environ.get(TIMEOUT_ENV, "")
    if not value:
        return _DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < 1e9:  # NaN fails too; past 1e9 s (31 years), torch's timedelta overflows
        raise ConfigError(
            f"{TIMEOUT_ENV}={value!r} is not a number of seconds above 0 and below 1e9 (default "
            f"{_DEFAULT_TIMEOUT_S:g}); "
            "set it to how long the ranks may take to meet and to answer, e.g. 120"
        )
    return seconds


# -- the ranks, from rank 0 ---------------------------------------------------------------------


@dataclass(frozen=True)
class RankSpec:
    """What a spawned rank needs to build the same engine (picklable)."""

    rank: int
    world_size: int
    #: The port of rank 0's rendezvous store on 127.0.0.1.
    store_port: int
    backend: str
    settings: dict[str, Any]
    host_args: dict[str, Any]
    parent_pid: int
    num_threads: int
    timeout_s: float
    #: Where a rank that fails in a step says why, for rank 0's error (a ``SimpleQueue`` of (rank, reason)).
    reasons: Any = None


class Ranks:
    """The processes of one tensor-parallel engine and their groups, as this process sees them."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        processes: dict[int, multiprocessing.Process],
        control: Any,
        timeout_s: float,
        threads_before: int | None,
        reasons: Any = None,
        owns_default_group: bool = True,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.processes = processes  # rank -> the spawned process (rank 0 only, not under torchrun)
        self.control = control
        self.timeout_s = timeout_s
        self._threads_before = threads_before
        self.broken: TensorParallelError | None = None
        self._closed = False
        #: Spawned ranks' reasons for failing in a step (``RankSpec.reasons``); ``None`` under torchrun.
        self.reasons = reasons
        #: Whether the engine made the default group (``False``: a torchrun script did, and keeps it after close).
        self.owns_default_group = owns_default_group

    @property
    def on_this_machine(self) -> int:
        """How many ranks share this machine's memory: all spawned ones; under torchrun, ``LOCAL_WORLD_SIZE``."""
        return self.world_size if self.processes else int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    def check_alive(self) -> None:
        """Raise ``TensorParallelError`` when a spawned rank has died (or an earlier failure broke the engine)."""
        if self.broken is not None:
            raise self.broken
        if self._closed:
            raise TensorParallelError("this tensor-parallel engine was closed, and its other ranks ended with it")
        dead = self.dead_ranks()
        if dead:
            raise self.fail(TensorParallelError(f"{dead}; the engine is stopped."))

    def dead_ranks(self) -> str:
        """``"rank 1 (pid 123) exited with status -9"`` for each spawned rank that is gone; empty if none."""
        gone = [
            f"rank {rank} (pid {process.pid}) exited with status {process.exitcode}"
            for rank, process in sorted(self.processes.items())
            if process.exitcode is not None
        ]
        return "; ".join(gone)

    def send_step(self, inputs: StepInputs | None) -> None:
        """Every other rank gets ``inputs`` (``None``: stop) and runs it (``receive_step`` there).

        Bounded by ``PLUGINHOST_DIST_TIMEOUT``: gloo's broadcast waits until every receiver has taken
        the message, so a rank that stopped answering between steps (stopped, swapped out, stuck)
        would hold rank 0, and every request, forever. A rank found dead meanwhile is named at once.
        """
        payload = torch.frombuffer(bytearray(pickle.dumps(inputs)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.long)
        for tensor in (size, payload):
            self._wait(dist.broadcast(tensor, src=0, group=self.control, async_op=True), "sending a step")

    def receive_step(self) -> StepInputs | None:
        """Rank 0's next ``send_step`` (on the other ranks): waits as long as rank 0 is idle."""
        size = torch.empty(1, dtype=torch.long)
        dist.broadcast(size, src=0, group=self.control)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.control)
        return pickle.loads(payload.numpy().tobytes())  # noqa: S301 - from rank 0, which runs the same code

    def _wait(self, work: Any, doing: str) -> None:
        """Wait for a collective started with ``async_op=True``, watching the other ranks meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        pause = 1e-4  # a rank waiting for the step answers in well under a millisecond: poll fast at first
        while not work.is_completed():
            dead = self.dead_ranks()  # not check_alive: close() sends its stop message through here
            if dead:
                raise self.fail(TensorParallelError(f"{dead}; the engine is stopped."))
            if time.monotonic() > deadline:
                raise self.fail(self._no_answer(doing))
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        try:
            work.wait()
        except Exception as exc:
            error = self.explain(exc, doing)
            if not self.dead_ranks() and _timed_out(exc):  # gloo's own timeout, as long as ours, came first
                error = self._no_answer(doing)
            raise self.fail(error) from exc

    def _no_answer(self, doing: str) -> TensorParallelError:
        return TensorParallelError(
            f"Tensor parallelism failed: a rank did not answer within {self.timeout_s:g} s while {doing} "
            f"({TIMEOUT_ENV} sets the limit; a rank stopped or stuck between steps?). The engine is stopped."
        )

    def explain(self, exc: BaseException, doing: str, hint: str = "") -> TensorParallelError:
        """A failed collective, said in terms of ranks: which died, or that one did not answer in time.

        ``hint``: a sentence on what to do, put before "The engine is stopped."
        """
        deadline = time.monotonic() + 2.0  # a rank that just died: let its exit status arrive
        while self.processes and not self.dead_ranks() and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = self.dead_ranks()
        if dead:
            reasons = self._reasons()
            failed = any(process.exitcode == 1 for process in self.processes.values())  # it logged its error
            logged = " (its own error is in its log: lines starting 'pluginhost rank')" if failed else ""
            message = f"{dead} while {doing}{logged}" + "".join(f"; rank {r}: {why}" for r, why in reasons)
        elif _timed_out(exc):
            message = (
                f"a rank did not answer within {self.timeout_s:g} s while {doing} ({TIMEOUT_ENV} sets the limit): "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            )
        else:
            message = f"the ranks lost each other while {doing}: {type(exc).__name__}: {exc}"
        hint = f" {hint}" if hint else ""
        error = TensorParallelError(f"Tensor parallelism failed: {message}.{hint} The engine is stopped.")
        error.__cause__ = exc
        return error

    def _reasons(self) -> list[tuple[int, str]]:
        """What failed ranks said of their failure before exiting (spawned ranks only)."""
        found = []
        try:
            while self.reasons is not None and not self.reasons.empty():
                found.append(self.reasons.get())
        except (OSError, EOFError):  # the queue's pipe broken with the rank: nothing more to read
            pass
        return found

    def fail(self, error: TensorParallelError) -> TensorParallelError:
        """Mark the engine broken (the ranks are out of step) and end the other ranks; returns ``error``."""
        if self.broken is None:
            self.broken = error
            logger.error("%s", error)
            self.close()
        return self.broken

    def close(self, timeout: float = 10.0) -> None:
        """End every rank: a stop message when they are in step, else (or if they linger) signals. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with _CLOSING.held():
            try:
                if self.rank == 0 and self.broken is None:
                    try:
                        self.send_step(None)
                    except Exception:  # noqa: BLE001 - a rank already gone: the signals below
                        logger.debug("could not send the stop message", exc_info=True)
                else:  # no stop message: the ranks end by themselves after a failed build, or are stuck
                    timeout = min(timeout, 2.0)
            except BaseException:  # Ctrl-C while the stop message goes out: the ranks are still ended, at once
                self._end(0.0)
                raise
            self._end(timeout)

    def _end(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the ranks to end, then kill the rest; leave the group, give the threads back."""
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes.values():
            if process.is_alive():
                process.kill()  # a rank ignores SIGTERM (see _rank_main)
                process.join(5.0)
        # A group still referenced keeps its sockets, and the rendezvous store behind them, open: let go of it.
        control, self.control = self.control, None
        if self.processes or self.broken is None:
            if self.owns_default_group:
                _destroy_group()  # every group, the control group with it
            elif control is not None:  # the script's own group (torchrun) stays the script's to use and destroy
                _destroy_group(control)
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
        distributed._clear()


def _timed_out(exc: BaseException) -> bool:
    return "timed out" in str(exc).lower() or "timeout" in str(exc).lower()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a test's or a benchmark's server (another process may take it first)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def start_ranks(world_size: int, device: torch.device, settings: dict[str, Any], host_args: dict[str, Any]) -> Ranks:
    """Join (torchrun) or start (spawn) the ranks; this process is rank 0 when it spawns them."""
    # Imported while there is no group yet: its functions take the default group as a default argument
    # (``group=group.WORLD``), so imported later (building the model imports it, through torch._dynamo) they
    # would hold this engine's group for the rest of the process, and its sockets and rendezvous store open.
    import torch.distributed.nn  # noqa: F401

    timeout_s = dist_timeout()
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = _backend(device)
    rank = torchrun_rank()
    processes: dict[int, multiprocessing.Process] = {}
    reasons = None
    threads_before = None
    initialized = False
    if rank is not None:  # torchrun: every rank runs this same code
        launched = int(os.environ["WORLD_SIZE"])
        if launched != world_size:
            raise ConfigError(
                f"tensor_parallel_size={world_size}, but the launcher started {launched} processes (WORLD_SIZE); "
                "make them equal (torchrun --nproc-per-node N ... --tensor-parallel-size N)"
            )
        initialized = dist.is_initialized()  # by the script itself: only the control group is left to make
        meeting = {"init_method": "env://"}
        control = _init(backend, meeting, rank, world_size, timeout, timeout_s, processes, initialized=initialized)
    else:
        if dist.is_initialized() and _abandoned_rendezvous is not None and _abandoned_rendezvous.is_alive():
            # A start given up on (a rank died as the ranks met) holds the group until torch lets it go.
            logger.warning("waiting up to %g s for the last, failed start of the ranks to let go", timeout_s)
            _abandoned_rendezvous.join(timeout_s + 5)
        _CLOSING.wait(_CLOSES_WAIT_S)  # an engine closing in another thread leaves the group once its ranks ended
        if dist.is_initialized():
            raise ConfigError(
                "this process already belongs to a torch.distributed group (another tensor-parallel engine?): "
                "close that engine first, or run one engine per process"
            )
        if multiprocessing.current_process().daemon:  # multiprocessing's own refusal is a bare AssertionError
            raise ConfigError(
                f"tensor_parallel_size={world_size} starts {world_size - 1} worker process(es), which a daemonic "
                "process (a multiprocessing.Pool worker, say) may not have: build the engine in the main process or "
                "in a multiprocessing.Process that is not a daemon, or launch the ranks with torchrun"
            )
        rank = 0
        store = _loopback_store(world_size, timeout)
        if device.type == "cpu":  # N processes share the cores: each takes its share of the threads
            threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, threads_before // world_size))
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            if world_size > cores:
                logger.warning(
                    "tensor_parallel_size=%d starts %d processes on the %d core(s) this process may use: they take "
                    "turns on the cores, each with an interpreter and torch of its own (some hundreds of MiB beside "
                    "its share of the weights); on a CPU, no more ranks than cores run faster",
                    world_size,
                    world_size,
                    cores,
                )
        context = multiprocessing.get_context("spawn")
        reasons = context.SimpleQueue()
        # The ranks ignore Ctrl-C from their first instruction (a terminal sends it to the whole group;
        # rank 0 ends them): an ignored signal stays ignored in the spawned interpreter. Only the main
        # thread may set a handler; another (AsyncLLM builds in its engine thread) blocks the signal
        # instead, a mask the ranks inherit and lift once they ignore it. multiprocessing's resource
        # tracker, started by the first spawn, unblocks it in the spawning thread: start it first.
        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
        mask = None
        if not in_main_thread:
            resource_tracker.ensure_running()
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            try:
                for r in range(1, world_size):
                    spec = RankSpec(
                        r,
                        world_size,
                        store.port,
                        backend,
                        settings,
                        host_args,
                        os.getpid(),
                        torch.get_num_threads(),
                        timeout_s,
                        reasons,
                    )
                    processes[r] = context.Process(
                        target=_rank_main, args=(spec,), name=f"pluginhost-rank-{r}", daemon=True
                    )
                    processes[r].start()
            finally:
                if in_main_thread:
                    signal.signal(signal.SIGINT, previous)
                else:
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            control = _init(backend, {"store": store}, 0, world_size, timeout, timeout_s, processes)
        except BaseException:
            for process in processes.values():
                if process.pid is not None:  # started
                    process.kill()
                    process.join(5.0)
            if threads_before is not None:
                torch.set_num_threads(threads_before)
            raise
    distributed._set(rank, world_size)
    return Ranks(
        rank,
        world_size,
        processes=processes,
        control=control,
        timeout_s=timeout_s,
        threads_before=threads_before,
        reasons=reasons,
        owns_default_group=not initialized,
    )


def _loopback_store(world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0's rendezvous store for spawned ranks, listening on 127.0.0.1 only.

    Given host "127.0.0.1", torch's store still listens on every interface (its server binds the wildcard
    address, the host is only where clients connect): anyone who reaches this machine could read and write
    its keys, and so the groups' addresses the ranks meet at, and a rank unpickles what comes over them.
    So the listening socket is bound here and handed over (``master_listen_fd``, which only the store's
    classic backend takes), as vLLM does since CVE-2025-47277. It listens before any rank starts, on a
    port the kernel chose: no other process can take it in between, as one could a port found free and
    bound later. The store owns the socket from then on and closes it when the group that holds it is
    destroyed (``Ranks.close``).
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        store = dist.TCPStore(
            "127.0.0.1",
            listener.getsockname()[1],
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
            use_libuv=False,
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store closes it: closing it here too could close another file given the same number
    return store


#: The rendezvous thread of the last start given up on while it still waited in torch (``None``: none).
_abandoned_rendezvous: threading.Thread | None = None


class _Closes:
    """The engines closing now, in any thread. One the garbage collector freed closes in its own loop thread and
    leaves the group a moment after its ranks have ended: an engine started meanwhile waits for it, or it found
    the process still in the group ("close that engine first", of an engine the caller no longer had)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._count = 0

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._changed:
            self._count += 1
        try:
            yield
        finally:
            with self._changed:
                self._count -= 1
                self._changed.notify_all()

    def wait(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait_for(lambda: not self._count, timeout)


#: Up to this many seconds a new engine waits for others closing (their ranks' 10 s, then signals).
_CLOSES_WAIT_S = 30.0
_CLOSING = _Closes()


def _init(
    backend: str,
    meeting: dict[str, Any],
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    timeout_s: float,
    processes: dict[int, multiprocessing.Process],
    *,
    initialized: bool = False,
) -> Any:
    """Meet the other ranks (unless ``initialized``: a launcher's script did) and make the control group.

    ``meeting``: how ``init_process_group`` meets them (``init_method``, or a ``store``).

    Returns the control group (``Ranks.control``). Both happen in a thread, so that this one can see a
    spawned rank die (or Ctrl-C) instead of waiting out the timeout: creating a group is a rendezvous
    too, which a rank dying or stuck just after the first one would hold forever.
    """
    outcome: list[Any] = []
    met = threading.Event()
    lock = threading.Lock()
    abandoned = False

    def meet() -> None:
        try:
            if not initialized:
                dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **meeting)
            met.set()
            # Rank 0 only sends on it, so its side is bounded (a rank stuck here, or between steps, is
            # named within the timeout); the others wait on it for rank 0's next step, however idle.
            control = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else _CONTROL_TIMEOUT)
            result: Any = control
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            result = exc
        with lock:
            outcome.append(result)
            # Failed here, or given up on by the waiting thread: leave no half-made group behind, so that this
            # process can start another engine (one already in a torch.distributed group is refused).
            if (abandoned or isinstance(result, BaseException)) and not initialized:
                _destroy_group()

    thread = threading.Thread(target=meet, name="pluginhost-rendezvous", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.1)
            dead = {r: p for r, p in processes.items() if p.exitcode is not None}
            if dead and thread.is_alive():
                gone = "; ".join(f"rank {r} (pid {p.pid}) exited with status {p.exitcode}" for r, p in dead.items())
                if met.is_set():
                    raise TensorParallelError(
                        f"Tensor parallelism could not start: {gone} just after the ranks met, before the model "
                        "was built. Its own error, if it printed one, is above, on stderr."
                    )
                raise TensorParallelError(
                    f"Tensor parallelism could not start: {gone} before the ranks met. Its own error is above, on "
                    "stderr. Each rank imports the main script again (multiprocessing's spawn): a script must build "
                    'its engine under `if __name__ == "__main__":`, and be a file (not read from stdin).'
                )
    except BaseException:
        with lock:
            if not outcome:  # given up on (a rank died, Ctrl-C): the thread cleans up once torch lets it go
                abandoned = True
                global _abandoned_rendezvous
                _abandoned_rendezvous = thread
            elif not isinstance(outcome[0], BaseException) and not initialized:  # it finished meanwhile
                _destroy_group()
        raise
    try:
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
    except Exception as exc:
        dead = [f"rank {r} (pid {p.pid}) exited with status {p.exitcode}" for r, p in processes.items() if p.exitcode]
        where = "did not set up their groups after they met" if met.is_set() else "did not meet"
        why = "; ".join(dead) if dead else f"not every rank joined within {timeout_s:g} s ({TIMEOUT_ENV} sets it)"
        raise TensorParallelError(
            f"Tensor parallelism could not start: the {world_size} ranks {where} ({why}). "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from exc
    return outcome[0]


def _destroy_group(group: Any = None) -> None:
    """Destroy ``group``, or by default every group of this process (best effort)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - best effort: the peers are gone
            logger.debug("destroy_process_group failed", exc_info=True)


# -- building on every rank ---------------------------------------------------------------------


class Agreement:
    """The two points of the build where the ranks compare notes; each rank calls both, in order.

    ``reach("plan", fingerprint)``: every rank loaded its plugins and settled its configuration;
    ``reach("built")``: every rank built its shard. A rank that failed before reaching a point
    still joins it (``abandon``) with its error, so the others are never left waiting.
    """

    PHASES = ("plan", "built")

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self._next = 0
        #: When this rank set out for the next point (the ranks start together, and leave each point together).
        self._since = time.monotonic()
        #: Why this rank's own exchange failed (it gave up on the others), and that in brief, for rank 0's error.
        self.lost: tuple[TensorParallelError, str] | None = None

    def reach(self, phase: str, fingerprint: dict[str, Any] | None = None) -> None:
        assert self.PHASES[self._next] == phase, f"agreement phase {phase!r} out of order"
        reports = self._exchange({"rank": self.ranks.rank, "error": None, "fingerprint": fingerprint})
        failed = [r for r in reports if r["error"] is not None]
        if failed or (phase == "plan" and _differences([r["fingerprint"] for r in reports])):
            self._next = len(self.PHASES)  # every rank stops here: no later exchange
        if failed:
            raise TensorParallelError(
                "Building the model failed on "
                + "; ".join(f"rank {r['rank']}: {str(r['error']).rstrip('.')}" for r in failed)
                + ". No rank was built."
            )
        if phase == "plan":
            if self.ranks.rank == 0:
                for warning in _settings_differences([r["fingerprint"] for r in reports]):
                    logger.warning("%s", warning)
            problems = _differences([r["fingerprint"] for r in reports])
            if problems:
                raise TensorParallelError(
                    "The ranks did not load the same plugins, architectures or configuration, so they would build "
                    "different models: " + "; ".join(problems) + ". Install the same plugins for every rank, with "
                    "the same selection (environment and flags)."
                )

    def abandon(self, error: BaseException) -> None:
        """Join the next exchange with ``error`` (this rank failed), without raising."""
        if self._next >= len(self.PHASES):
            return
        try:
            self._exchange({"rank": self.ranks.rank, "error": _describe(error), "fingerprint": None})
        except Exception:  # noqa: BLE001 - the others may be gone too; this rank's own error is what matters
            logger.debug("the other ranks could not be told of this rank's failure", exc_info=True)

    def _exchange(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        phase = self.PHASES[self._next]
        self._next += 1
        took = time.monotonic() - self._since
        try:
            reports = _gather_objects(mine, self.ranks)
        except BaseException as exc:
            self._next = len(self.PHASES)  # no later exchange: the others would meet a half-done one (gloo aborts)
            if not isinstance(exc, Exception):  # Ctrl-C while a slower rank was awaited: stopped at once
                raise
            doing = "planning the build" if phase == "plan" else "building and loading the model"
            limit = f"{self.ranks.timeout_s:g} s"
            hint = ""
            if took > self.ranks.timeout_s:  # this rank came late: the others may have given up waiting for it
                hint = (
                    f"Rank {self.ranks.rank} took {took:.1f} s {doing}, longer than the {limit} the other ranks wait "
                    f"for it ({TIMEOUT_ENV}): set {TIMEOUT_ENV} above the slowest rank's time (work done on one rank "
                    "only, such as a build hook's `if get_rank() == 0:` part, makes the others wait)."
                )
            if self.ranks.rank != 0 and _timed_out(exc) and not hint:
                told = f"waited {limit} ({TIMEOUT_ENV}) for the other ranks to finish {doing}, and gave up"
                error = TensorParallelError(
                    f"Tensor parallelism failed: rank {self.ranks.rank} {told}: another rank is slower there; if "
                    f"nothing is stuck, raise {TIMEOUT_ENV}. The engine is stopped."
                )
            else:
                error = self.ranks.explain(exc, doing, hint)
                told = str(error).removeprefix("Tensor parallelism failed: ").removesuffix(" The engine is stopped.")
            self.lost = (error, told.rstrip("."))
            raise error from exc
        self._since = time.monotonic()
        return reports


def cuda_device_of(rank: int) -> torch.device:
    """The GPU of a rank: one per rank (torchrun's LOCAL_RANK when the ranks span several machines)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))


def _gather_objects(mine: Any, ranks: Ranks) -> list[Any]:
    """Every rank's ``mine``, as ``dist.all_gather_object`` gathers them, waiting in Python rather than in gloo.

    A rank waiting inside gloo for a slower one (a plugin's long build hook, a slow read on one rank) takes no
    Ctrl-C until the wait ends; here the wait is a loop the signal interrupts. Two gathers, as torch's own:
    each rank's size, then every rank's bytes padded to the longest.
    """
    # NCCL gathers only tensors on the rank's GPU (all_gather_object takes the current one there, which nothing
    # here sets: cuda:0 on every rank); gloo, CPU ones.
    device = cuda_device_of(ranks.rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    world_size = ranks.world_size
    data = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size)]
    _awaited(dist.all_gather(sizes, torch.tensor([data.numel()], device=device), async_op=True))
    sizes_held = [int(size) for size in sizes]
    padded = torch.zeros(max(sizes_held), dtype=torch.uint8, device=device)
    padded[: data.numel()] = data.to(device)
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    _awaited(dist.all_gather(gathered, padded, async_op=True))
    return [pickle.loads(bytes(b[:size].cpu().numpy())) for b, size in zip(gathered, sizes_held, strict=True)]


def _awaited(work: Any) -> None:
    """Wait for a collective's ``work`` (its errors, a timeout too, are ``wait()``'s), in steps a signal can end."""
    pause = 1e-4
    while not work.is_completed():
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    work.wait()


def fingerprint(config: Any, plan: Any, host: Any) -> dict[str, Any]:
    """What must be the same on every rank before the model is built."""
    pm = host.plugin_manager
    return {
        "plugins": {
            r.name: {"status": r.status, "distribution": r.distribution, "version": r.version, "hooks": list(r.hooks)}
            for r in host.records
        },
        # Compared for a warning only: such values may rightly differ between processes (a start time, a pid).
        "settings": {r.name: _plain_attributes(pm.get_plugin(r.name)) for r in host.records if r.kind == "in-process"},
        "architectures": {
            e.architecture: f"{e.implementation} (registered by {e.registered_by.name})"
            for e in plan.registry.entries()
        },
        "config": config.model_dump(mode="json"),
    }


def _plain_attributes(plugin: object) -> dict[str, str] | None:
    """A plugin's public settings of plain values, as text; ``None`` for a plugin that has none to compare.

    The other ranks import an in-process plugin by name, so they get it as its module makes it: a
    change made afterwards (under the script's ``if __name__ == "__main__":``, or ``my_plugin.SCALE = 3``
    before building) is rank 0's alone, and the ranks would build different models in silence. That
    holds for an object's attributes and for a module's or a class's own names alike. Plain values
    only: numbers, strings, ``None``, and tuples, lists and dicts of them; functions, classes, modules
    and objects (a lock, a connection) are left out, as are private and dunder names.
    """
    if plugin is None or inspect.isroutine(plugin):
        return None
    try:
        attributes = vars(plugin)
    except TypeError:  # __slots__ only
        return None
    return {k: _as_text(v) for k, v in sorted(attributes.items()) if not k.startswith("_") and _is_plain(v)}


_PLAIN_SCALARS = (int, float, complex, str, bytes, bool, type(None))


def _is_plain(value: object, depth: int = 0) -> bool:
    """A number, string or ``None``, or a (small, shallow) tuple, list or dict of them."""
    if isinstance(value, _PLAIN_SCALARS):
        return True
    if depth >= 3 or not isinstance(value, (tuple, list, dict)) or len(value) > 1000:
        return False
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value
    return all(_is_plain(item, depth + 1) for item in items)


def _as_text(value: object) -> str:
    """``repr(value)``, shortened (with a digest of the whole) when long: every rank sends it to every other."""
    text = repr(value)
    if len(text) <= 120:
        return text
    return f"{text[:80]}... (sha256 {hashlib.sha256(text.encode()).hexdigest()[:12]})"


def _differences(prints: list[dict[str, Any]]) -> list[str]:
    """Each way a rank's fingerprint differs from rank 0's, naming the plugin (or architecture, or field)."""
    base, problems = prints[0], []
    for rank, other in enumerate(prints[1:], start=1):
        for name in sorted(set(base["plugins"]) | set(other["plugins"])):
            mine, theirs = base["plugins"].get(name), other["plugins"].get(name)
            if mine == theirs:
                continue
            if theirs is None or mine is None:
                where, missing = (0, rank) if theirs is None else (rank, 0)
                problems.append(f"plugin {name!r} is loaded on rank {where} but not on rank {missing}")
            else:
                changed = ", ".join(
                    f"{k} {mine[k]!r} on rank 0, {theirs[k]!r} on rank {rank}" for k in mine if mine[k] != theirs[k]
                )
                problems.append(f"plugin {name!r} differs: {changed}")
        for arch in sorted(set(base["architectures"]) | set(other["architectures"])):
            mine, theirs = base["architectures"].get(arch), other["architectures"].get(arch)
            if mine != theirs:
                problems.append(
                    f"architecture {arch!r} is {mine or 'not registered'} on rank 0, "
                    f"{theirs or 'not registered'} on rank {rank}"
                )
        for key in sorted(set(base["config"]) | set(other["config"])):
            if base["config"].get(key) != other["config"].get(key):
                problems.append(
                    f"the configuration's {key} is {base['config'].get(key)!r} on rank 0, "
                    f"{other['config'].get(key)!r} on rank {rank} (a modify_config hook?)"
                )
    return problems


def _settings_differences(prints: list[dict[str, Any]]) -> list[str]:
    """Each in-process plugin whose plain attributes differ on another rank (see ``_plain_attributes``)."""
    base, found = prints[0]["settings"], []
    for rank, other in enumerate(prints[1:], start=1):
        for name, mine in base.items():
            theirs = other["settings"].get(name)
            if mine is not None and theirs is not None and mine != theirs:
                changed = {k: (v, theirs.get(k)) for k, v in mine.items() if theirs.get(k) != v}
                found.append(
                    f"in-process plugin {name!r} has "
                    + ", ".join(f"{k}={a} on rank 0 but {b} on rank {rank}" for k, (a, b) in changed.items())
                    + ": the other ranks import it by name, so a value set after its module made it (in the "
                    'script\'s `if __name__ == "__main__":` block, or by assigning to it before building) is rank '
                    "0's alone, and if its hooks read it the ranks build different models. Give it these values where "
                    "its module makes it."
                )
    return found


def _describe(error: BaseException) -> str:
    if isinstance(error, PluginhostError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def build_parallel(host: Any, settings: dict[str, Any], world_size: int, device: torch.device) -> tuple[Any, Ranks]:
    """Start the ranks and build this rank's engine (``LoadedModel``) with them."""
    from pluginhost.engine.loader import load_model

    ranks = start_ranks(world_size, device, settings, host.replica_args())
    agreement = Agreement(ranks)
    try:
        loaded = load_model(host, settings, agreement=agreement)
    except BaseException as exc:
        agreement.abandon(exc)
        ranks.broken = ranks.broken or TensorParallelError("the build failed")
        ranks.close()
        raise
    return loaded, ranks


# -- a rank other than 0 ------------------------------------------------------------------------


def serve_steps(loaded: Any, ranks: Ranks) -> None:
    """Run the steps rank 0 sends, on this rank's share of ``loaded`` (a ``LoadedModel``), until it says stop.

    A collective failing here is a ``TensorParallelError`` saying what this rank can know: rank 0 is gone
    (or another rank); the model's or a plugin's own error is raised as it is.
    """
    runner = ModelRunner(  # as rank 0's: every rank's cache holds its heads alike
        loaded.model,
        loaded.device,
        max_num_seqs=loaded.config.max_num_seqs,
        max_model_len=loaded.max_model_len,
        kv_cache_dtype=loaded.kv_cache_dtype,
    )
    while True:
        try:
            inputs = ranks.receive_step()
        except Exception as exc:  # only rank 0 sends on this group: its end closed
            raise TensorParallelError(
                f"Tensor parallelism failed: rank 0 is gone (it died, or ended its engine after a failure it "
                f"reports itself): rank {ranks.rank} lost it while waiting for its next step; this rank stops."
            ) from exc  # gloo's own words ("Connection closed by peer ...") follow with --debug
        if inputs is None:
            return
        try:
            runner.run(inputs)
        except Exception as exc:
            if not _raised_in_a_collective(exc):
                raise
            if _timed_out(exc):
                raise ranks.explain(exc, "running a step") from exc
            raise TensorParallelError(
                f"Tensor parallelism failed: another rank is gone (rank 0, or one that rank 0 then stopped): rank "
                f"{ranks.rank} lost it while running a step; this rank stops."
            ) from exc


def _rank_main(spec: RankSpec) -> None:
    """A spawned rank: build the same engine, then run rank 0's steps until told to stop."""
    # Ctrl-C and a SIGTERM sent to the whole process group (a terminal, systemd's `stop`) reach rank 0 too,
    # which finishes what is in flight, then stops the others: a rank ending at once would fail it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # blocked when spawned from another thread
    _exit_with(spec.parent_pid)
    logging.basicConfig(level=logging.WARNING, format=f"pluginhost rank {spec.rank}: %(levelname)s: %(message)s")
    torch.set_num_threads(spec.num_threads)
    keep_freed_memory()  # a process of the engine's own
    os.environ[TIMEOUT_ENV] = str(spec.timeout_s)
    # tqdm's default lock is a multiprocessing semaphore, left registered when a rank is ended by a
    # signal ("leaked semaphore objects" at exit); a rank has no child process to share it with.
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    from pluginhost.engine.core import blame
    from pluginhost.engine.loader import load_model
    from pluginhost.host import PluginHost

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    try:
        store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size, timeout=timeout)
    except Exception:  # noqa: BLE001 - rank 0 reports that the ranks did not meet
        sys.exit(3)
    ranks = Ranks(spec.rank, spec.world_size, processes={}, control=None, timeout_s=spec.timeout_s, threads_before=None)
    ranks.control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
    distributed._set(spec.rank, spec.world_size)
    agreement = Agreement(ranks)
    try:
        host = PluginHost.from_replica_args(spec.host_args)
        loaded = load_model(host, spec.settings, agreement=agreement)
    except BaseException as exc:  # noqa: BLE001 - reported through the agreement, by rank 0
        if agreement.lost is not None:  # no agreement point left to report it at: log it, and tell rank 0
            error, told = agreement.lost
            logging.getLogger("pluginhost").error("%s", error)
            _tell(spec, told)
        agreement.abandon(exc)
        _leave(1)
    try:
        serve_steps(loaded, ranks)
    except BaseException as exc:  # noqa: BLE001 - rank 0 sees the collective fail and says which rank
        # Rank 0 gone took the collective with it: nothing to add. Its sockets close before this process is
        # handed to a new parent, so a collective failing may be seen first: give the parent a moment to go.
        lost = isinstance(exc, TensorParallelError) or _raised_in_a_collective(exc)  # serve_steps says "gone"
        if _parent_gone(spec.parent_pid, within=1.0 if lost else 0.0):
            _leave(1)
        logging.getLogger("pluginhost").error("rank %d failed in a step:\n%s", spec.rank, traceback.format_exc())
        if isinstance(exc, Exception) and not lost:  # its own fault: tell rank 0 why
            _tell(spec, _describe(blame(loaded, exc)))
        _leave(1)
    _leave(0)


def _tell(spec: RankSpec, reason: str) -> None:
    """Give rank 0 this rank's reason for failing, for the error it raises (best effort: it may be gone)."""
    try:
        spec.reasons.put((spec.rank, reason))
    except Exception:  # noqa: BLE001, S110 - rank 0 still names the rank and its exit status
        pass


def _leave(code: int) -> None:
    """End a spawned rank with ``code``: its process groups first, then through multiprocessing.

    A gloo group left to the interpreter's exit may abort the process with "terminate called without
    an active exception"; ``os._exit`` would leak multiprocessing's semaphores.
    """
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - best effort: the other ranks may be gone
        pass
    sys.exit(code)


def _parent_gone(parent_pid: int, *, within: float) -> bool:
    """Whether rank 0 (this process's parent) is gone, or goes within ``within`` seconds."""
    deadline = time.monotonic() + within
    while os.getppid() == parent_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def _exit_with(parent_pid: int) -> None:
    """End this process when its parent (rank 0) is gone, however it went."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="pluginhost-parent-watch", daemon=True).start()


class DistributedRunner(ModelRunner):
    """Rank 0's runner: each step goes to every rank, then runs here; a failure stops the engine."""

    def __init__(self, ranks: Ranks, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ranks = ranks
        if self.device.type == "cpu":  # every rank on this machine holds a cache like this one's
            self.memory_sharers = ranks.on_this_machine

    @property
    def stopped(self) -> TensorParallelError | None:
        """The error that stopped the ranks, noticed between steps too (a rank gone is found at once)."""
        if self.ranks.broken is None:
            try:
                self.ranks.check_alive()
            except TensorParallelError:
                pass  # recorded as ranks.broken
        return self.ranks.broken

    def run(self, inputs: StepInputs):  # noqa: ANN201 - a Tensor
        self.ranks.check_alive()
        try:
            self.ranks.send_step(inputs)
            return super().run(inputs)
        except BaseException as exc:
            if isinstance(exc, TensorParallelError):
                raise
            if isinstance(exc, KeyboardInterrupt):  # the others may be mid-collective: end them
                self.ranks.fail(
                    TensorParallelError(
                        "interrupted (Ctrl-C) in a step, which leaves the ranks out of step: the engine is stopped; "
                        "build a new one to go on"
                    )
                )
                raise
            if not _raised_in_a_collective(exc):  # this rank's model or plugin code: the engine names the culprit
                self.ranks.fail(
                    TensorParallelError(
                        f"rank 0 failed in a step ({type(exc).__name__}: {exc}), which leaves the ranks out of "
                        "step: the engine is stopped; build a new one to go on"
                    )
                )
                raise
            error = self.ranks.explain(exc, "running a step")
            raise self.ranks.fail(error) from exc


def _raised_in_a_collective(exc: BaseException) -> bool:
    """Whether ``exc`` came out of torch.distributed (a peer gone, a timeout), not the model's own code."""
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    return bool(frames) and "torch/distributed/" in frames[-1].f_code.co_filename.replace("\\", "/")
