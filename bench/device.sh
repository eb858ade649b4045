#!/usr/bin/env bash
# The session's one device-machine command (H200): set-up, default-model training, GPU benchmark.
#
#   bash bench/device.sh                      # on the device machine ($OUT is set there)
#   MTPC_DEVICE_DRY=1 bash bench/device.sh    # CPU dry run: OUT = a temp dir, tiny sizes, the cpu
#                                             # pre-training config for 2 steps (PYTHON= picks the interpreter)
#
# Each part runs in its own subprocess under a hard timeout and may fail without stopping the next:
#   0. set-up (<= 30 s): PYTHONPATH=$PWD (no install), nvidia-smi and package versions -> $OUT/hardware.json
#   1. timeout 280 python3 -m experiments.pretrain --config gpu --out $MTPC_DEFAULT_OUT   -> $OUT/pretrain.log
#   2. timeout 160 python3 bench/bench_gpu.py --default-model $MTPC_DEFAULT_OUT --out $OUT/bench_gpu.json
#      (-> $OUT/bench_gpu.log; the benchmark falls back to the shipped default model if part 1 failed)
# Files under $OUT: hardware.json, pretrain.log, bench_gpu.json, bench_gpu.log, device.log, plus the
# trained model in $MTPC_DEFAULT_OUT (default $OUT/default; its weights exceed the 16 MiB a returned
# file may have: set MTPC_DEFAULT_OUT=/tmp/default to keep $OUT to five files).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${MTPC_DEVICE_DRY:-0}" = "1" ]; then
  OUT=$(mktemp -d /tmp/mtpc_device_dry.XXXXXX)
  T0=${MTPC_DRY_TIMEOUT_PRETRAIN:-120}; T1=${MTPC_DRY_TIMEOUT_BENCH:-300}; TINY=--tiny
  PRETRAIN_ARGS=(--config cpu --set max_steps=2 --set max_minutes=0.5)  # no GPU here
else
  OUT=${OUT:?OUT must name the output folder}
  T0=280; T1=160; TINY=""
  PRETRAIN_ARGS=(--config gpu)
fi
DEFAULT_OUT=${MTPC_DEFAULT_OUT:-$OUT/default}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
log() { echo "[device.sh $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/device.log"; }

log "part 0: set-up (OUT=$OUT)"
timeout 30 "$PY" - "$OUT/hardware.json" <<'EOF' >>"$OUT/device.log" 2>&1 || log "part 0 failed (rc=$?)"
import importlib, json, platform, subprocess, sys
info = {"python": platform.python_version(), "platform": platform.platform()}
for name in ("torch", "transformers", "peft", "safetensors", "lightning", "triton"):
    try:
        info[name] = importlib.import_module(name).__version__
    except Exception as e:  # noqa: BLE001
        info[name] = f"missing ({type(e).__name__})"
import torch
info["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    info["gpu"] = torch.cuda.get_device_name(0)
    info["cuda"] = torch.version.cuda
def run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"unavailable ({type(e).__name__})"
info["nvidia_smi"] = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,power.limit",
                          "--format=csv"])
info["git_sha"] = run(["git", "rev-parse", "HEAD"])
info["mtpc_importable"] = run([sys.executable, "-c", "import mtpc.backbones, mtpc.speculative; print('yes')"])
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info))
EOF

log "part 1: pre-train the default model (timeout ${T0}s) -> $DEFAULT_OUT"
timeout "$T0" "$PY" -m experiments.pretrain "${PRETRAIN_ARGS[@]}" --out "$DEFAULT_OUT" \
  >"$OUT/pretrain.log" 2>&1
log "part 1 exit code $?"

log "part 2: GPU benchmark (timeout ${T1}s)"
timeout "$T1" "$PY" bench/bench_gpu.py --default-model "$DEFAULT_OUT" --out "$OUT/bench_gpu.json" $TINY \
  >"$OUT/bench_gpu.log" 2>&1
log "part 2 exit code $?"
tail -n 3 "$OUT/bench_gpu.log" | tee -a "$OUT/device.log"
log "done: $(ls "$OUT" | tr '\n' ' ')"
