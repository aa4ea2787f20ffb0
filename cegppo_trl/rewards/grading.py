"""The parent side of grading: a pool of worker processes with a hard per-task timeout, and what it remembers.

Each worker runs :mod:`.worker` by path in a fresh interpreter (``subprocess``: no ``multiprocessing`` start method
and no re-import of the training script). The worker's own timer ends a slow grade at about 0.8 x ``timeout_s``; if
it does not answer by ``timeout_s`` the parent SIGKILLs it, reaps it and starts a replacement. Pools are per process
(one per worker count), started lazily, dropped in the child after ``fork`` and killed at exit. The reasons for all
of it are in docs/rewards_and_data.md, *Timeouts and worker processes*; why this pool and not pebble (measured with
``benchmarks/bench_grader_pool.py``) is in its section *Own pool or pebble*.
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

from . import worker as _worker_module
from .worker import ERROR, TIMEOUT


logger = logging.getLogger(__name__)

_WORKER_BOOT = (
    "import sys, runpy\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"  # never import modules from the caller's cwd
    "runpy.run_path(sys.argv[1], run_name='__cegppo_grader__')['_worker_main']()\n"
)
_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded 2-core machine can take many seconds
_PIPELINE_DEPTH = 4  # tasks queued per worker: hides the round trip, keeps load balanced


def _worker_argv() -> list[str]:
    if not sys.executable:
        raise RuntimeError("math_reward needs sys.executable to start its grading workers, and it is empty.")
    return [sys.executable, "-c", _WORKER_BOOT, os.path.abspath(_worker_module.__file__)]


class _Worker:
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


class _GraderPool:
    """A fixed number of grading worker processes owned by one process; ``grade`` is serialised by a lock."""

    def __init__(self, size: int, argv: Sequence[str] | None = None) -> None:
        self.size = size
        self.argv = list(argv) if argv is not None else _worker_argv()  # tests substitute a fake worker
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()
        self.failed_starts = 0

    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def grade(self, tasks: Sequence[tuple[str | None, str]], timeout_s: float) -> list[tuple[str, float]]:
        """Grade ``(answer or None, gold)`` pairs; each task gets at most ``timeout_s`` seconds of a worker."""
        with self.lock:
            try:
                return self._grade(tasks, timeout_s)
            except BaseException:
                # Interrupted mid-batch: workers still holding tasks would reply later and confuse the next call.
                for w in [w for w in self.workers if w.queue]:
                    w.kill()
                    self.workers.remove(w)
                raise

    def _grade(self, tasks: Sequence[tuple[str | None, str]], timeout_s: float) -> list[tuple[str, float]]:
        results: list[tuple[str, float] | None] = [None] * len(tasks)
        pending = deque(range(len(tasks)))
        remaining = len(tasks)
        # The worker's own timer fires first so the slow task ends cleanly; SIGKILL is the backstop at timeout_s.
        soft = max(0.05, timeout_s - min(0.5, 0.25 * timeout_s))
        while len(self.workers) < self.size:
            self.workers.append(_Worker(self.argv))

        def finish(i: int, status: str, seconds: float) -> None:
            nonlocal remaining
            if results[i] is None:
                results[i] = (status, seconds)
                remaining -= 1

        crashed: set[int] = set()

        def retire(w: _Worker, status: str, now: float) -> None:
            """Kill ``w``; its current task gets ``status``, its queued tasks go back to the front of the line.

            A worker that died on its own (``error``) may have died before starting its task (e.g. killed while
            idle), so the task gets one more try; a task that crashes two workers is reported as ``error``.
            """
            w.kill()
            self.workers.remove(w)
            if w.queue:
                head = w.queue.popleft()
                if status == ERROR and head not in crashed:
                    crashed.add(head)
                    w.queue.appendleft(head)
                else:
                    finish(head, status, now - w.busy_since)
                pending.extendleft(reversed(w.queue))
            if not w.ready:
                self.failed_starts += 1
                if self.failed_starts >= 3 * self.size:
                    raise RuntimeError(
                        f"math_reward: {self.failed_starts} grading workers exited during startup (see their error "
                        f"on stderr above). Check that `{sys.executable} -c 'import math_verify'` works."
                    )
            self.workers.append(_Worker(self.argv))

        while remaining:
            now = time.monotonic()
            for w in self.workers:
                while w.ready and pending and len(w.queue) < _PIPELINE_DEPTH:
                    i = pending.popleft()
                    if not w.queue:
                        w.busy_since = now
                    w.queue.append(i)
                    answer, gold = tasks[i]
                    w.wbuf += (json.dumps([i, answer, gold, soft]) + "\n").encode()

            poller = select.poll()  # poll, not select: fds above 1024 are common in training processes
            by_fd: dict[int, _Worker] = {}
            next_deadline = now + 1.0
            for w in self.workers:
                poller.register(w.rfd, select.POLLIN)
                by_fd[w.rfd] = w
                if w.wbuf:
                    poller.register(w.wfd, select.POLLOUT)
                    by_fd[w.wfd] = w
                if w.queue:
                    next_deadline = min(next_deadline, w.busy_since + timeout_s)
                elif not w.ready:
                    next_deadline = min(next_deadline, w.started + _STARTUP_TIMEOUT_S)
            wait_ms = max(0, math.ceil((next_deadline - now) * 1000))
            try:
                events = poller.poll(wait_ms)
            except InterruptedError:  # pragma: no cover - PEP 475 retries, but be safe
                events = []

            dead: list[_Worker] = []
            for fd, event in events:
                w = by_fd[fd]
                if w in dead:
                    continue
                if fd == w.wfd:
                    if event & select.POLLOUT and w.wbuf:
                        try:
                            written = os.write(w.wfd, w.wbuf)
                            w.wbuf = w.wbuf[written:]
                        except BlockingIOError:
                            pass
                        except OSError:
                            dead.append(w)
                    elif event & (select.POLLERR | select.POLLHUP):
                        dead.append(w)
                    continue
                chunks = []
                eof = False
                while True:
                    try:
                        chunk = os.read(w.rfd, 65536)
                    except BlockingIOError:
                        break
                    except OSError:
                        eof = True
                        break
                    if not chunk:
                        eof = True
                        break
                    chunks.append(chunk)
                w.rbuf += b"".join(chunks)
                *lines, w.rbuf = w.rbuf.split(b"\n")
                received = time.monotonic()
                for line in lines:
                    try:
                        message = json.loads(line)
                    except ValueError:  # never expected (stdout is private to the protocol); treat as a crash
                        eof = True
                        break
                    if message[0] == "ready":
                        w.ready = True
                        self.failed_starts = 0
                        continue
                    task_id, status, seconds = message
                    if w.queue and w.queue[0] == task_id:
                        w.queue.popleft()
                        finish(task_id, status, seconds)
                        w.busy_since = received  # the next queued task starts now
                if eof:
                    dead.append(w)

            now = time.monotonic()
            for w in dead:
                retire(w, ERROR, now)
            for w in list(self.workers):
                if w.queue and now - w.busy_since >= timeout_s:
                    retire(w, TIMEOUT, now)
                elif not w.ready and now - w.started > _STARTUP_TIMEOUT_S:
                    retire(w, ERROR, now)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Kill and reap every worker (they hold no state worth a graceful exit)."""
        workers, self.workers = self.workers, []
        for w in workers:
            w.kill()


_POOLS: dict[int, _GraderPool] = {}
_POOLS_LOCK = threading.Lock()


def _default_num_workers() -> int:
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


def _get_pool(num_workers: int) -> _GraderPool:
    with _POOLS_LOCK:
        pool = _POOLS.get(num_workers)
        if pool is None:
            pool = _POOLS[num_workers] = _GraderPool(num_workers)
        return pool


def shutdown_grading_workers() -> None:
    """Stop and reap all grading worker processes of this process. They restart on the next grading call.

    Called automatically at interpreter exit; call it yourself to free the processes earlier.
    """
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        with pool.lock:
            pool.close()


# ----------------------------------------------------------------------------------------------------------------
# What the parent remembers of the workers' answers (bounded; used by grade_completions)
# ----------------------------------------------------------------------------------------------------------------


class _LRU:
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


_GOLD_STATUS = _LRU(200_000)  # gold string -> parses (learned from workers; saves gold-only checks)
_VERDICTS = _LRU(100_000)  # (answer, gold) -> verdict of a worker; eval sets repeat every epoch
_GOLD_TIMEOUTS = _LRU(10_000)  # gold string -> grading calls on which its parse hit the soft timeout


def _forget_pools_in_child() -> None:
    """After fork, the child must not use or kill the parent's workers: drop its copies of their pipes."""
    for pool in _POOLS.values():
        for w in pool.workers:
            w.close_pipes()
            w.proc.returncode = 0  # keeps Popen.__del__ from touching the parent's child
    _POOLS.clear()
    global _POOLS_LOCK
    _POOLS_LOCK = threading.Lock()
    _GOLD_STATUS.clear()
    _GOLD_TIMEOUTS.clear()


atexit.register(shutdown_grading_workers)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_child)
