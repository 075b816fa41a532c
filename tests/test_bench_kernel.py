"""The kernel benchmark's plumbing on CPU: it refuses a full run without CUDA in one line,
and --smoke measures tiny shapes under the Triton interpreter and writes the JSON (with
device, date, command and the named ratios) and the plot."""

import contextlib
import json

import pytest
import torch

bench_kernel = pytest.importorskip("plugins.bench_kernel")
pytest.importorskip("triton", reason="triton is not installed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without a GPU")
def test_full_run_without_cuda_refuses_in_one_line(tmp_path, capsys):
    assert bench_kernel.main(["--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: plugins.bench_kernel needs a CUDA device") and err.count("\n") == 1
    assert not (tmp_path / "bench_kernel.json").exists()


def test_smoke_run_writes_json_with_named_figures_and_plot(tmp_path, capsys):
    assert bench_kernel.main(["--smoke", "--out", str(tmp_path), "--repeats", "2"]) == 0
    report = json.loads((tmp_path / "bench_kernel.json").read_text())
    assert (tmp_path / "bench_kernel.png").stat().st_size > 0
    assert {"device", "date", "command"} <= set(report) and "--smoke" in report["command"]
    shapes = [row["shape"] for row in report["shapes"]]
    assert shapes == [bench_kernel.shape_name(*s) for s in bench_kernel.SMOKE_SHAPES]
    assert set(report["single_launch_vs_split"]) == set(shapes)
    assert set(report["decode_vs_sdpa"]) == {s for s, row in zip(shapes, report["shapes"]) if row["q_len"] == 1}
    for row in report["shapes"]:
        assert {"split", "single", "exact_rows", "unscaled", "sdpa_gqa"} <= set(row["eager_us"])
        assert all(t > 0 for t in row["eager_us"].values())
    out = capsys.readouterr().out
    assert out.count("\n") == len(shapes)  # one line per shape on stdout


def test_graph_capture_warms_up_on_a_side_stream_then_captures_one_call(monkeypatch):
    # The one capture sequence the benchmark and the GPU checks share (plugins/cuda_graph),
    # on CPU with torch.cuda's streams and graphs recorded: the warm-ups run on a side
    # stream that first waits for the current one, the current one waits for them, then
    # exactly one call is captured and its output is what capture returns.
    from plugins import cuda_graph

    log = []

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            log.append(f"{self.name} waits {other.name}")

    @contextlib.contextmanager
    def recorded(what, name):
        log.append(f"{what} {name}")
        yield
        log.append(f"end {name}")

    current = Stream("current")
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: recorded("on", s.name))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", lambda g: recorded("capture", g))
    calls = iter(range(10))
    graph, out = cuda_graph.capture(lambda: log.append("call") or next(calls), warmups=2)
    assert (graph, out) == ("graph", 2)
    assert log == ["side waits current", "on side", "call", "call", "end side", "current waits side",
                   "capture graph", "call", "end graph"]


def test_the_json_is_saved_after_every_shape(tmp_path, monkeypatch):
    """A bench stopped after its first shape (a timeout, say) leaves that shape's row in
    bench_kernel.json, marked incomplete."""
    real = bench_kernel._variant_calls
    seen = []

    def second_shape_fails(q, *args):
        seen.append(q.shape)
        if len(seen) == 2:
            raise RuntimeError("killed here")
        return real(q, *args)

    monkeypatch.setattr(bench_kernel, "_variant_calls", second_shape_fails)
    with pytest.raises(RuntimeError, match="killed here"):
        bench_kernel.run(tmp_path, repeats=2, smoke=True)
    report = json.loads((tmp_path / "bench_kernel.json").read_text())
    assert [row["shape"] for row in report["shapes"]] == [bench_kernel.shape_name(*bench_kernel.SMOKE_SHAPES[0])]
    assert report["complete"] is False and report["planned_shapes"][1] == bench_kernel.shape_name(
        *bench_kernel.SMOKE_SHAPES[1])
