"""runtime/openmp.py: one-time torch work leaves no OpenMP pool on the thread that asked
for it, so the thread that decodes holds the process's one pool (libgomp throttles every
pool once there are more OpenMP threads than CPUs)."""

import os
import time

import pytest
import torch

from runtime.openmp import in_own_thread, one_thread


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled_threads(want: int) -> int:
    """The thread count once a finished thread's pool has wound down (its threads exit
    just after it), or after 5 s."""
    deadline = time.monotonic() + 5
    while os_threads() != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return os_threads()


def parallel_work():
    a = torch.randn(256, 256)
    return float((a @ a).sum())


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_work_in_its_own_thread_leaves_no_thread_behind(two_threads):
    before = os_threads()
    assert isinstance(in_own_thread(parallel_work), float)
    assert settled_threads(before) == before
    with one_thread():
        parallel_work()
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2 and settled_threads(before) == before


def test_its_exception_reaches_the_caller_as_raised():
    def fails(what, *, why):
        raise KeyError(f"{what}: {why}")

    with pytest.raises(KeyError, match="engine: missing"):
        in_own_thread(fails, "engine", why="missing")


def test_the_served_engine_loads_on_a_thread_that_ends(tiny_engine, monkeypatch):
    """The Triton model loads its engine through protocol.load_engine: the engine is made
    on another thread, which has ended by the time it is returned, and it decodes."""
    import threading

    import runtime.engine
    from runtime.serve import protocol
    from runtime.spec import open_spec

    made_on = []

    class Recorded(runtime.engine.Engine):
        def __init__(self, *args, **kwargs):
            made_on.append(threading.current_thread())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(runtime.engine, "Engine", Recorded)
    engine = protocol.load_engine(open_spec(str(tiny_engine), "torch"))
    assert made_on[0] is not threading.current_thread() and not made_on[0].is_alive()
    assert engine.backend == "torch" and engine.generate([5, 6, 7], 3).tokens
