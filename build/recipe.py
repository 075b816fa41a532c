"""What the three drafter recipes (build/train_drafter.py, train_pard.py, train_eagle3.py)
share around their own objective: the command-line options every recipe has, the
learning-rate schedule, one optimizer step, the resumable state in --work, the
--max-minutes stop, and the loss summary and provenance lines of a card."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from build import checkpoints
from runtime.cli import progress

STATE_KEYS = ("model", "optimizer", "step", "history", "recipe")  # what every state.pt holds


def add_target_and_out(parser, drafter: str) -> None:
    parser.add_argument("--out", default=str(checkpoints.DEFAULT_DRAFTERS[drafter]))
    parser.add_argument("--target", help="target directory or .gguf (default: SmolLM2-135M-Instruct)")


def add_time_limit(parser, note: str = "") -> None:
    parser.add_argument("--max-minutes", type=float, default=55.0,
                        help="stop training after this long (state saved; rerun to continue), so a "
                             f"run fits the hour on 2 cores{note}; 0: no limit")


def cosine_lr(base: float, step: int, steps: int) -> float:
    """Linear warmup over the first 1/30 of the planned steps, then cosine to 0 at `steps`."""
    warmup = max(1, steps // 30)
    return base * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_step(model, optimizer, loss) -> None:
    """Backward, clip the gradient norm at 1 (all three recipes), update."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def save_state(path: Path, model, optimizer, step: int, history: list, recipe: dict, **extras) -> None:
    """Everything a rerun needs to continue exactly, written whole then renamed: a run
    killed mid-save leaves the previous state, never half of one."""
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "history": history, "recipe": recipe} | extras, tmp)
    tmp.rename(path)


def resume(path: Path, recipe: dict, model, optimizer, error=ValueError) -> tuple[int, list, dict]:
    """(step, loss history, the recipe's own extra keys) of the run saved at `path`, with
    its weights and optimizer loaded; (0, [], {}) when there is none. A state of another
    recipe is refused: continuing it would mix two runs. `error` is the recipe's class
    for that refusal (PARD's is a usage error, exit 2; the others exit 1)."""
    if not path.exists():
        return 0, [], {}
    state = torch.load(path)
    held = state.get("recipe") or {}
    if held != recipe:
        differ = sorted(k for k in set(held) | set(recipe) if held.get(k) != recipe.get(k))
        raise error(f"{path} holds a run of another recipe (it differs in {', '.join(differ)}); "
                    "pass another --work or delete it")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    progress(f"resuming at step {state['step']}")
    return state["step"], state["history"], {k: v for k, v in state.items() if k not in STATE_KEYS}


def out_of_time(started: float, max_minutes: float, step: int) -> bool:
    """True (and says so on stderr) once the run has used its --max-minutes."""
    if not max_minutes or time.time() - started <= 60 * max_minutes:
        return False
    tqdm.write(f"stopping at step {step}: --max-minutes {max_minutes} reached "
               "(rerun the same command to continue)", file=sys.stderr)
    return True


def loss_summary(history: list[float]) -> tuple[list[float], float | None]:
    """(mean loss of 100 steps at every tenth of the run, mean of the last 100 steps;
    None before any step)."""
    every_tenth = [round(sum(history[i:i + 100]) / len(history[i:i + 100]), 4)
                   for i in range(0, len(history), max(1, len(history) // 10))]
    last100 = round(sum(history[-100:]) / len(history[-100:]), 4) if history else None
    return every_tenth, last100


def command_line(module: str) -> str:
    """The command that made a checkpoint, for its card (`module`: build/'s recipe, e.g.
    train_drafter)."""
    return f"python -m build.{module} " + " ".join(sys.argv[1:])
