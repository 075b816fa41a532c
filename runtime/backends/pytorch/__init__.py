"""The torch backend, one folder: placement.py (device and dtype, the checkpoints loaded and
placed), eager.py (the batch roles, run eagerly), compiled.py (the same roles
over fixed-shape compiled steps, CUDA graphs per bucket on CUDA), loader.py (TorchLoaded:
runtime/backends/__init__.py LOADERS["torch"]). Named pytorch, not torch, so that no
reader mistakes it for the library. The eager roles are importable from here."""

from runtime.backends.pytorch.eager import (  # noqa: F401 -- the eager roles, by their names
    TorchBatchDFlash, TorchBatchEagle3, TorchBatchPARD, TorchBatchTarget, scatter_rows)
