"""The device worker and the dynamic batcher.

All compute runs on one worker thread per process (the device's), off the event loop. Jobs
wait in one queue; the dispatcher takes whatever has arrived (waiting `max_wait_ms` for more
after the first), merges jobs with the same batch key (attention on the same context version
with the same parameters) into one call of at most `max_queries` queries, runs the calls one
after another on the worker, and hands each job its slice of the result. While a call runs,
new jobs queue up and merge into the next one, so batches grow with load.

Admission is bounded: with `queue_size` jobs queued or running, `submit` raises `Overloaded`
(the routes answer 429 with Retry-After)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch


class Overloaded(Exception):
    """The queue is full."""


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


class Batcher:
    def __init__(
        self,
        *,
        batching: bool,
        max_queries: int,
        max_wait_ms: float,
        queue_size: int,
        metrics=None,
    ) -> None:
        self.batching = batching
        self.max_queries = max_queries
        self.max_wait = max_wait_ms / 1000
        self.queue_size = queue_size
        self.metrics = metrics
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rewa-device")
        self._queue: asyncio.Queue[Job] | None = None
        self._task: asyncio.Task | None = None
        self.pending = 0

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(self._dispatch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.executor.shutdown(wait=True)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` alone on the worker (admission-bounded like every job)."""
        return await self.submit(Job(key=None, payload=None, size=1, run=lambda _: fn()))

    async def submit(self, job: Job) -> Any:
        if self._queue is None:
            raise RuntimeError("Batcher.start() was not awaited")
        if self.pending >= self.queue_size:
            if self.metrics is not None:
                self.metrics.rejected.inc()
            raise Overloaded
        job.future = asyncio.get_running_loop().create_future()
        self.pending += 1
        self._gauge()
        try:
            self._queue.put_nowait(job)
            return await job.future
        finally:
            self.pending -= 1
            self._gauge()

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.pending)

    async def _dispatch(self) -> None:
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self._queue.get()]
            if self.batching and self.max_wait > 0:
                await asyncio.sleep(self.max_wait)
            while not self._queue.empty():
                jobs.append(self._queue.get_nowait())
            for batch in self._batches(jobs):
                batch = [job for job in batch if not job.future.done()]  # cancelled clients
                if not batch:
                    continue
                try:
                    result = await loop.run_in_executor(self.executor, batch[0].run, batch)
                except Exception as error:  # the jobs' own failure, reported to each of them
                    for job in batch:
                        if not job.future.done():
                            job.future.set_exception(error)
                    continue
                self._deliver(batch, result)

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
