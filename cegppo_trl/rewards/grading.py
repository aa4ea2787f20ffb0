"""The parent side of grading: a pool of worker processes with a hard per-task timeout, and what it remembers.

Each worker runs :mod:`.worker` by path in a fresh interpreter (``subprocess``: no ``multiprocessing`` start method
and no re-import of the training script). The worker's own timer ends a slow grade at about 0.8 x ``timeout_s``; if
it does not answer by ``timeout_s`` the parent SIGKILLs it, reaps it and starts a replacement. Pools are per process
(one per worker count, each with its :class:`GradingMemory`), started lazily, dropped in the child after ``fork`` and
killed at exit. The reasons for all of it are in docs/rewards_and_data.md, *Timeouts and worker processes*; why this
pool and not pebble (measured with ``benchmarks/bench_grader_pool.py``) is in its section *Own pool or pebble*.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from . import worker as worker_program
from .worker import BAD_GOLD, CORRECT, ERROR, GOLD_OK, TIMEOUT, UNPARSEABLE, WRONG


logger = logging.getLogger(__name__)

_WORKER_BOOT = (
    "import sys, runpy\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"  # never import modules from the caller's cwd
    "runpy.run_path(sys.argv[1], run_name='__cegppo_grader__')['_worker_main']()\n"
)
_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine can take many seconds
_PIPELINE_DEPTH = 4  # tasks queued per worker: hides the round trip, keeps load balanced

Task = tuple[str | None, str] | tuple[str, str, str]
"""``(answer or None, gold)``: ``None`` asks only whether the gold parses (status ``gold_ok``); or ``(completion,
gold, protocol)``: the whole completion graded with a named protocol (:mod:`.protocols`)."""


def worker_argv() -> list[str]:
    """The command that starts one grading worker (this interpreter running :mod:`.worker` by path)."""
    if not sys.executable:
        raise RuntimeError("math_reward needs sys.executable to start its grading workers, and it is empty.")
    return [sys.executable, "-c", _WORKER_BOOT, os.path.abspath(worker_program.__file__)]


# ----------------------------------------------------------------------------------------------------------------
# What the parent remembers of the workers' answers (bounded; one per pool)
# ----------------------------------------------------------------------------------------------------------------


class LRU:
    """A small thread-safe mapping that forgets its least recently used entry beyond ``maxsize``."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._data: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            if key not in self._data:
                return default
            self._data.move_to_end(key)
            return self._data[key]

    def __contains__(self, key: Any) -> bool:
        with self._lock:
            return key in self._data

    def __setitem__(self, key: Any, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            if len(self._data) > self.maxsize:
                self._data.popitem(last=False)

    def pop(self, key: Any, default: Any = None) -> Any:
        with self._lock:
            return self._data.pop(key, default)

    def __len__(self) -> int:
        return len(self._data)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()


class GradingMemory:
    """What a pool remembers of its workers' answers, so that later calls skip the round trip.

    ``gold_parses``: gold -> whether it parses (saves gold-only checks and settles bad golds); ``verdicts``:
    ``(answer, gold)`` -> a worker's verdict (eval sets repeat every epoch); ``gold_timeouts``: gold -> grading calls
    on which its parse hit the soft timeout (a slow gold is retried a bounded number of times, then settled as bad).
    """

    def __init__(self) -> None:
        self.gold_parses = LRU(200_000)
        self.verdicts = LRU(100_000)
        self.gold_timeouts = LRU(10_000)

    def gold_is_bad(self, gold: str) -> bool:
        return self.gold_parses.get(gold) is False

    def gold_is_known(self, gold: str) -> bool:
        """Whether a worker has said if ``gold`` parses (either way)."""
        return gold in self.gold_parses

    def verdict(self, answer: str, gold: str) -> str | None:
        return self.verdicts.get((answer, gold))

    def learn(self, task: Task, status: str) -> None:
        """Remember what a worker's reply to ``task`` says about its gold, and its verdict if it has one."""
        answer, gold = task
        if status == BAD_GOLD:
            self.gold_parses[gold] = False
        elif status in (CORRECT, WRONG, UNPARSEABLE, GOLD_OK):
            self.gold_parses[gold] = True
            if answer is not None and len(answer) + len(gold) <= 256:  # bounded memory per entry
                self.verdicts[(answer, gold)] = status

    def count_gold_timeout(self, gold: str, limit: int) -> int:
        """Count one more call on which parsing ``gold`` timed out; at ``limit`` the gold is settled as bad."""
        count = self.gold_timeouts.get(gold, 0) + 1
        self.gold_timeouts[gold] = count
        if count >= limit:
            self.gold_parses[gold] = False  # settled: later calls skip it without a worker round trip
            self.gold_timeouts.pop(gold)
        return count

    def clear(self) -> None:
        for cache in (self.gold_parses, self.verdicts, self.gold_timeouts):
            cache.clear()


# ----------------------------------------------------------------------------------------------------------------
# One worker process and its pipes
# ----------------------------------------------------------------------------------------------------------------


class Worker:
    """One grading process: non-blocking pipes, the ids of the tasks it holds (oldest first) and their timing."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            close_fds=True,
            bufsize=0,
        )
        self.rfd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        self.wfd = self.proc.stdin.fileno()  # type: ignore[union-attr]
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)
        self.rbuf = b""
        self.wbuf = b""
        self.queue: deque[int] = deque()
        self.ready = False
        self.started = time.monotonic()
        self.busy_since = 0.0

    def send(self, task_id: int, task: Task, soft_timeout: float, now: float) -> None:
        """Queue a task line for writing; a worker that was idle starts its clock now."""
        if not self.queue:
            self.busy_since = now
        self.queue.append(task_id)
        answer, gold, *protocol = task
        self.wbuf += (json.dumps([task_id, answer, gold, soft_timeout, *protocol]) + "\n").encode()

    def flush(self, event: int) -> bool:
        """Write what the pipe takes of the queued lines; ``False`` if the worker's stdin is gone."""
        if event & select.POLLOUT and self.wbuf:
            try:
                written = os.write(self.wfd, self.wbuf)
                self.wbuf = self.wbuf[written:]
            except BlockingIOError:
                pass
            except OSError:
                return False
            return True
        return not event & (select.POLLERR | select.POLLHUP)

    def read_lines(self) -> tuple[list[bytes], bool]:
        """The complete lines the worker has written since the last call, and whether its stdout reached EOF."""
        chunks = []
        eof = False
        while True:
            try:
                chunk = os.read(self.rfd, 65536)
            except BlockingIOError:
                break
            except OSError:
                eof = True
                break
            if not chunk:
                eof = True
                break
            chunks.append(chunk)
        *lines, self.rbuf = (self.rbuf + b"".join(chunks)).split(b"\n")
        return lines, eof

    def kill(self) -> None:
        """SIGKILL and reap (no zombie), then close our pipe ends."""
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - process stuck in the kernel
            logger.warning("grading worker %d did not exit after SIGKILL", self.proc.pid)
        self.close_pipes()

    def close_pipes(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()  # type: ignore[union-attr]
            except OSError:
                pass


# ----------------------------------------------------------------------------------------------------------------
# The pool
# ----------------------------------------------------------------------------------------------------------------


class _Batch:
    """The state of one ``GraderPool.grade`` call: the tasks, their results, and the ids not yet sent."""

    def __init__(self, tasks: Sequence[Task], timeout_s: float) -> None:
        self.tasks = tasks
        self.timeout_s = timeout_s
        # The worker's own timer fires first so the slow task ends cleanly; SIGKILL is the backstop at timeout_s.
        self.soft_timeout = max(0.05, timeout_s - min(0.5, 0.25 * timeout_s))
        self.results: list[tuple[str, float] | None] = [None] * len(tasks)
        self.pending = deque(range(len(tasks)))
        self.remaining = len(tasks)
        self.crashed: set[int] = set()  # tasks whose worker died once already

    def finish(self, task_id: int, status: str, seconds: float) -> None:
        if self.results[task_id] is None:
            self.results[task_id] = (status, seconds)
            self.remaining -= 1

    def requeue(self, w: Worker, status: str, now: float) -> None:
        """Settle the task ``w`` was running with ``status`` and put its queued tasks back at the front of the line.

        A worker that died on its own (``error``) may have died before starting its task (e.g. killed while idle),
        so the task gets one more try; a task that crashes two workers is reported as ``error``.
        """
        if not w.queue:
            return
        head = w.queue.popleft()
        if status == ERROR and head not in self.crashed:
            self.crashed.add(head)
            w.queue.appendleft(head)
        else:
            self.finish(head, status, now - w.busy_since)
        self.pending.extendleft(reversed(w.queue))


class GraderPool:
    """A fixed number of grading worker processes owned by one process; ``grade`` is serialised by a lock.

    ``memory`` is what the callers learned from this pool's answers (see :class:`GradingMemory`).
    """

    def __init__(self, size: int, argv: Sequence[str] | None = None) -> None:
        self.size = size
        self.argv = list(argv) if argv is not None else None  # tests substitute a fake worker
        self.workers: list[Worker] = []
        self.lock = threading.Lock()
        self.failed_starts = 0
        self.memory = GradingMemory()

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def grade(self, tasks: Sequence[Task], timeout_s: float) -> list[tuple[str, float]]:
        """Grade ``(answer or None, gold)`` pairs; each task gets at most ``timeout_s`` seconds of a worker."""
        with self.lock:
            try:
                return self._run(_Batch(tasks, timeout_s))
            except BaseException:
                # Interrupted mid-batch: workers still holding tasks would reply later and confuse the next call.
                for w in [w for w in self.workers if w.queue]:
                    w.kill()
                    self.workers.remove(w)
                raise

    def close(self) -> None:
        """Kill and reap every worker (they hold no state worth a graceful exit)."""
        workers, self.workers = self.workers, []
        for w in workers:
            w.kill()

    def _run(self, batch: _Batch) -> list[tuple[str, float]]:
        while len(self.workers) < self.size:
            self._start_worker()
        while batch.remaining:
            self._dispatch(batch)
            dead = self._handle_events(self._wait(batch), batch)
            now = time.monotonic()
            for w in dead:
                self._retire(w, ERROR, now, batch)
            self._enforce_deadlines(batch, now)
        return batch.results  # type: ignore[return-value]

    def _start_worker(self) -> None:
        self.workers.append(Worker(self.argv or worker_argv()))

    def _dispatch(self, batch: _Batch) -> None:
        """Fill each ready worker's queue up to the pipeline depth."""
        now = time.monotonic()
        for w in self.workers:
            while w.ready and batch.pending and len(w.queue) < _PIPELINE_DEPTH:
                task_id = batch.pending.popleft()
                w.send(task_id, batch.tasks[task_id], batch.soft_timeout, now)

    def _wait(self, batch: _Batch) -> list[tuple[Worker, int, int]]:
        """Block until a pipe is ready or the nearest deadline (at most 1 s); ``(worker, fd, event)`` per event."""
        poller = select.poll()  # poll, not select: fds above 1024 are common in training processes
        by_fd: dict[int, Worker] = {}
        now = time.monotonic()
        next_deadline = now + 1.0
        for w in self.workers:
            poller.register(w.rfd, select.POLLIN)
            by_fd[w.rfd] = w
            if w.wbuf:
                poller.register(w.wfd, select.POLLOUT)
                by_fd[w.wfd] = w
            if w.queue:
                next_deadline = min(next_deadline, w.busy_since + batch.timeout_s)
            elif not w.ready:
                next_deadline = min(next_deadline, w.started + _STARTUP_TIMEOUT_S)
        try:
            events = poller.poll(max(0, math.ceil((next_deadline - now) * 1000)))
        except InterruptedError:  # pragma: no cover - PEP 475 retries, but be safe
            events = []
        return [(by_fd[fd], fd, event) for fd, event in events]

    def _handle_events(self, events: list[tuple[Worker, int, int]], batch: _Batch) -> list[Worker]:
        """Write queued lines and read replies; the workers found dead (pipe closed, EOF, garbage)."""
        dead: list[Worker] = []
        for w, fd, event in events:
            if w in dead:
                continue
            alive = w.flush(event) if fd == w.wfd else self._read_replies(w, batch)
            if not alive:
                dead.append(w)
        return dead

    def _read_replies(self, w: Worker, batch: _Batch) -> bool:
        """Apply ``w``'s replies (``ready`` or a task's result); ``False`` if ``w`` hit EOF or wrote garbage."""
        lines, eof = w.read_lines()
        received = time.monotonic()
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:  # never expected (stdout is private to the protocol); treat as a crash
                return False
            if message[0] == "ready":
                w.ready = True
                self.failed_starts = 0
                continue
            task_id, status, seconds = message
            if w.queue and w.queue[0] == task_id:
                w.queue.popleft()
                batch.finish(task_id, status, seconds)
                w.busy_since = received  # the next queued task starts now
        return not eof

    def _enforce_deadlines(self, batch: _Batch, now: float) -> None:
        """Kill a worker over its task's hard timeout (the task: ``timeout``) or over the start-up bound."""
        for w in list(self.workers):
            if w.queue and now - w.busy_since >= batch.timeout_s:
                self._retire(w, TIMEOUT, now, batch)
            elif not w.ready and now - w.started > _STARTUP_TIMEOUT_S:
                self._retire(w, ERROR, now, batch)

    def _retire(self, w: Worker, status: str, now: float, batch: _Batch) -> None:
        """Kill ``w``, settle or requeue its tasks, and start a replacement (unless workers keep dying at start-up)."""
        w.kill()
        self.workers.remove(w)
        batch.requeue(w, status, now)
        if not w.ready:
            self.failed_starts += 1
            if self.failed_starts >= 3 * self.size:
                raise RuntimeError(
                    f"math_reward: {self.failed_starts} grading workers exited during startup (see their error "
                    f"on stderr above). Check that `{sys.executable} -c 'import math_verify'` works."
                )
        self._start_worker()


# ----------------------------------------------------------------------------------------------------------------
# The pools of this process
# ----------------------------------------------------------------------------------------------------------------


def default_num_workers() -> int:
    """CPUs available to this process divided among the local ranks of a torchrun/accelerate job (max 8)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # set by torchrun and accelerate
    except ValueError:
        local_ranks = 1
    return max(1, min(8, cpus // local_ranks))


class _ProcessPools:
    """This process's pools, one per worker count; closed at exit, dropped (not killed) in a forked child."""

    def __init__(self) -> None:
        self.pools: dict[int, GraderPool] = {}
        self.lock = threading.Lock()

    def get(self, size: int) -> GraderPool:
        with self.lock:
            pool = self.pools.get(size)
            if pool is None:
                pool = self.pools[size] = GraderPool(size)
            return pool

    def all(self) -> list[GraderPool]:
        with self.lock:
            return list(self.pools.values())

    def close_all(self) -> None:
        """Kill every worker; the pools (and what they remember) stay, and restart workers on the next call."""
        for pool in self.all():
            with pool.lock:
                pool.close()

    def forget_in_child(self) -> None:
        """After fork, the child must not use or kill the parent's workers: drop its copies of their pipes."""
        for pool in self.pools.values():
            for w in pool.workers:
                w.close_pipes()
                w.proc.returncode = 0  # keeps Popen.__del__ from touching the parent's child
        self.pools = {}
        self.lock = threading.Lock()


_PROCESS_POOLS = _ProcessPools()


def pool_for(num_workers: int) -> GraderPool:
    """This process's pool of ``num_workers`` grading workers (created on first use; workers start on first grade)."""
    return _PROCESS_POOLS.get(num_workers)


def worker_pids() -> list[int]:
    """The pids of this process's grading workers, all pools."""
    return [pid for pool in _PROCESS_POOLS.all() for pid in pool.worker_pids()]


def shutdown_grading_workers() -> None:
    """Stop and reap all grading worker processes of this process. They restart on the next grading call.

    Called automatically at interpreter exit; call it yourself to free the processes earlier.
    """
    _PROCESS_POOLS.close_all()


atexit.register(shutdown_grading_workers)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_PROCESS_POOLS.forget_in_child)
