"""Where and how an engine's steps run, by name: the choices the command lines offer
(--device, --dtype, --steps, --prefill-dtype) and the dtypes engines are built in. Names
only, no torch: runtime/cli.py and build_engine.py read them without loading a backend;
the torch backend maps them to torch objects (runtime/backends/pytorch/placement.py:
resolve_device, resolve_dtype), the onnxruntime backend reads PREFILL_DTYPES (backends/bf16_prefill.py)."""

DEVICES = ("cpu", "cuda")
# compile_step's backends: the torch loader's `steps`, the commands' --steps
STEPS = ("eager", "inductor", "cudagraph")
# weights and KV caches: what build_engine.py --dtype builds in and --dtype runs in
DTYPES = ("float32", "bfloat16", "float16")
# the onnxruntime backend's prefill: the graphs' own float32, or bfloat16 multiplies (AMX)
PREFILL_DTYPES = ("float32", "bfloat16")
