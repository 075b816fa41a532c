import os

import torch

# The Triton kernel runs on CPU through Triton's interpreter; the switch must be set before
# anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys
from pathlib import Path

# Tests run tiny models: one thread avoids thread hand-off costs that dwarf the work.
torch.set_num_threads(1)

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny  # noqa: E402


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory) -> Path:
    return tiny.make_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def tiny_drafter(tmp_path_factory, tiny_target) -> Path:
    return tiny.make_drafter(tmp_path_factory.mktemp("drafter"), tiny_target)


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory, tiny_target, tiny_drafter) -> Path:
    """A SharpDraft engine over the tiny pair, built by build_engine.py itself."""
    import build_engine

    out = tmp_path_factory.mktemp("engines") / "tiny-sharpdraft"
    code = build_engine.main(["--drafter", "dflash", "--sharpdraft", "--target", str(tiny_target),
                              "--drafter-checkpoint", str(tiny_drafter), "--ref-keys", "64",
                              "--top-k", "8", "--output", str(out)])
    assert code == 0
    return out
