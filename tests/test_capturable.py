"""The op on the GPU path must survive CUDA-graph capture: no host read of a tensor's
values between the op's entry and the kernel launch (TensorRT-LLM, vLLM and SGLang replay
decode steps as graphs; a read syncs the stream and invalidates the capture). Checked on
CPU by running that path on fake CUDA tensors, which have shapes but no values: any read
of a value raises. Counts are validated where they are made instead (StepMetadata)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from plugins import attention
from plugins.scaling import QueryScaling
from runtime.step_metadata import StepMetadata

triton_kernel = pytest.importorskip("plugins.triton_kernel", reason="triton is not installed")

SCALING = QueryScaling(ref_keys=64, top_k=8)


@pytest.fixture
def no_launch(monkeypatch):
    """The CUDA path up to the Triton launch, with the launch itself recorded, not run (fake
    tensors have no memory), on an H200-sized device, with a plan cache of its own."""
    launched = []
    monkeypatch.setattr(triton_kernel, "_PLANS", {})
    monkeypatch.setattr(triton_kernel, "_sm_count", lambda device: 132)
    monkeypatch.setattr(triton_kernel.LaunchPlan, "run", lambda plan, *tensors: launched.append(plan))
    return launched


@pytest.mark.parametrize("variant", ["split", "single"])
@pytest.mark.parametrize("kv_len", [96, 8192])
def test_cuda_path_reads_no_tensor_values(no_launch, variant, kv_len):
    with FakeTensorMode():
        q = torch.empty(2, 8, 16, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 2, kv_len, 64, device="cuda", dtype=torch.bfloat16)
        visible = torch.empty(2, 16, device="cuda", dtype=torch.int64)
        assert attention._fused_kernel_applies(q, None)
        out = attention._attention(q, k, k, visible, None, SCALING)  # the op's implementation
        assert out.shape == q.shape and out.device.type == "cuda"
        again = triton_kernel.launch(q, k, k, visible, SCALING, variant=variant)
        assert again.shape == q.shape
    assert len(no_launch) == 2 and no_launch[0].variant in ("single_pass", "split")


def test_cuda_path_still_refuses_bad_shapes_without_reading_values(no_launch):
    with FakeTensorMode():
        q = torch.empty(1, 3, 4, 16, device="cuda")
        k = torch.empty(1, 2, 10, 16, device="cuda")
        with pytest.raises(ValueError, match="grouped heads"):
            attention._attention(q, k, k, torch.empty(1, 4, dtype=torch.int64, device="cuda"), None, SCALING)
    assert not no_launch


def test_cpu_path_keeps_the_one_line_refusal_of_bad_counts():
    q = torch.randn(1, 1, 2, 16)
    k = torch.randn(1, 1, 10, 16)
    with pytest.raises(ValueError, match=r"visible counts must lie in \[1, kv_len=10\], got 0\.\.3"):
        attention.sharpdraft_attention(q, k, k, torch.tensor([[0, 3]]), SCALING)


@pytest.mark.parametrize("cached, new", [(-1, 3), (4, -2), (torch.tensor([3, -1]), 2), (2.5, 1),
                                         (torch.tensor([1.0, 2.0]), 1)])
def test_step_metadata_refuses_lengths_that_make_bad_counts(cached, new):
    # Where counts are made: cached >= 0 and new >= 0 give every row >= 1 visible key.
    with pytest.raises(ValueError, match="step lengths"):
        StepMetadata(cached, new)


def test_step_metadata_leaves_cuda_lengths_unread(monkeypatch):
    # A captured step edits its CUDA length tensors in place: reading them would sync.
    with FakeTensorMode():
        lengths = torch.empty(4, dtype=torch.int64, device="cuda")
        meta = StepMetadata(lengths, 16)
        assert meta.block_keys(16).shape == (4,)


def test_op_compiles_into_one_graph_with_its_fake_implementation():
    # torch.compile(fullgraph=True) over a caller: the op is one node (its fake gives the
    # output's shape), no graph break, same numbers as eager.
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 5, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g),
               torch.randn(1, 2, 30, 16, generator=g))
    visible = torch.tensor([[30, 29, 28, 27, 26]])

    def step(q, k, v, visible):
        return attention.sharpdraft_attention(q * 2, k, v, visible, SCALING) + 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(q, k, v, visible), step(q, k, v, visible), atol=1e-6)


FIRST_CALLER = r"""
import torch
from plugins import attention
from plugins.scaling import QueryScaling

g = torch.Generator().manual_seed(2)
q, k, v = (torch.randn(1, 4, 5, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g),
           torch.randn(1, 2, 30, 16, generator=g))
visible = torch.tensor([[30, 29, 28, 27, 26]])
scaling = QueryScaling(ref_keys=64, top_k=8)

def step(q, k, v, visible):
    return attention.sharpdraft_attention(q * 2, k, v, visible, scaling) + 1

# the compiled step is this process's FIRST caller of the op: nothing ran it eagerly before
got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, visible)
want = step(q, k, v, visible)
assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()
print("first compiled call matches eager")
"""


def test_a_fresh_processs_first_caller_of_the_op_compiles_in_one_graph():
    # In a process of its own: in this one an earlier test has long since called the op.
    # Registered lazily (on first call), dynamo met Library.__init__ inside the step and
    # fullgraph=True refused it; registered at import, the step compiles and matches eager.
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", FIRST_CALLER], cwd=repo, capture_output=True,
                          text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "first compiled call matches eager" in done.stdout
