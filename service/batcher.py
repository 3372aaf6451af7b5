"""The device worker and the dynamic batcher.

All compute runs on one worker thread per process (the device's), off the event loop. Jobs
wait in one queue; the dispatcher takes whatever has arrived (waiting `max_wait_ms` for more
after the first, while requests have lately been arriving together), merges jobs with the same
batch key (attention on the same context version with the same parameters) into one call of at
most `max_queries` queries, runs the calls one after another on the worker, and hands each job
its slice of the result. While a call runs, new jobs queue up and merge into the next one, so
batches grow with load. A lone client's requests (a decode loop asking one layer at a time)
find nothing to merge: once the recent dispatches have found one job each, the wait is skipped
and a request starts at once (it cost every such request `max_wait_ms`); the first dispatch
that finds several jobs brings the wait back.

Admission is bounded twice, so that a burst is answered at once rather than queued for tens of
seconds:
- by count: with `queue_size` jobs waiting or running, `submit` raises `Overloaded` at once;
- by time: a job that has not started within `max_queue_wait_s` is withdrawn from the queue
  and `submit` raises `Overloaded` (it never runs later; a job that has started is always
  finished).
The routes answer both with 429 and `Retry-After`. Each job records its queue wait and its
compute time (`Job.queue_seconds`, `Job.compute_seconds`; metrics and the `Server-Timing`
header).

Background jobs (`background`: the index builds a commit starts) run only when no request is
waiting, one at a time, so that they never delay a request already queued; they are no client's,
so neither bound applies to them and they do not count as waiting (a request that arrives while
one runs waits for it). A background job with the `replaces` of one still waiting replaces it:
with a commit per decoded token, only the newest version's build is worth running."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

RETRY_AFTER_MAX_S = 60
# Below this share of recent dispatches that found several jobs, the dispatcher stops waiting
# for more (0.8^14 < 0.05: after 14 dispatches of one job each).
TOGETHER_FLOOR = 0.05


class Overloaded(Exception):
    """The job was refused (queue full) or withdrawn (not started in time); `retry_after` is
    the whole number of seconds after which the queue is expected to have room."""

    def __init__(self, reason: str, retry_after: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after = retry_after


@dataclass
class Job:
    """`run(batch)` computes the result of a list of jobs sharing `key` (None: never merged);
    it returns one dict of tensors with the job axis at dimension `split_dim`, split by
    `size`, or (for an unmerged job) any result."""

    key: Hashable | None
    payload: Any
    size: int
    run: Callable[[list[Job]], Any]
    split_dim: int = 1
    future: asyncio.Future = field(default=None)  # type: ignore[assignment]
    queued_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    background: bool = False  # run by `Batcher.background`
    replaces: Hashable | None = None  # a waiting background job with the same value is dropped

    @property
    def queue_seconds(self) -> float:
        """Time between submission and the start of its device call (so far, if waiting)."""
        end = self.started_at if self.started_at is not None else time.perf_counter()
        return end - self.queued_at

    @property
    def compute_seconds(self) -> float:
        """Time of the device call that computed it (0 before it finished)."""
        if self.started_at is None or self.finished_at is None:
            return 0.0
        return self.finished_at - self.started_at


class Batcher:
    def __init__(
        self,
        *,
        batching: bool,
        max_queries: int,
        max_wait_ms: float,
        queue_size: int,
        max_queue_wait_s: float = math.inf,
        metrics=None,
    ) -> None:
        self.batching = batching
        self.max_queries = max_queries
        self.max_wait = max_wait_ms / 1000
        self.queue_size = queue_size
        self.max_queue_wait_s = max_queue_wait_s
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewa-device")
        self._queue: asyncio.Queue[Job | None] | None = None  # None: a background job waits
        self._background: deque[Job] = deque()
        self._task: asyncio.Task | None = None
        self.waiting = 0
        self.running = 0
        self._call_seconds = 0.0  # moving average of one device call
        # Moving average of whether a dispatch found more than one job (module docstring).
        self._together = 1.0

    @property
    def gathering(self) -> bool:
        """Whether the dispatcher waits `max_wait_ms` for more jobs after the first."""
        return self.batching and self.max_wait > 0 and self._together > TOGETHER_FLOOR

    @property
    def pending(self) -> int:
        """Jobs waiting or running."""
        return self.waiting + self.running

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._dispatch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.executor.shutdown(wait=True)

    async def background(self, job: Job) -> Any:
        """Run `job` when no request is waiting (module docstring); its result, or None when a
        later background job with the same `replaces` replaced it before it started."""
        if self._queue is None:
            raise RuntimeError("Batcher.start() was not awaited")
        job.future = asyncio.get_running_loop().create_future()
        job.queued_at = time.perf_counter()
        job.background = True
        if job.replaces is not None:
            for replaced in [w for w in self._background if w.replaces == job.replaces]:
                self._background.remove(replaced)
                if not replaced.future.done():
                    replaced.future.set_result(None)
        self._background.append(job)
        self._queue.put_nowait(None)  # wakes the dispatcher
        try:
            return await job.future
        finally:
            if not job.future.done():  # cancelled before it ran
                job.future.cancel()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` alone on the worker (admission-bounded like every job)."""
        return await self.submit(Job(key=None, payload=None, size=1, run=lambda _: fn()))

    def retry_after(self) -> int:
        """Seconds until the jobs now waiting are expected to have run (at least 1)."""
        expected = self._call_seconds * (self.waiting + 1)
        return int(min(max(1, math.ceil(expected)), RETRY_AFTER_MAX_S))

    async def submit(self, job: Job) -> Any:
        if self._queue is None:
            raise RuntimeError("Batcher.start() was not awaited")
        if self.pending >= self.queue_size:
            self._refuse("queue_full")
        job.future = asyncio.get_running_loop().create_future()
        job.queued_at = time.perf_counter()
        self.waiting += 1
        self._gauge()
        self._queue.put_nowait(job)
        bound = None if math.isinf(self.max_queue_wait_s) else self.max_queue_wait_s
        try:
            try:
                return await asyncio.wait_for(asyncio.shield(job.future), bound)
            except TimeoutError:
                if job.started_at is not None:  # started in time: finish it
                    return await job.future
                self._refuse("wait_timeout")
        finally:
            if job.started_at is None:  # withdrawn, cancelled by its client, or failed to run
                self.waiting -= 1
                self._gauge()
                if not job.future.done():
                    job.future.cancel()  # the dispatcher skips it

    def _refuse(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(reason).inc()
        raise Overloaded(reason, self.retry_after())

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.pending)
            self.metrics.jobs_waiting.set(self.waiting)
            self.metrics.jobs_running.set(self.running)

    async def _dispatch(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            first = await self._queue.get()
            jobs = [] if first is None else [first]
            if jobs and self.gathering:
                await asyncio.sleep(self.max_wait)
            while not self._queue.empty():
                job = self._queue.get_nowait()
                if job is not None:
                    jobs.append(job)
            if jobs:
                self._together = 0.8 * self._together + 0.2 * (len(jobs) > 1)
            for batch in self._batches(jobs):
                batch = [job for job in batch if not job.future.done()]  # withdrawn or cancelled
                if not batch:
                    continue
                await self._run(loop, batch)
            while self._background and self._queue.empty():
                job = self._background.popleft()
                if not job.future.done():
                    await self._run(loop, [job])

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[Job]) -> None:
        started = time.perf_counter()
        for job in batch:
            job.started_at = started
        # Background jobs are no client's: they count towards neither bound (module docstring).
        requests = sum(not job.background for job in batch)
        self.waiting -= requests
        self.running += requests
        self._gauge()
        try:
            result = await loop.run_in_executor(self.executor, batch[0].run, batch)
        except Exception as error:  # the jobs' own failure, reported to each of them
            self._finished(batch, started)
            for job in batch:
                if not job.future.done():
                    job.future.set_exception(error)
            return
        self._finished(batch, started)
        self._deliver(batch, result)

    def _finished(self, batch: list[Job], started: float) -> None:
        """Times and counts of a device call that has returned."""
        finished = time.perf_counter()
        self.running -= sum(not job.background for job in batch)
        self._gauge()
        self._call_seconds = 0.8 * self._call_seconds + 0.2 * (finished - started)
        for job in batch:
            job.finished_at = finished
            if self.metrics is not None and not job.background:
                self.metrics.queue_wait.observe(job.queue_seconds)
                self.metrics.compute.observe(job.compute_seconds)

    def _batches(self, jobs: list[Job]) -> list[list[Job]]:
        """Jobs in arrival order, merged per key up to `max_queries` when batching."""
        if not self.batching:
            return [[job] for job in jobs]
        batches: list[list[Job]] = []
        open_batches: dict[Hashable, list[Job]] = {}
        for job in jobs:
            current = open_batches.get(job.key) if job.key is not None else None
            if current is not None and sum(j.size for j in current) + job.size <= self.max_queries:
                current.append(job)
                continue
            current = [job]
            batches.append(current)
            if job.key is not None:
                open_batches[job.key] = current
        return batches

    def _deliver(self, batch: list[Job], result: Any) -> None:
        if self.metrics is not None:
            self.metrics.batch_requests.observe(len(batch))
            self.metrics.batch_queries.observe(sum(job.size for job in batch))
        if len(batch) == 1 and batch[0].key is None:
            if not batch[0].future.done():
                batch[0].future.set_result(result)
            return
        offset = 0
        for job in batch:
            width = job.payload.shape[job.split_dim]
            part = {
                name: tensor.narrow(job.split_dim, offset, width) for name, tensor in result.items()
            }
            offset += width
            if not job.future.done():
                job.future.set_result(part)


def merged_payload(batch: list[Job]) -> torch.Tensor:
    """The queries of a batch, concatenated along the job axis."""
    return torch.cat([job.payload for job in batch], dim=batch[0].split_dim)
