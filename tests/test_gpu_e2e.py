"""The GPU sections gpu_e2e and gpu_steps on CPU (their rows' code on the tiny pair): what
makes an end-to-end row a measurement (medians of 3 timed runs, one tokenization handed to
both sides, transformers' compile status and first call, a missing target-only row marking
its context unchecked, a differing token located), and the step-cost families' table."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts import gpu_e2e, gpu_steps

REPO = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def loaded(tiny_target, tiny_drafter):
    from runtime.backends.pytorch.placement import load_dflash, load_target

    model, tokenizer = load_target(tiny_target, "cpu", "float32")
    drafter = load_dflash(tiny_drafter, "cpu", "float32")
    prompts = {72: gpu_e2e.prompt_ids(tokenizer, 64), 48: gpu_e2e.prompt_ids(tokenizer, 40)}
    return dict(model=model, tokenizer=tokenizer, drafter=drafter, prompts=prompts, target_dir=tiny_target)


def ours(loaded, modes=gpu_e2e.MODES, prompts=None):
    from runtime.families import DFLASH

    rows, saves = [], []
    gpu_e2e.our_rows(loaded["model"], loaded["drafter"], DFLASH.preset, CPU, prompts or loaded["prompts"],
                     8, None, gpu_e2e.Clock(600), rows, lambda: saves.append(len(rows)), modes=modes)
    return rows, saves


def test_our_rows_are_medians_of_three_timed_runs_checked_against_target_only(loaded):
    rows, saves = ours(loaded)
    assert [(r["mode"], r["context"]) for r in rows] == [(m, c) for c in (72, 48) for m in gpu_e2e.MODES]
    assert saves == list(range(1, len(rows) + 1))  # saved after every row
    for r in rows:
        assert len(r["runs_tok_s"]) == gpu_e2e.TIMED_RUNS >= 3
        assert r["tok_s"] == sorted(r["runs_tok_s"])[1] and r["mal"] >= 1 and r["new_tokens"] == 8
        assert r["prompt_sha256"] == gpu_e2e.ids_digest(loaded["prompts"][r["context"]])
    assert all(r["lossless"] is True for r in rows if r["mode"] != "target")


def test_a_missing_target_only_row_leaves_its_context_unchecked_and_a_differing_token_is_located(
        loaded, monkeypatch):
    rows, _ = ours(loaded, modes=("ngram",))
    assert [r["lossless"] for r in rows] == ["unchecked", "unchecked"]  # never passed by default
    real = gpu_e2e.decode_row

    def off_at_5(decoders, mode, *args):
        row = real(decoders, mode, *args)
        if mode == "hybrid":
            row["tokens"] = row["tokens"][:5] + [row["tokens"][5] + 1] + row["tokens"][6:]
        return row

    monkeypatch.setattr(gpu_e2e, "decode_row", off_at_5)
    rows, _ = ours(loaded, modes=("target", "hybrid"), prompts={72: loaded["prompts"][72]})
    assert rows[1]["lossless"] is False and rows[1]["first_differing_index"] == 5
    assert gpu_e2e.verdict(rows) == ["hybrid at 72"]
    assert gpu_e2e.first_difference([1, 2, 3], [1, 2]) == 2 and gpu_e2e.first_difference([1], [1]) is None


def test_transformers_rows_get_the_same_prompt_ids_and_record_their_compile(loaded):
    from runtime.models.target import load_hf_causal_lm

    mine, _ = ours(loaded, modes=("target",))
    model, _ = load_hf_causal_lm(Path(loaded["target_dir"]), torch.float32)
    rows = []
    want = {r["context"]: r["tokens"] for r in mine}
    gpu_e2e.transformers_rows(model, loaded["tokenizer"], CPU, loaded["prompts"], 8, gpu_e2e.Clock(600),
                              rows, lambda: None, ours=want)
    assert [(r["mode"], r["context"]) for r in rows] == [(m, c) for c in (72, 48) for m in gpu_e2e.PEERS]
    for r in rows:
        assert "error" not in r, r
        assert r["prompt_sha256"] == gpu_e2e.ids_digest(loaded["prompts"][r["context"]])
        assert len(r["t1_runs_s"]) == len(r["tn_runs_s"]) == gpu_e2e.TIMED_RUNS and r["tok_s"] > 0
        assert r["compiled"] is False and r["first_call_s"] > 0  # on CPU transformers does not compile
    # the same weights and ids, greedy in fp32: transformers decodes our target-only tokens
    assert all(r["tokens_equal_ours"] for r in rows if "static" in r["mode"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no CUDA device exists")
def test_gpu_sections_refuse_without_cuda_in_one_line(tmp_path):
    for module in ("scripts.gpu_e2e", "scripts.gpu_steps"):
        done = subprocess.run([sys.executable, "-m", module, "--out", str(tmp_path)], cwd=REPO,
                              capture_output=True, text=True, timeout=300,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
        assert done.returncode == 1 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done
    assert not any(tmp_path.iterdir())  # nothing measured, nothing written


def test_goals_are_ratios_of_measured_rows():
    rows = [{"mode": "target", "context": 8192, "tok_s": 400.0, "mal": 1.0},
            {"mode": "hybrid", "context": 8192, "tok_s": 1000.0, "mal": 3.2},
            {"mode": "transformers generate (static cache)", "context": 8192, "tok_s": 320.0},
            {"mode": "target", "context": 4096, "tok_s": 420.0, "fallback": "cudagraph steps failed"},
            {"mode": "transformers generate (static cache)", "context": 4096, "tok_s": 330.0}]
    assert gpu_e2e.goals(rows) == {"target_vs_transformers_static_8192": 1.25, "hybrid_vs_target_8192": 2.5}


def test_qwen3_8b_shape_is_qwen3_8b():
    """Built on the meta device (no memory): Qwen3-8B's parameter count and DFlash's
    default target layers for 36 layers and 5 draft layers."""
    target, drafter = gpu_steps.qwen3_8b_shaped("meta", torch.bfloat16)
    count = sum(p.numel() for p in target.parameters())
    assert 8.1e9 < count < 8.3e9
    assert drafter.config.target_layer_ids == (1, 9, 17, 25, 33)
    assert drafter.config.block_size == 16 and len(drafter.layers) == 5


def test_drafters_for_qwen3_8b_have_the_published_shapes():
    """On the meta device: PARD as PARD-Qwen3-0.6B (0.6B parameters, tied head), EAGLE-3
    one layer at the target's width over a 32K draft vocabulary, reading three layers."""
    target, _ = gpu_steps.qwen3_8b_shaped("meta", torch.bfloat16)
    pard = gpu_steps.pard_drafter(target, gpu_steps.QWEN3_8B, "meta", torch.bfloat16)
    assert 0.59e9 < sum(p.numel() for p in pard.parameters()) < 0.60e9
    assert len(pard.layers) == 28 and pard.lm_head.weight is pard.embed_tokens.weight
    eagle3 = gpu_steps.eagle3_drafter(target, gpu_steps.QWEN3_8B, "meta", torch.bfloat16)
    assert eagle3.lm_head.out_features == 32000 and eagle3.fc.in_features == 3 * 4096
    assert pard.embed_tokens.weight.dtype == eagle3.fc.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["target", "dflash", "pard", "eagle3"])
def test_step_rows_call_the_compiled_steps_the_batched_roles_call(family):
    """Each family's rows, compiled (dynamo over the same step modules the batched roles
    compile; CUDA graphs on the GPU) and eager, give the same outputs at batch 2 on the
    tiny shapes: the rows hand the compiled steps the arguments they take."""
    from runtime.backends.pytorch.compiled import EngineSteps

    shape = gpu_steps.TINY
    torch.manual_seed(0)
    target, dflash = gpu_steps.qwen3_8b_shaped("cpu", torch.float32, shape)
    make = gpu_steps.STEP_FAMILIES[family].drafter
    drafter = make(target, shape, "cpu", torch.float32) if make else None
    outputs = []
    for compiled in (False, True):
        steps = EngineSteps(target, dflash.config.target_layer_ids, (1, shape["block"] + 1), "eager",
                            drafter=drafter, context_span=shape["block"])
        with torch.inference_mode():
            calls = gpu_steps.STEP_FAMILIES[family].rows(steps, 2, 32, compiled)
            outputs.append([[t for t in (out if isinstance(out, tuple) else (out,)) if t is not None]
                            for out in (fn() for _, fn in calls)])
    assert len(outputs[0]) == len(outputs[1]) >= 1
    for eager, compiled in zip(*outputs):
        assert len(eager) == len(compiled) >= 1
        for a, b in zip(eager, compiled):
            torch.testing.assert_close(b, a)


def test_step_costs_run_every_family_per_batch_bucket_and_a_new_family_slots_in(tmp_path, monkeypatch):
    """gpu_steps on CPU: a row per family x step x context x batch bucket, DFlash,
    PARD and EAGLE-3 beside the target; a family added to the table is measured with no
    other edit, and a family that fails leaves every other family's rows."""
    def doubled(steps, batch, context, compiled):
        x = torch.ones(batch, 8)
        return [("stand-in step", lambda: x * 2)]

    def broken(target, shape, device, dtype):
        raise RuntimeError("no drafter today")

    families = dict(gpu_steps.STEP_FAMILIES)
    families = {"target": families.pop("target"), "broken": gpu_steps.StepFamily(broken, doubled),
                **families, "standin": gpu_steps.StepFamily(None, doubled)}
    monkeypatch.setattr(gpu_steps, "STEP_FAMILIES", families)
    data = gpu_steps.run(tmp_path, on_cpu=True)
    assert data["status"] == "failed"  # the broken family's part, and that alone
    saved = json.loads((tmp_path / "gpu_steps.json").read_text())
    assert {n: p["status"] for n, p in saved["parts"].items() if p["status"] != "passed"} == {
        "family_broken": "failed", "cudagraph_rows": "skipped"}
    assert saved["skipped"]["cudagraph_rows"].startswith("GPU-only: ")  # named, with its reason
    rows = saved["rows"]
    assert saved["parts"]["family_standin"]["rows"] == len(gpu_steps.CPU["contexts"]) * len(gpu_steps.CPU["batches"])
    contexts, batches = gpu_steps.CPU["contexts"], gpu_steps.CPU["batches"]
    steps = {"target": ("target decode (1 token)", "target verify (5 tokens)"), "dflash": ("dflash block (4)",),
             "pard": ("pard chain (4 tokens)", "pard chain (8 tokens)"),
             "eagle3": ("eagle3 ingest (5 entries)", "eagle3 chain link (1 token)"), "standin": ("stand-in step",)}
    assert {r["family"] for r in rows} == set(steps)
    for family, names in steps.items():
        mine = [r for r in rows if r["family"] == family]
        assert len(mine) == len(names) * len(contexts) * len(batches), family
        assert {(r["step"], r["context"], r["batch"]) for r in mine} == {
            (n, c, b) for n in names for c in contexts for b in batches}, family
        assert all(r["host_ms"] > 0 and "error" not in r for r in mine)
    assert [r["context"] for r in rows if r["family"] == "target"][0] == max(contexts)  # descending
    row = {"step": "target decode (1 token)", "steps": "cudagraph", "batch": 1, "context": 32768,
           "host_share": 0.05}
    assert gpu_steps.goals([row, row | {"batch": 4}]) == {"host_share_decode_cudagraph_32768": 0.05}
