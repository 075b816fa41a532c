"""The onnxruntime backend, split by concern: buffers.py (sessions, host and bound
caches), target.py, drafters.py, bound_rows.py (a batch's rows in bound buffers: the
slot manager's BoundSlots), loader.py (OnnxEngine). An engine's exported graphs
(build/export.py) in ONNX Runtime sessions on the CPU, behind the same batch roles as
the torch backend (runtime/backends/roles.py); one request is a batch of one. SharpDraftAttention nodes run through the onnxruntime-extensions op of
plugins/onnx.py, so the drafter file TensorRT would parse is the file that runs here.

The target runs target-kv.onnx over a BoundKVCache: one [layers, batch, kv_heads,
capacity, head_dim] array per keys/values, each layer's slice wrapped once in an OrtValue
and bound through IO binding for as long as the cache lives. A step reads the buffers
where they lie and hands back only its own keys/values, which land in the buffer at the
committed length; a rollback is a length change. (The previous backend fed the committed
prefix as an input and the graph concatenated it with the step's keys in every layer:
at 4,096 tokens 4.2 tok/s against torch's 9.6 in one session; now 16.9 against 10.5 in
another; see build/export.py.) A prefill runs in HOST_PREFILL_CHUNK-token steps over
compact copies of the prefix (OnnxBatchTarget.prefill_more).

The drafters of native-form engines run the same way: drafter-kv.onnx over a
BoundKVCache (BoundBatchDFlash), storing only each step's context keys. Older engines,
and plugin-form ones, run drafter.onnx with the committed cache as an input
(HostKVCache; OnnxBatchDFlash); engine.json's graph keys say which.

EAGLE-3 engines: the target verifies a draft tree in one pass of target-tree.onnx over
the same bound buffers, every row's tree in one pass per group (OnnxBatchTarget.
verify_trees; keep_paths compacts the accepted paths); the drafter (OnnxBatchEagle3) runs its causal
step and its tree levels over a HostKVCache, past_lens per row as PARD's, the levels'
keys as scratch past each row's committed entries: a batch's chains and trees draft in
one run of each per step and chain link or tree level. Engines whose graphs step one
sequence at a time are refused when they load (check_batched).

Threads: intra-op pools spin while a run is in flight (fast hand-off between small
decode nodes) but stop when it returns (session.force_spinning_stop), else the target's
idle workers starve the drafter that runs next; a graph with the Python plugin op does
not spin at all, since that op's torch threads need the cores. Measured at 4,096 tokens:
SharpDraft speculation 9.5 tok/s with default spinning, 13.5 with this policy.
"""

from runtime.backends.onnxruntime.buffers import (  # noqa: F401 -- the backend's names, from here
    EXPORT_VERSION, HOST_PREFILL_CHUNK, PREFILL_CHUNK, BoundKVCache, HostKVCache, cache_buffer,
    check_batched, has_window, keep_rows, open_session, run_bound, takes_batch, takes_lengths,
    window_feed)
from runtime.backends.onnxruntime.bound_rows import FIRST_SLOTS, BoundSlots  # noqa: F401
from runtime.backends.onnxruntime.drafters import (  # noqa: F401
    BoundBatchDFlash, OnnxBatchDFlash, OnnxBatchEagle3, OnnxBatchPARD)
from runtime.backends.onnxruntime.loader import OnnxEngine  # noqa: F401
from runtime.backends.onnxruntime.target import OnnxBatchTarget  # noqa: F401
