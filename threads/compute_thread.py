"""One thread for all of torch's heavy work: model loading and every model step.

PyTorch's CPU kernels run on an OpenMP team that belongs to the thread that calls them. A second
calling thread brings a second team, and on a small machine the teams' spin-waiting workers fight
for the cores: on 2 cores, batch-1 decode measured 33 tok/s from one thread and 18 tok/s once a
second thread had run the model (both threads then stay slow). So cadenza sends its torch work to
this one thread, whatever thread or event loop asks for it. The thread starts on first use.

How long that team's threads spin before they sleep is `apply_openmp_defaults`'s (see there).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Callable, MutableMapping, TypeVar

from cadenza.config import environment

if TYPE_CHECKING:  # `import cadenza` imports this module: it loads asyncio and the pool on first use
    from concurrent.futures import ThreadPoolExecutor

T = TypeVar("T")

# GNU OpenMP's spin count (libgomp: PyTorch's wheels and cadenza's kernels share one copy): about
# 20 ns a spin on a 2-core Xeon, so 10,000 spins wait ~0.2 ms, through the gaps between one step's
# parallel regions, then the thread sleeps. libgomp's own 300,000 (~6 ms) also spins through the
# step's single-threaded Python and between steps: beside a 2-process CPU hog, 16 requests of 32
# tokens took 2.9x their time alone with it (10-80x when a third process was busy too: each
# region then waits for both threads to get a core, and they burn their share spinning), and 2.4x
# with 10,000. Alone, 10,000 costs about one wake-up a step (~55 us on that VM): 4% on those 16
# requests, 9% on batch-1 decode. 3000 measured the same beside the hog and slower alone;
# OMP_WAIT_POLICY=PASSIVE (no spinning) 60% slower alone. docs/cpu-threads.md has the runs.
DEFAULT_SPIN_COUNT = "10000"


def apply_openmp_defaults(environ: MutableMapping[str, str] = os.environ) -> None:
    """Bound how long idle OpenMP threads spin (GOMP_SPINCOUNT), unless the user has chosen a wait
    policy (OMP_WAIT_POLICY) or a spin count. libgomp reads them once, when torch loads: called
    from `import cadenza`, so it holds where cadenza is imported before torch (the CLI, `LLM`'s
    users who import cadenza first, every process cadenza starts)."""
    if environment.OMP_WAIT_POLICY.name in environ or environment.GOMP_SPINCOUNT.name in environ:
        return
    environ[environment.GOMP_SPINCOUNT.name] = DEFAULT_SPIN_COUNT


_executor: ThreadPoolExecutor | None = None
_start_lock = threading.Lock()
_compute_thread_ident: int | None = None


def _remember_thread() -> None:
    global _compute_thread_ident
    _compute_thread_ident = threading.get_ident()


def _compute_executor() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        with _start_lock:
            if _executor is None:
                from concurrent.futures import ThreadPoolExecutor

                executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cadenza-compute")
                executor.submit(_remember_thread).result()
                _executor = executor
    return _executor


def in_compute_thread() -> bool:
    return threading.get_ident() == _compute_thread_ident


def run_sync(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `fn` on the compute thread and wait for it (directly, when already there)."""
    if in_compute_thread():
        return fn(*args, **kwargs)
    return _compute_executor().submit(fn, *args, **kwargs).result()


async def run_async(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn` on the compute thread without blocking the event loop (directly, when the loop
    itself runs on the compute thread, as in a benchmark that times a whole engine there)."""
    import asyncio

    if in_compute_thread():
        return fn(*args)
    return await asyncio.wrap_future(_compute_executor().submit(fn, *args))
