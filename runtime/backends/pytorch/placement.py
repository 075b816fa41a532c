"""Where the torch backend's models run: the registry's device and dtype names
(runtime/backends/__init__.py) resolved to torch's, and the target and drafters loaded,
placed on a device in a dtype and made row-invariant in reduced precision."""

from __future__ import annotations

import torch
from torch import nn

from runtime.backends import DEVICES, TORCH_DTYPES
from runtime.models.dflash import DFlashDrafter
from runtime.models.target import ModelError

# what the registry's dtype names resolve to
TORCH_DTYPE = {name: getattr(torch, name) for name in TORCH_DTYPES}


def resolve_device(name: str | torch.device) -> torch.device:
    """'cpu' / 'cuda' / 'cuda:N' as a torch.device, or a one-line ModelError."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ModelError(f"device {name!r} is not one of {', '.join(DEVICES)}") from None
    if device.type not in DEVICES:
        raise ModelError(f"device {name!r} is not one of {', '.join(DEVICES)}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError("device cuda asked for, but torch sees no CUDA device here — "
                         "pass --device cpu")
    return device


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        if name not in TORCH_DTYPE.values():
            raise ModelError(f"dtype {name} is not one of {', '.join(TORCH_DTYPE)}")
        return name
    if name not in TORCH_DTYPE:
        raise ModelError(f"dtype {name!r} is not one of {', '.join(TORCH_DTYPE)}")
    return TORCH_DTYPE[name]


def place(model: nn.Module, device, dtype=None) -> nn.Module:
    """A loaded model moved onto `device` (in `dtype` when given), in eval mode."""
    device = resolve_device(device)
    return model.to(device=device, dtype=None if dtype is None else resolve_dtype(dtype)).eval()


def load_target(target_dir, device="cpu", dtype="float32"):
    """Our TargetModel on `device` in `dtype` and its tokenizer (runtime/models/target.py
    loads; this places). Its static caches are leased per request by the compiled
    roles (compiled.py: EngineSteps' pools)."""
    from runtime.models.target import load_target as load

    from plugins.row_invariant import REDUCED, make_row_invariant

    dtype = resolve_dtype(dtype)
    device = resolve_device(device)
    model, tokenizer = load(target_dir, dtype)
    if dtype in REDUCED:  # lossless in bfloat16/float16 too: plugins/row_invariant.py
        make_row_invariant(model)
    return place(model, device), tokenizer


def load_dflash(drafter_dir, device="cpu", dtype="float32") -> DFlashDrafter:
    from runtime.models.dflash import load_dflash as load

    return place(load(drafter_dir, resolve_dtype(dtype)), resolve_device(device))
