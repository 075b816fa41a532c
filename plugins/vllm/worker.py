"""Runs inside vLLM's own environment, where this package is installed: one vLLM engine
(LLM()) per run of a job file, decoding of the job's prompts, and per prompt the tokens,
the time and vLLM's own speculative-decoding counters. Imports only the standard library,
vLLM and this package; our checkout is never on its sys.path. Our side (runtime/backends/
vllm.py, scripts/vllm_side_by_side.py, tests/test_vllm.py) writes the job and reads the
answer:

    VLLM_PYTHON -m sharpdraft_plugins.vllm.worker JOB.json OUT.json

JOB: {"target": DIR, "dtype": "float32", "enforce_eager": true, "max_model_len": N,
      "max_tokens": N, "temperature": 0.0, "top_p": 1.0, "seed": 0, "ignore_eos": true,
      "prompts": [[ids...] | "text", ...],
      "runs": [{"name": ..., "speculative_config": {...} | null, "sharpdraft_proof": DIR | null,
                "scaling": {QueryScaling} | null}]}
A run with `sharpdraft_proof` checks the plugin's proof there: a drafter wrapped with the
run's scaling, and every wrapped draft layer's device count grown across the run's prompts,
else the run fails (exit 1, one line).
"""

import json
import os
import sys
import time
from itertools import zip_longest


def counters(llm) -> dict:
    """vLLM's speculative-decoding counters now (names as `vllm:spec_decode_*`)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_position": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(metric.value)
        elif metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_position"] = [a + int(b) for a, b in zip_longest(out["per_position"], metric.values, fillvalue=0)]
    return out


def difference(after: dict, before: dict) -> dict:
    """What one prompt added to the counters."""
    pos = [a - b for a, b in zip_longest(after["per_position"], before["per_position"], fillvalue=0)]
    return {k: after[k] - before[k] for k in ("drafts", "draft_tokens", "accepted")} | {"per_position": pos}


def run(job: dict, spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    proof_dir = spec.get("sharpdraft_proof")
    if proof_dir:
        import shutil

        from ..scaling import QueryScaling
        from ..trtllm import proof

        shutil.rmtree(proof_dir, ignore_errors=True)  # an earlier launch's records are not this one's
    started = time.perf_counter()
    llm = LLM(model=job["target"], dtype=job.get("dtype", "float32"), enforce_eager=job.get("enforce_eager", True),
              max_model_len=job["max_model_len"], seed=0, speculative_config=spec.get("speculative_config"),
              disable_log_stats=False)
    start_s = time.perf_counter() - started
    params = SamplingParams(temperature=job.get("temperature", 0.0), top_p=job.get("top_p", 1.0),
                            seed=job.get("seed"), max_tokens=job["max_tokens"],
                            ignore_eos=job.get("ignore_eos", True))
    held = proof.require(proof_dir, QueryScaling.from_dict(spec["scaling"])) if proof_dir else None
    before_counts = proof.request_counts(proof_dir, held) if proof_dir else None
    prompts = []
    for ids in job["prompts"]:
        before = counters(llm)
        tick = time.perf_counter()
        prompt = ids if isinstance(ids, str) else TokensPrompt(prompt_token_ids=ids)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - tick
        stats = getattr(out, "metrics", None)  # engine-core timestamps: first to last token
        decode = (stats.last_token_ts - stats.first_token_ts) if getattr(stats, "first_token_ts", 0) else None
        prompts.append({"tokens": list(out.outputs[0].token_ids), "text": out.outputs[0].text,
                        "prompt_tokens": len(out.prompt_token_ids), "seconds": seconds,
                        "decode_seconds": decode, "spec": difference(counters(llm), before)})
        print(f"  {spec['name']}: prompt {len(prompts)}/{len(job['prompts'])} ({len(ids)} tokens) "
              f"in {seconds:.1f} s", file=sys.stderr, flush=True)
    result = {"name": spec["name"], "engine_start_s": start_s, "prompts": prompts}
    if proof_dir:
        after_counts = proof.request_counts(proof_dir, held)
        proof.require_growth(held, before_counts, after_counts)
        result["sharpdraft_proof"] = proof.summary(held, after_counts)
    del llm
    return result


def main(argv) -> int:
    job = json.loads(open(argv[0]).read())
    results = []
    for spec in job["runs"]:
        print(f"vLLM run {spec['name']}", file=sys.stderr, flush=True)
        try:
            results.append(run(job, spec))
        except Exception as exc:  # one line: the run's name and the reason (vLLM's last line)
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            print(f"vLLM run {spec['name']} failed: {line}", file=sys.stderr)
            return 1
    with open(argv[1], "w") as f:
        json.dump({"vllm_pid": os.getpid(), "runs": results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
