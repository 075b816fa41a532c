"""The tests' tiny models: the seeded checkpoints and float64 models of
scripts/tiny_checkpoints.py (shipped: a script builds on them too), plus what only tests
use -- a chain drafter that records its proposals, and ONNX exports shared across a test
run."""

from __future__ import annotations

import contextlib
import copy
import shutil
from pathlib import Path

import torch

from scripts.tiny_checkpoints import (  # noqa: F401 (the tests read them as tiny.NAME)
    PARD_TOKEN, SPECIALS, drafter_config, eagle3_config, float64_eagle3, float64_pard,
    float64_target, make_drafter, make_eagle3, make_pard, make_target, pard_config,
    pard_from_target, random_eagle3, stdlib_text, train_tokenizer)


class RecordedChain:
    """Passes a batch chain drafter through, keeping every chain it proposed."""

    def __init__(self, inner):
        self.inner, self.max_drafts, self.scaling = inner, inner.max_drafts, inner.scaling
        self.proposals = []

    def __getattr__(self, name):  # add, prefill, prefill_more, join_prefilled, remove, fused
        return getattr(self.inner, name)

    def draft(self, ids, features, ks, samplers):
        drafts = self.inner.draft(ids, features, ks, samplers)
        self.proposals += [(d.tokens, d.visible.tolist()) for d in drafts if d is not None]
        return drafts


# The ONNX graphs of one model, exported once per test run: the session engines and the
# stand-in TensorRT engine over the long pair ask the exporter for the same graphs (the
# same weights, layers, scaling and form), and each export costs seconds. Inside
# shared_exports, a graph asked for again is a copy of the file its first export wrote.
EXPORTERS = ("export_target", "export_target_kv", "export_drafter", "export_drafter_kv")
_exported: dict = {}


def _fingerprint(value) -> str:
    import hashlib

    if isinstance(value, torch.nn.Module):
        h = hashlib.sha256(f"{type(value).__name__} {getattr(value, 'config', None)!r}".encode())
        for name, tensor in sorted(value.state_dict().items()):
            h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
            h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()
    if hasattr(value, "to_dict"):  # QueryScaling
        return repr(sorted(value.to_dict().items()))
    return repr(value)


@contextlib.contextmanager
def shared_exports(cache: Path):
    """build.export's graph exporters memoised into cache (a folder kept for the session),
    keyed by everything they read but the output path."""
    import inspect

    import pytest
    from build import export

    def memoised(name, real):
        signature = inspect.signature(real)

        def exporter(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            path = Path(bound.arguments.pop("path"))
            key = (name,) + tuple((k, _fingerprint(v)) for k, v in bound.arguments.items())
            if key in _exported:
                kept, record = _exported[key]
                shutil.copyfile(kept, path)
                return copy.deepcopy(record) | {"file": path.name}
            record = real(*args, **kwargs)
            kept = cache / f"{len(_exported)}-{path.name}"
            shutil.copyfile(path, kept)
            _exported[key] = (kept, copy.deepcopy(record))
            return record

        return exporter

    with pytest.MonkeyPatch.context() as patch:
        for name in EXPORTERS:
            patch.setattr(export, name, memoised(name, getattr(export, name)))
        yield
