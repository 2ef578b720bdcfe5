#!/usr/bin/env bash
# GPU readiness check of gradweight on a machine with one NVIDIA GPU (docs/gpu.md).
#
#   scripts/gpu_check.sh [RESULTS_DIR]      PYTHON=... picks the interpreter (default python3)
#
# Records, in RESULTS_DIR (default gpu-results/<UTC time>):
#   device.json, nvidia-smi.txt    the GPU (torch.cuda.get_device_name, nvidia-smi), versions,
#                                  and both frameworks' default float32 matmul settings
#   run.json / run.log             the analytic matrix at R = 1 on the GPU: torch ranks on
#                                  cuda (NCCL), JAX on the gpu platform, float64 and float32
#   division.log                   postnorm's G / D on the GPU against the CPU's, bit for bit
#   bench.log, bench.json          `crosscheck bench --device cuda --ranks 1`
#   tf32-*.json / tf32-*.log       a float32 step verified with TF32 matmuls on and off
#   status.tsv, summary.txt        every check's exit status and seconds; the verdicts
#
# Every check is bounded (`timeout`; the bounds add up to under 10 minutes) and a failing
# check does not stop the others: a mismatch (exit 1) is a finding, recorded like a pass.
# The script exits 0 when every check ran to a verdict (exit 0 or 1), 1 otherwise.
#
# TF32: torch and JAX differ by default on Ampere and later GPUs. torch computes float32
# matmuls in true float32 unless told otherwise (torch.backends.cuda.matmul.allow_tf32 is
# False by default since 1.12: the "TensorFloat-32 (TF32) on Ampere (and later) devices"
# section of https://pytorch.org/docs/stable/notes/cuda.html). JAX leans toward speed: its
# default float32 dot may use TF32 on recent GPUs (bfloat16 passes on TPU) unless
# jax_default_matmul_precision is "highest" (https://docs.jax.dev/en/latest/201/precision.html).
# So the same float32 step can be judged at different precision levels in the two frameworks.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
PYTHON=${PYTHON:-python3}
OUT=${1:-gpu-results/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
STATUS="$OUT/status.tsv"
printf 'check\texit\tseconds\n' >"$STATUS"
WORST=0

# check NAME SECONDS COMMAND...: run COMMAND bounded by SECONDS (SIGTERM, which crosscheck
# answers by stopping every process it started; SIGKILL 10 s later), its output in NAME.log.
check() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS rc=0
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >>"$STATUS"
  echo "$name: exit $rc after $((SECONDS - start)) s"
  if [ "$rc" -gt 1 ]; then WORST=1; fi
}

# The device, the versions and the default float32 matmul settings of both frameworks.
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true
fi
check device 30 "$PYTHON" - "$OUT/device.json" <<'EOF'
import json, sys
import jax, torch
gpu = torch.cuda.is_available()
record = {
    "torch": torch.__version__,
    "torch_cuda": torch.version.cuda,
    "cuda_available": gpu,
    "gpu_count": torch.cuda.device_count(),
    "gpu_name": torch.cuda.get_device_name(0) if gpu else None,
    "capability": list(torch.cuda.get_device_capability(0)) if gpu else None,
    "torch_allow_tf32_default": torch.backends.cuda.matmul.allow_tf32,
    "jax": jax.__version__,
    "jax_devices": [str(d) for d in jax.devices()],
    "jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
}
json.dump(record, open(sys.argv[1], "w"), indent=1)
print(json.dumps(record, indent=1))
EOF

# postnorm's division G / D on the GPU, bit for bit against the CPU's correctly rounded one
# (torch_impl/division.py: CUDA's div_ by a Python float multiplies by its reciprocal).
check division 30 "$PYTHON" - <<'EOF'
import sys
import torch
from torch_impl.division import divide_all_exactly, divide_exactly
gen = torch.Generator().manual_seed(0)
bad = []
for dtype in (torch.float32, torch.float64):
    grads = [torch.randn(4096, generator=gen, dtype=dtype) for _ in range(3)]
    for D in (3.0, 7.0, 1477.0, 25165513.0):  # the last is past 2^24: float32's detour
        cpu = [g.clone() for g in grads]
        gpu = [g.cuda() for g in grads]
        divide_all_exactly(cpu, D)
        divide_all_exactly(gpu, D)
        one = grads[0].cuda()
        divide_exactly(one, D)
        pairs = [("all", g.cpu(), c) for g, c in zip(gpu, cpu)] + [("one", one.cpu(), cpu[0])]
        for name, got, want in pairs:
            differ = int((got != want).sum())
            if differ:
                bad.append(f"{dtype} D={D:g} ({name}): {differ} of {want.numel()} differ")
print("\n".join(bad) or "every quotient bit-identical to the CPU's")
sys.exit(1 if bad else 0)
EOF

# The analytic matrix at R = 1 on the GPU. jax-multiprocess stays out: its workers run on
# the CPU with gloo collectives (docs/gpu.md).
check run 200 "$PYTHON" -m crosscheck run --world-sizes 1 --accum-steps 1,2 --dtypes float64,float32 \
  --impls oracle,jax-pmap,jax-shard_map,jax-jit,torch-ddp,torch-fsdp2 \
  --no-world-size-change --no-resume --device cuda --platform gpu --json "$OUT/run.json"

# One GPU: one torch rank (NCCL over one device) and JAX on its one device.
check bench 120 "$PYTHON" -m crosscheck bench --device cuda --ranks 1 --json "$OUT/bench.json"

# A float32 step, TF32 matmuls on and off, in each framework.
VERIFY=(-m crosscheck verify --scheme token_mean --dtype float32 --world-sizes 1 --accum-steps "1,2")
check tf32-torch-on 45 "$PYTHON" "${VERIFY[@]}" --framework torch --device cuda \
  --step scripts.gpu_tf32_steps:step_tf32 --json "$OUT/tf32-torch-on.json"
check tf32-torch-off 45 "$PYTHON" "${VERIFY[@]}" --framework torch --device cuda \
  --step scripts.gpu_tf32_steps:step_no_tf32 --json "$OUT/tf32-torch-off.json"
check tf32-jax-default 45 env -u JAX_DEFAULT_MATMUL_PRECISION "$PYTHON" "${VERIFY[@]}" \
  --framework jax --platform gpu --step examples.jax_token_weighted:step \
  --json "$OUT/tf32-jax-default.json"
check tf32-jax-highest 45 env JAX_DEFAULT_MATMUL_PRECISION=highest "$PYTHON" "${VERIFY[@]}" \
  --framework jax --platform gpu --step examples.jax_token_weighted:step \
  --json "$OUT/tf32-jax-highest.json"

# The verdicts in one file.
"$PYTHON" - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print((out / "status.tsv").read_text().rstrip())
device = out / "device.json"
if device.exists():
    d = json.loads(device.read_text())
    print(f"device: {d['gpu_name']} (capability {d['capability']}), torch {d['torch']}, jax {d['jax']}")
run = out / "run.json"
if run.exists():
    rows = json.loads(run.read_text())["results"]
    failed = [r for r in rows if not r["ok"]]
    print(f"run: {len(rows)} rows, {len(failed)} not ok")
    for r in failed:
        print(f"  {r['impl']} {r['fixture']}/{r['scheme']} {r['strategy']} R={r['world_size']} "
              f"M={r['accum_steps']} {r['dtype']}: max rel err {r['max_rel_err']} {r['detail'][:120]}")
for name in ("tf32-torch-on", "tf32-torch-off", "tf32-jax-default", "tf32-jax-highest"):
    path = out / f"{name}.json"
    if path.exists():
        v = json.loads(path.read_text())
        print(f"{name}: ok={v['ok']} precision={v['precision']} max rel err={v['max_rel_err']}")
    else:
        print(f"{name}: no report (see {name}.log)")
EOF
exit "$WORST"
