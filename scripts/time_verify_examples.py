"""Time `crosscheck verify` on every example step of docs/verify.md, one command each.

Each example runs as its own ``python -m crosscheck verify ... --json`` (default fixtures and
layouts: 10 cases for a v1 scheme, 20 for a spec), the way a maintainer's CI would call it, and
the table prints the command's own wall time and CPU seconds (itself and every process it
started; ``crosscheck.launch.cpu_time``) from its JSON, and its verdict. Run from the
repository root::

    python scripts/time_verify_examples.py

The README's Performance section quotes its output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HF_MODEL = "examples.torch_hf_model:model"
FLAX_MODEL = "examples.jax_flax_model:model"
#: (framework, step, scheme, extra options): the table of docs/verify.md, plus contract v2's
#: GRPO examples and the multi-term objectives' correct steps (``objective:MODULE:OBJECT`` in
#: place of a scheme runs ``--objective MODULE:OBJECT``).
EXAMPLES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("torch", "examples.torch_nanogpt:step", "token_mean", ()),
    ("torch", "examples.torch_torchtitan:step", "token_mean", ()),
    ("torch", "examples.torch_factory:step", "token_mean", ()),
    ("torch", "examples.torch_hf_loss:step", "token_mean", ()),
    ("torch", "examples.torch_grpo_prompt_mean:step", "group_token_mean", ()),
    ("torch", "examples.torch_hf_model:step", "token_mean", ("--model", HF_MODEL)),
    ("jax", "examples.jax_pmap_mean:step", "token_mean", ()),
    ("jax", "examples.jax_optax_multisteps:step", "token_mean", ()),
    ("jax", "examples.jax_token_weighted:step", "token_mean", ()),
    ("jax", "examples.jax_optax_float32:step", "token_mean", ()),
    ("jax", "examples.jax_grpo_prompt_mean:step", "group_token_mean", ()),
    ("jax", "examples.jax_flax_model:step", "token_mean", ("--model", FLAX_MODEL)),
    ("torch", "examples.torch_context_parallel:step", "token_mean", ()),
    ("jax", "examples.jax_context_parallel:step", "token_mean", ()),
    ("torch", "examples.torch_objective:step", "objective:examples.objectives:MOE", ()),
    ("jax", "examples.jax_objective:step", "objective:examples.objectives:MOE", ()),
)  # fmt: skip


def main() -> int:
    print("| step | scheme | cases | verdict | wall s | CPU s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="gradweight-time-") as tmp:
        for framework, step, scheme, extra in EXAMPLES:
            out = Path(tmp) / "report.json"
            kind, _, objective = scheme.partition(":")
            intended = ["--objective", objective] if kind == "objective" else ["--scheme", scheme]
            command = [
                sys.executable, "-m", "crosscheck", "verify", "--framework", framework,
                "--step", step, *intended, *extra, "--json", str(out),
            ]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if not out.exists():
                print(f"| `{step}` | {scheme} | - | no report (exit {done.returncode}) | - | - |")
                continue
            report = json.loads(out.read_text())
            verdict = "passes" if report["ok"] else f"fails: {report['diagnosis']['best_match']}"
            print(
                f"| `{step}` | {scheme} | {len(report['cases'])} | {verdict} "
                f"| {report['wall_time_s']:.1f} | {report['cpu_s']:.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
