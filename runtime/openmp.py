"""One OpenMP pool per process: where torch work may run in a process that serves.

torch's CPU kernels run parallel regions on an OpenMP (libgomp) pool that belongs to the
thread that first ran one, and lives as long as that thread. libgomp makes every pool
stop spinning between regions once the process holds more OpenMP threads than CPUs, so
a second pool slows every small op of the thread that decodes (measured: a torch-backend
engine loaded on the main thread made a 32-token decode on a second thread 1.45x slower,
1.9 s against 1.3 s). So work that runs once (loading an engine, converting weights)
runs where it leaves no pool behind: on a thread that ends with it, or on one thread.
"""

from __future__ import annotations

import contextlib
import threading

import torch


@contextlib.contextmanager
def one_thread():
    """torch ops on the calling thread without an OpenMP pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def in_own_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a thread that ends with it, so its OpenMP pool ends too; its
    result, or its exception raised here."""
    result, error = [], []

    def run():
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as exc:  # handed to the caller, whatever it was
            error.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
