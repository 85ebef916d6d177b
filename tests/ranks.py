"""Run a function on real ranks: one spawned process per rank, gloo over 127.0.0.1.

Test bodies are module-level functions ``fn(rank, world_size, *args)``; what rank r returns
comes back at index r. A rank that raises fails the test with its traceback; a rank that hangs
fails it after ``timeout`` seconds instead of stalling the suite. Every rank runs with one
OpenMP/MKL thread on every thread (:data:`ONE_BLAS_THREAD`), so bitwise comparisons hold on any
CPU and core count.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


ONE_BLAS_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
"""The environment of every process the tests start that trains: one OpenMP/MKL thread on every thread.

``torch.set_num_threads(1)`` governs the thread that calls it (and threads that later enter
ATen's own parallel loops), not a native thread torch did not start: gloo's threads, which
complete collectives and run the callbacks chained on them, call MKL with its own default, one
thread per core. PowerSGD's matrix products run in such callbacks -- on gloo's thread, or inline
on the training thread when the collective had already completed -- and MKL's multi-threaded
``Mᵀ·P`` (AVX-512 kernels) sums in another order than its single-threaded one: the same hook on
the same gradients gave other bits depending on which thread ran it. With one thread everywhere,
both sides of every bitwise comparison run the same arithmetic on any CPU and core count.
"""


@contextlib.contextmanager
def one_blas_thread_in_children() -> Iterator[None]:
    """Processes started inside get :data:`ONE_BLAS_THREAD` (the environment is read when they start)."""
    saved = {name: os.environ.get(name) for name in ONE_BLAS_THREAD}
    os.environ.update(ONE_BLAS_THREAD)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_base_port(count: int) -> int:
    """Return a port P such that P .. P+count-1 are all free on 127.0.0.1 right now."""
    for _ in range(100):
        base = free_port()
        if base + count > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=60),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks and return their results."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(rank, world_size, port, fn, args, results), daemon=True)
        for rank in range(world_size)
    ]
    with one_blas_thread_in_children():
        for process in processes:
            process.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    try:
        while len(outcomes) < world_size:
            if datetime.datetime.now() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(outcomes))} did not finish in {timeout}s")
            if results.empty():
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    raise RuntimeError(f"a rank died with exit code {dead[0].exitcode} before reporting")
                for process in processes:
                    process.join(0.05)
                continue
            rank, ok, value = results.get()
            outcomes[rank] = (ok, value)
    finally:
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()
    failures = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
    if failures:
        raise AssertionError("\n".join(failures))
    return [outcomes[r][1] for r in range(world_size)]
