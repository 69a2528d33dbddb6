"""``hpc_tp.cuda_graph.Replayed``'s order of events, without a device: a stand-in for the few cupy
calls it makes records them (the device tests in test_gpu.py check that replays compute the eager
numbers)."""

import sys
import types

import pytest

from hpc_tp import cuda_graph


class FakeCuda:
    """What Replayed takes from ``cupy.cuda``; ``fail_capture`` makes ``end_capture`` raise as a
    driver refusing a capture does."""

    def __init__(self, events: list, fail_capture: bool = False):
        self.events, self.fail_capture = events, fail_capture
        outer = self

        class Pool:
            def malloc(self, size):
                raise AssertionError("not called by the stand-in work")

            def free_all_blocks(self):
                events.append("pool freed")

        class Graph:
            def launch(self):
                events.append("launch")

        class Stream:
            def __enter__(self):
                events.append("on capture stream")

            def __exit__(self, *exc):
                events.append("off capture stream")

            def begin_capture(self):
                events.append("begin capture")

            def end_capture(self):
                events.append("end capture")
                if outer.fail_capture:
                    raise RuntimeError("operation not permitted when stream is capturing")
                return Graph()

        class UsingAllocator:
            def __init__(self, malloc):
                events.append("private pool")

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                events.append("default pool")

        self.MemoryPool, self.Stream, self.using_allocator = Pool, Stream, UsingAllocator


@pytest.fixture
def fake_cupy(monkeypatch):
    def install(fail_capture=False):
        events = []
        module = types.ModuleType("cupy")
        module.cuda = FakeCuda(events, fail_capture)
        monkeypatch.setitem(sys.modules, "cupy", module)
        return events

    return install


def test_the_first_call_runs_eagerly_then_is_captured_and_later_calls_replay(fake_cupy):
    events = fake_cupy()
    calls = []

    def work():
        calls.append(len(calls))
        events.append("work")
        return f"outputs of call {calls[-1]}"

    replayed = cuda_graph.Replayed(work, "the step")
    assert replayed() == "outputs of call 0"  # the eager call's own outputs
    assert events == [
        "private pool",
        "on capture stream",
        "work",
        "begin capture",
        "work",
        "end capture",
        "off capture stream",
        "default pool",
    ]
    events.clear()
    assert [replayed(), replayed()] == ["outputs of call 1"] * 2  # the captured call's arrays, every replay
    assert events == ["launch", "launch"] and len(calls) == 2 and not replayed.failed
    replayed.close()
    assert events[-1] == "pool freed"


def test_a_refused_capture_warns_and_leaves_the_work_eager(fake_cupy):
    events = fake_cupy(fail_capture=True)
    replayed = cuda_graph.Replayed(lambda: events.append("work") or len(events), "decoding")
    with pytest.warns(
        UserWarning,
        match=r"decoding runs without a CUDA graph: its capture failed \(RuntimeError: "
        r"operation not permitted when stream is capturing\)",
    ):
        replayed()
    assert replayed.failed
    events.clear()
    replayed()
    assert events == ["work"]  # eager from then on: no stream, no pool, no launch


def test_graphs_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("HPC_TP_CUDA_GRAPHS", "0")
    assert not cuda_graph.enabled()
    monkeypatch.setenv("HPC_TP_CUDA_GRAPHS", "1")
    assert cuda_graph.enabled()
