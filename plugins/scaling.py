"""SharpDraft's cardinality-aware query scale: the one place the rule lives.

    r    = max((N - top_k) / (ref_keys - top_k), 1)
    beta = min(exp(max_log_scale), 1 + ln(r) / slope)

N is the number of keys a query row may see. Every other form of the rule (the torch
op, the Triton kernel, the ONNX graphs, TensorRT plugin fields, TRT-LLM tables, the
server config) takes a `QueryScaling` value from here and is tested against `beta`.
Also here: the paper's diagnostics (top-k attention mass and its exact log-odds split).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = ["QueryScaling", "beta", "top_k_mass", "log_odds_decomposition"]


def _check_parameters(ref_keys: int, top_k: int, slope: float, max_log_scale: float) -> None:
    for name, value in (("ref_keys", ref_keys), ("top_k", top_k), ("slope", slope),
                        ("max_log_scale", max_log_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if math.isnan(value) or math.isinf(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
    for name, value in (("ref_keys", ref_keys), ("top_k", top_k)):
        if value != int(value):
            raise ValueError(f"{name} must be a whole number of keys, got {value!r}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if ref_keys <= top_k:
        raise ValueError(f"ref_keys must be greater than top_k ({top_k}), got {ref_keys}")
    if slope <= 0:
        raise ValueError(f"slope must be > 0, got {slope}")
    if max_log_scale < 0:
        raise ValueError(f"max_log_scale must be >= 0, got {max_log_scale}")


def _tracing() -> bool:
    # Data-dependent checks cannot be traced into an exported graph.
    return torch.jit.is_tracing() or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export()


def beta(n, ref_keys: int = 2048, top_k: int = 32, slope: float = 5.0,
         max_log_scale: float = 0.5):
    """The query scale for `n` visible keys (a Python number or a tensor, elementwise).

    Integer tensors give float32 results; floating tensors keep their dtype.
    """
    _check_parameters(ref_keys, top_k, slope, max_log_scale)
    cap = math.exp(max_log_scale)
    if isinstance(n, torch.Tensor):
        n = n if n.is_floating_point() else n.to(torch.float32)
        if not _tracing() and bool(torch.isnan(n).any() | (n < 0).any()):
            raise ValueError("n (visible keys) must be >= 0 and not NaN")
        return _beta_tensor(n, ref_keys, top_k, slope, cap)
    if isinstance(n, bool) or not isinstance(n, (int, float)) or math.isnan(n) or n < 0:
        raise ValueError(f"n (visible keys) must be a number >= 0, got {n!r}")
    r = max((n - top_k) / (ref_keys - top_k), 1.0)
    return min(cap, 1.0 + math.log(r) / slope)


def _beta_tensor(n: torch.Tensor, ref_keys: int, top_k: int, slope: float, cap: float) -> torch.Tensor:
    # The rule on a floating tensor, with no checks: shared by `beta` (after its checks)
    # and `QueryScaling.beta_on_device` (which must not synchronise with the host).
    r = ((n - top_k) / (ref_keys - top_k)).clamp(min=1.0)
    return (1.0 + torch.log(r) / slope).clamp(max=cap)


@dataclasses.dataclass(frozen=True)
class QueryScaling:
    """The four parameters of the rule; the value every other form is built from."""

    ref_keys: int = 2048
    top_k: int = 32
    slope: float = 5.0
    max_log_scale: float = 0.5

    def __post_init__(self) -> None:
        _check_parameters(self.ref_keys, self.top_k, self.slope, self.max_log_scale)
        object.__setattr__(self, "ref_keys", int(self.ref_keys))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "slope", float(self.slope))
        object.__setattr__(self, "max_log_scale", float(self.max_log_scale))

    def beta(self, n):
        return beta(n, self.ref_keys, self.top_k, self.slope, self.max_log_scale)

    def beta_on_device(self, n: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """beta of a tensor of visible-key counts with no host synchronisation: no value
        checks (`beta` checks, and reading a tensor's values back stalls the stream and is
        illegal inside a CUDA graph capture). For hooks inside other engines' kernels
        (plugins/trtllm), whose counts come from the engine's own length tensors.

        Computed in float64 when `dtype` is float64, else float32; returned in `dtype`
        (default: the computation's dtype).
        """
        work = torch.float64 if dtype == torch.float64 else torch.float32
        out = _beta_tensor(n.to(work), self.ref_keys, self.top_k, self.slope, self.cap)
        return out if dtype is None else out.to(dtype)

    def scale_rows(self, q: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        """q with each row multiplied by beta of its visible-key count, on the device with
        no host synchronisation: n has q's leading (row) dims, the rest (heads, head_dim)
        broadcast. What a hook inside an engine's kernel calls per drafter layer
        (plugins/trtllm), so it is one expression with no cast it can skip: an integer n
        divides into float32 by itself; float64 for a float64 q; q rounded back once."""
        if q.dtype == torch.float64 or n.is_floating_point():
            n = n.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        beta = _beta_tensor(n, self.ref_keys, self.top_k, self.slope, self.cap)
        beta = beta.view(*n.shape, *([1] * (q.dim() - n.dim())))
        return q * beta if q.dtype in (torch.float32, torch.float64) else (q.float() * beta).to(q.dtype)

    @property
    def cap(self) -> float:
        return math.exp(self.max_log_scale)

    @property
    def cap_keys(self) -> float:
        """The visible-key count at which beta first reaches its cap."""
        return self.top_k + (self.ref_keys - self.top_k) * math.exp(self.slope * (self.cap - 1.0))

    def kernel_constants(self) -> tuple[float, float, float, float]:
        """(top_k, 1/slope, bias, cap) for kernels that evaluate the rule per row as

            beta = min(cap, max(1, ln(max(N - top_k, 1)) / slope + bias)),
            bias = 1 - ln(ref_keys - top_k) / slope,

        which is the same rule rearranged so a kernel needs one log per row and no
        division. Kernels take these numbers from here; they never restate them.
        """
        return (float(self.top_k), 1.0 / self.slope,
                1.0 - math.log(self.ref_keys - self.top_k) / self.slope, self.cap)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for logs, summaries and plot titles (every command prints it the same way)."""
        return (f"ref_keys={self.ref_keys} top_k={self.top_k} slope={self.slope:g} "
                f"max_log_scale={self.max_log_scale:g} (cap {self.cap:.3f})")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "QueryScaling":
        if not isinstance(data, dict):
            raise ValueError(f"query scaling must be an object, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown query scaling field(s): {', '.join(sorted(unknown))}")
        return cls(**data)


def top_k_mass(probs: torch.Tensor, k: int = 32) -> torch.Tensor:
    """Share of attention on each row's k highest-probability keys (last dim = keys)."""
    k = min(k, probs.shape[-1])
    return probs.topk(k, dim=-1).values.sum(-1)


def log_odds_decomposition(scores: torch.Tensor, k: int = 32, visible: int | None = None):
    """The paper's exact identity for one row of scores over N visible keys:

        ln(mass_top / mass_rest) = contrast - ln((N - k) / k),
        contrast = ln mean_top exp(s) - ln mean_rest exp(s).

    Returns (log_odds, contrast, competitor_term) as tensors over the leading dims.
    """
    if visible is not None:
        scores = scores[..., :visible]
    n = scores.shape[-1]
    if not 0 < k < n:
        raise ValueError(f"k must be between 1 and N-1 visible keys ({n}), got {k}")
    ordered = scores.sort(dim=-1, descending=True).values
    top, rest = ordered[..., :k], ordered[..., k:]
    probs = torch.softmax(scores, dim=-1).sort(dim=-1, descending=True).values
    log_odds = torch.log(probs[..., :k].sum(-1)) - torch.log(probs[..., k:].sum(-1))
    contrast = (torch.logsumexp(top, -1) - math.log(k)) - (torch.logsumexp(rest, -1) - math.log(n - k))
    competitor = torch.full_like(contrast, math.log((n - k) / k))
    return log_odds, contrast, competitor
