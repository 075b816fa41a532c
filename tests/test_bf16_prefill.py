"""--prefill-dtype bfloat16 (runtime/backends/bf16_prefill.py): an onnxruntime engine's
prefill in bfloat16 multiplies is the float32 target to bfloat16 rounding, gives the same
bits however the prompt is chunked on the ROWS grid, keeps every mode lossless alone and
batched against its own target-only, and is refused where it cannot apply."""

import json

import numpy as np
import pytest
import tiny
import torch

from runtime.backends import bf16_prefill
from runtime.backends.onnxruntime import BoundKVCache
from runtime.engine import Engine
from runtime.spec import open_spec
from runtime.manifest import EngineError
from runtime.models.target import load_target
from script_loader import load_script

ROWS = bf16_prefill.ROWS


@pytest.fixture(scope="module")
def bf16_engine(native_engine):
    return Engine(open_spec(native_engine, prefill_dtype="bfloat16"))


def text_ids(engine, n):
    return engine.encode(tiny.stdlib_text())[:n]


def prefilled(engine, ids, parts=None):
    """A batch of one prefilled with `ids` (in parts of `parts` tokens, else whole) on the
    engine's batch target: the last token's logits, the features of each part after the
    first (all of them whole), and the row's keys and values."""
    target = engine.loaded.batch_target()
    if parts is None:
        logits, features = target.add(ids, len(ids) + 8)
    else:
        target.prefill(ids[:parts], len(ids) + 8)
        features = []
        for begin in range(parts, len(ids), parts):
            logits, part = target.prefill_more(ids[begin:begin + parts])
            features.append(part)
        features = torch.cat(features)
        target.join_prefilled()
    group, = target.groups
    assert target.lengths == [len(ids)]
    return logits, features, group.cache.k[:, 0, :, :len(ids)], group.cache.v[:, 0, :, :len(ids)]


def test_the_prefill_is_the_float32_targets_to_bfloat16_rounding(native_ort_engine, bf16_engine):
    ids = text_ids(bf16_engine, 2 * ROWS + 37)
    logits32, features32, keys32, _ = prefilled(native_ort_engine, ids)
    logits16, features16, keys16, _ = prefilled(bf16_engine, ids)
    assert features16.shape == features32.shape and logits16.shape == logits32.shape

    def off(a, b):  # the largest difference against the float32 values' scale
        a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        return ((a - b).abs().max() / b.abs().max()).item()

    # bfloat16 keeps 8 bits of mantissa (0.4% a rounding): close, and not the same bits
    for ours, theirs in ((logits16, logits32), (features16, features32), (keys16, keys32)):
        assert 0 < off(ours, theirs) < 0.05


@pytest.mark.parametrize("chunk", [ROWS, 2 * ROWS])
def test_a_prompt_prefilled_in_chunks_on_the_grid_gives_the_same_bits(bf16_engine, chunk):
    ids = text_ids(bf16_engine, 3 * ROWS + 5)
    logits, features, keys, values = prefilled(bf16_engine, ids)
    chunk_logits, parts, chunk_keys, chunk_values = prefilled(bf16_engine, ids, chunk)
    assert torch.equal(chunk_logits, logits)
    assert torch.equal(parts, features[chunk:])
    assert np.array_equal(chunk_keys, keys) and np.array_equal(chunk_values, values)


def test_blocks_follow_the_grid_however_the_prompt_is_chunked(bf16_engine, monkeypatch):
    """Blocks start on multiples of ROWS: a prompt's rows reach every multiply in the same
    blocks, with the same row counts, alone or in chunks (the grid's promise)."""
    seen, real = [], bf16_prefill.PackedLinear.__call__

    def spy(self, x):
        seen.append(x.shape[0])
        return real(self, x)

    monkeypatch.setattr(bf16_prefill.PackedLinear, "__call__", spy)
    ids, target = text_ids(bf16_engine, 2 * ROWS + 37), bf16_engine.loaded.batch_target()
    per_block = 4 * len(bf16_engine.loaded.prefiller.packed)
    target.prefill(ids, len(ids))
    whole, seen[:] = list(seen), []
    target.prefill(ids[:ROWS], len(ids))
    target.prefill_more(ids[ROWS:])
    assert seen == whole == [ROWS] * (2 * per_block) + [37] * per_block
    seen.clear()
    target.prefill(ids[:37], len(ids))  # off the grid (the scheduler refuses such chunks):
    target.prefill_more(ids[37:])  # the next block still ends on it
    assert seen == [37] * per_block + [ROWS - 37] * per_block + [ROWS] * per_block + [37] * per_block


def test_qk_norm_targets_prefill_like_the_model(tmp_path):
    """A Qwen3-style target (q_norm/k_norm, which the packed q/k/v path applies through the
    layer's own shape_query / shape_key_value) prefills to the float32 model's outputs
    within bfloat16 rounding, keys in the cache buffer included."""
    target_dir = tiny.make_target(tmp_path / "qwen3", model_type="qwen3")
    model, tokenizer = load_target(target_dir)
    reference, _ = load_target(target_dir)
    layers = (0, model.config.num_layers - 1)
    prefill = bf16_prefill.Bf16Prefill(model, layers)
    c = reference.config
    ids = tokenizer(tiny.stdlib_text()[:3000])["input_ids"][:ROWS + 20]
    cache = BoundKVCache(len(ids) + 4, c.num_layers, c.num_kv_heads, c.head_dim)
    logits, features = prefill(cache, ids)
    kv = reference.new_cache(len(ids) + 4)
    with torch.inference_mode():
        want_logits, want_features = reference(torch.tensor([ids]), kv, layers, last_logits_only=True)
    scale = want_features.abs().max()
    assert cache.length == len(ids)
    assert (features - want_features[0]).abs().max() < 0.05 * scale
    assert (logits - want_logits[0, -1]).abs().max() < 0.05 * want_logits.abs().max()
    keys = torch.from_numpy(cache.k[:, :, :, :len(ids)])
    assert (keys - kv.k[:, :, :, :len(ids)]).abs().max() < 0.05 * kv.k.abs().max()


def test_every_mode_stays_lossless_alone_and_batched(native_engine, tmp_path, capsys):
    """scripts/dtype_lossless.py on the bfloat16-prefill configuration: each mode's greedy
    tokens, alone and two at a time through the serving scheduler (chunked prefill as
    served), equal this configuration's own target-only tokens."""
    prompts = tmp_path / "prompts.jsonl"
    text = tiny.stdlib_text()
    prompts.write_text("".join(json.dumps({"text": text[i * 900:(i + 1) * 900]}) + "\n"
                               for i in range(3)))
    out = tmp_path / "lossless.json"
    code = load_script("dtype_lossless").main([
        "--engine-dir", str(native_engine), "--prompts-file", str(prompts),
        "--config", "onnxruntime:float32", "onnxruntime:float32:bfloat16",
        "--modes", "sharpdraft", "window-hybrid", "--requests", "3", "--max-new-tokens", "8",
        "--concurrency", "2", "--threads", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["lossless"]
    ours = report["configs"][1]
    assert ours["prefill_dtype"] == "bfloat16" and ours["target_vs_first"]["config"] == "onnxruntime:float32"
    assert set(ours["modes"]) == {"target", "sharpdraft", "window-hybrid"}
    assert all(m == {"alone": [], "c2": [], "errors": []} for m in ours["modes"].values())


def test_other_backends_and_bad_values_are_refused_in_one_line(native_engine):
    with pytest.raises(EngineError, match="--prefill-dtype is the onnxruntime backend's"):
        Engine(open_spec(native_engine, backend="torch", prefill_dtype="bfloat16"))
    with pytest.raises(EngineError, match="--prefill-dtype 'float16' is not one of float32, bfloat16"):
        Engine(open_spec(native_engine, prefill_dtype="float16"))


def test_loading_leaves_torchs_thread_count_as_it_was(native_engine):
    torch.set_num_threads(2)
    Engine(open_spec(native_engine, prefill_dtype="bfloat16"))
    assert torch.get_num_threads() == 2


def test_chunks_off_the_grid_are_refused(bf16_engine, native_engine, capsys):
    from runtime.__main__ import main as runtime_main
    from runtime.cli import run
    from runtime.serve.scheduler import StepScheduler

    with pytest.raises(ValueError, match="--prefill-chunk 100 must be a multiple of 128"):
        StepScheduler(bf16_engine, prefill_chunk=100)
    StepScheduler(bf16_engine, prefill_chunk=2 * ROWS).close()  # on the grid, or 0 (off)
    StepScheduler(bf16_engine, prefill_chunk=0).close()
    code = run(runtime_main, ["serve", "--engine-dir", str(native_engine), "--prefill-dtype",
                              "bfloat16", "--prefill-chunk", "100", "--model-repository", "unused"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["error: --prefill-chunk 100 must be a multiple of 128 with "
                                 "--prefill-dtype bfloat16 (0: no chunking; a prompt prefilled "
                                 "in other chunks would round differently than alone)"]


def test_a_cpu_without_onednn_bfloat16_multiplies_with_plain_kernels(monkeypatch):
    """Where oneDNN has no bfloat16 kernels (a CPU without AVX-512), the multiply is a plain
    bfloat16 linear of the same weights: same shapes, other kernels."""
    linears = [torch.nn.Linear(16, 8), torch.nn.Linear(16, 4, bias=False)]
    packed = bf16_prefill.PackedLinear(linears)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    plain = bf16_prefill.PackedLinear(linears)
    assert not plain.packed and plain.widths == [8, 4]
    x = torch.randn(5, 16).to(torch.bfloat16)
    assert torch.allclose(plain(x).float(), packed(x).float(), atol=0.05, rtol=0.02)


def test_load_bound_runs_and_records_the_bfloat16_prefill(native_engine, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    text = tiny.stdlib_text()
    prompts.write_text("".join(json.dumps({"text": text[i * 700:(i + 1) * 700]}) + "\n"
                               for i in range(2)))
    out = tmp_path / "bound.json"
    assert load_script("load_bound").main([
        "--engine-dir", str(native_engine), "--prompts-file", str(prompts), "--requests", "2",
        "--max-new-tokens", "4", "--concurrency", "2", "--threads", "1", "--peers",
        "--prefill-dtype", "bfloat16", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["prefill_dtype"] == "bfloat16" and report["tokens_identical"]
    assert report["c1"]["tokens"] == report["c2"]["tokens"] == 8
