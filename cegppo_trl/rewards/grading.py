"""The parent side of grading: a pool of worker processes with a hard per-task timeout, and what it remembers.

Each worker runs :mod:`.worker` by path in a fresh interpreter. The worker's own timer ends a slow grade at about
0.8 x ``timeout_s``; a worker that has not answered by ``timeout_s`` is SIGKILLed, reaped and replaced. Pools are per
process and per worker count, started lazily, dropped in the child after ``fork`` and killed at exit. Why, and why
not pebble: docs/rewards_and_data.md, *Timeouts and worker processes* and *Own pool or pebble*.
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

from . import worker
from .worker import BAD_GOLD, CORRECT, ERROR, GOLD_OK, TIMEOUT, UNPARSEABLE, WRONG


logger = logging.getLogger(__name__)

_WORKER_BOOT = (
    "import sys, runpy\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"  # never import modules from the caller's cwd
    "runpy.run_path(sys.argv[1], run_name='__cegppo_grader__')['_worker_main']()\n"
)
_WORKER_FILE = os.path.abspath(worker.__file__)
_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine can take many seconds
_PIPELINE_DEPTH = 4  # tasks queued per worker: hides the round trip, keeps load balanced

Task = tuple[str | None, str] | tuple[str, str, str]
"""``(answer or None, gold)``: ``None`` asks only whether the gold parses (status ``gold_ok``); or ``(completion,
gold, protocol)``: the whole completion graded with a named protocol (:mod:`.protocols`)."""


# ----------------------------------------------------------------------------------------------------------------
# What the parent remembers of the workers' answers (bounded; one per pool)
# ----------------------------------------------------------------------------------------------------------------


class LRU(OrderedDict):
    """An ``OrderedDict`` that forgets its least recently used entry beyond ``maxsize`` (thread-safe get and set)."""

    def __init__(self, maxsize: int) -> None:
        super().__init__()
        self.maxsize = maxsize
        self.lock = threading.Lock()

    def get(self, key: Any, default: Any = None) -> Any:
        with self.lock:
            if key not in self:
                return default
            self.move_to_end(key)
            return self[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        with self.lock:
            super().__setitem__(key, value)
            self.move_to_end(key)
            if len(self) > self.maxsize:
                self.popitem(last=False)


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


# ----------------------------------------------------------------------------------------------------------------
# One worker process and its pipes
# ----------------------------------------------------------------------------------------------------------------


class Worker:
    """One grading process: non-blocking pipes, the ids of the tasks it holds (oldest first) and their timing."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
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
        chunks, eof = [], False
        while True:
            try:
                chunk = os.read(self.rfd, 65536)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
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
            dead: list[Worker] = []  # pipe closed, EOF or garbage
            for w, fd, event in self._wait(batch):
                if w not in dead and not (w.flush(event) if fd == w.wfd else self._read_replies(w, batch)):
                    dead.append(w)
            now = time.monotonic()
            for w in dead:
                self._retire(w, ERROR, now, batch)
            self._enforce_deadlines(batch, now)
        return batch.results  # type: ignore[return-value]

    def _start_worker(self) -> None:
        if not sys.executable:
            raise RuntimeError("math_reward needs sys.executable to start its grading workers, and it is empty.")
        self.workers.append(Worker(self.argv or [sys.executable, "-c", _WORKER_BOOT, _WORKER_FILE]))

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
        events = poller.poll(max(0, math.ceil((next_deadline - now) * 1000)))
        return [(by_fd[fd], fd, event) for fd, event in events]

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


_POOLS: dict[int, GraderPool] = {}  # this process's pools, by worker count
_POOLS_LOCK = threading.Lock()


def pool_for(num_workers: int) -> GraderPool:
    """This process's pool of ``num_workers`` grading workers (created on first use; workers start on first grade)."""
    with _POOLS_LOCK:
        return _POOLS.setdefault(num_workers, GraderPool(num_workers))


def worker_pids() -> list[int]:
    """The pids of this process's grading workers, all pools."""
    return [pid for pool in list(_POOLS.values()) for pid in pool.worker_pids()]


def shutdown_grading_workers() -> None:
    """Stop and reap all grading worker processes of this process. They restart on the next grading call.

    Called automatically at interpreter exit; call it yourself to free the processes earlier.
    """
    for pool in list(_POOLS.values()):  # the pools (and what they remember) stay
        with pool.lock:
            pool.close()


def _forget_in_child() -> None:
    """After fork, the child must not use or kill the parent's workers: drop its copies of their pipes."""
    global _POOLS_LOCK
    for pool in _POOLS.values():
        for w in pool.workers:
            w.close_pipes()
            w.proc.returncode = 0  # keeps Popen.__del__ from touching the parent's child
    _POOLS.clear()
    _POOLS_LOCK = threading.Lock()


atexit.register(shutdown_grading_workers)
os.register_at_fork(after_in_child=_forget_in_child)
