"""One thread for all of torch's heavy work: model loading and every model step.

PyTorch's CPU kernels run on an OpenMP team that belongs to the thread that calls them. A second
calling thread brings a second team, and on a small machine the teams' spin-waiting workers fight
for the cores: on 2 cores, batch-1 decode measured 33 tok/s from one thread and 18 tok/s once a
second thread had run the model (both threads then stay slow). So cadenza sends its torch work to
this one thread, whatever thread or event loop asks for it.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cadenza-compute")
_compute_thread_ident: int | None = None


def _remember_thread() -> None:
    global _compute_thread_ident
    _compute_thread_ident = threading.get_ident()


_executor.submit(_remember_thread).result()


def in_compute_thread() -> bool:
    return threading.get_ident() == _compute_thread_ident


def run_sync(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `fn` on the compute thread and wait for it (directly, when already there)."""
    if in_compute_thread():
        return fn(*args, **kwargs)
    return _executor.submit(fn, *args, **kwargs).result()


async def run_async(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` on the compute thread without blocking the event loop (directly, when the loop
    itself runs on the compute thread, as in a benchmark that times a whole engine there)."""
    if in_compute_thread():
        return fn(*args)
    return await asyncio.wrap_future(_executor.submit(fn, *args))
