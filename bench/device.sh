#!/usr/bin/env bash
# The session's one device-machine command (H200): set-up, default-model training, GPU benchmark.
#
#   bash bench/device.sh                      # on the device machine ($OUT is set there)
#   MTPC_DEVICE_DRY=1 bash bench/device.sh    # CPU dry run: OUT = a temp dir, tiny sizes, the gpu
#                                             # pre-training config shrunk to 2 CPU steps (PYTHON= picks the interpreter)
# Before the call, here: `make device-prep` (or `python -m experiments.shipping.device_prep`; `--tiny` for the
# dry run) writes the git SHA, the wheels the device image lacks and a copy of the target models' code
# under .device/ (with PRETRAIN=1 / --pretrain also the corpus streams), which the call must carry:
#   device run: command "bash bench/device.sh", carry [".device"], timeout_s 560 (300 without pre-training)
#
# Each part runs in its own subprocess under a hard timeout and may fail without stopping the next:
#   0. set-up (<= 60 s): PYTHONPATH=$PWD (the repo is not installed; .device/whl's wheels go to /tmp/mtpc_site),
#      nvidia-smi and package versions (into device.log)
#   1. only when .device/train.u8.xz is there (`make device-prep PRETRAIN=1`):
#      timeout 270 python3 -m experiments.pretrain --config gpu --out /tmp/mtpc_default --ship
#      then its shards are moved to $OUT and the small files packed into $OUT/default_meta.tar
#   1b. only when .device/head_train.jsonl is there (`make device-prep` writes it, 16 MiB of training chats):
#      the shipped default head's design (btree n = 4, r = 16, App. G 16, known byte, beta = 0.5: the card of
#      mtpc/default_heads/btree-n4-r16-known) trained for 3 minutes in bf16-mixed, exported to
#      $OUT/head_btree_n4_r16_known (compare it here on the development prompts with bench/compare_heads_offline.py,
#      then ship it with experiments.shipping.ship_head if it wins)
#   2. timeout 150 python3 bench/bench_gpu.py --default-model /tmp/mtpc_default --out $OUT/bench_gpu.json
#      (the benchmark falls back to the shipped default model if part 1 failed)
#   2b. timeout 60 python3 bench/profile_gpu_step.py --out $OUT/profile_verify16.json: the step and the 16-byte
#      verify profiled, graphed and eager, and what the verify adds kernel by kernel (Llama-3.2-3B's shape, bf16)
#   3. timeout 60 python3 bench/bench_evabyte_gpu.py --out $OUT/evabyte_gpu.json: a tiny EvaByte from its
#      own code (MTPC_THIRD_PARTY, else ../shared/third_party or shared/third_party) on CUDA with triton,
#      float32 and bf16: finite logits, adapter = its forward, greedy speculative = its own greedy
#   4. timeout 200 python3 bench/bench_offline.py --device cuda ... --out $OUT/offline_gpu.json: offline (teacher-forced)
#      against online acceptance on the GPU, the shipped default, 3 sets x 32 held-out prompts x 256 bytes
#      (.device/heldout_prompts.jsonl; the trained heads in .device/heads go to the mtpc cache there)
# Files under $OUT: device.log (every part's output), bench_gpu.json, profile_verify16.json, evabyte_gpu.json,
# offline_gpu.json, head_btree_n4_r16_known/ (part 1b), and with part 1 default_meta.tar and the model's bf16 shards
# (3 of < 16 MiB). To ship them: unpack default_meta.tar and the shards into
# mtpc/default_model/ (the manifest inside checks them).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ "${MTPC_DEVICE_DRY:-0}" = "1" ]; then
  OUT=$(mktemp -d /tmp/mtpc_device_dry.XXXXXX)
  T0=${MTPC_DRY_TIMEOUT_PRETRAIN:-300}; T1=${MTPC_DRY_TIMEOUT_BENCH:-300}; TINY=--tiny
  T2=${MTPC_DRY_TIMEOUT_EVABYTE:-600}; EVA_ARGS=(--dry --new-bytes 16)
  T3=${MTPC_DRY_TIMEOUT_OFFLINE:-300}; OFFLINE_ARGS=(--device cpu --prompts 2 --max-new-tokens 16)
  T5=${MTPC_DRY_TIMEOUT_PROFILE:-300}
  T4=${MTPC_DRY_TIMEOUT_HEAD:-300}; HEAD_ARGS=(--trainer.max_steps 2 --data.max_val_rows 2)
  PRETRAIN_ARGS=(--config gpu --set accelerator=cpu --set precision=32-true --set compile=false --set max_steps=2
                 --set batch_size=2 --set seq_len=256 --set heldout_rows=2 --set warmup_steps=1 --ship-rows 2)  # no GPU here
else
  OUT=${OUT:?OUT must name the output folder}
  T0=270; T1=150; TINY=""
  T2=60; EVA_ARGS=(); T5=60
  T3=200; OFFLINE_ARGS=(--device cuda --prompts 32 --max-new-tokens 256 --batch 256 --slot-budget 1048576)
  PRETRAIN_ARGS=(--config gpu)
  # part 1b: 32 rows of 512 bytes a step in bf16-mixed, stopped by the clock (Lightning's max_time) before its timeout
  T4=230; HEAD_ARGS=(--trainer.accelerator gpu --trainer.precision bf16-mixed --trainer.max_steps 100000
                     --trainer.max_time 00:00:03:00 --data.batch_size 32 --data.max_val_rows 64)
fi
DEFAULT_OUT=${MTPC_DEFAULT_OUT:-/tmp/mtpc_default}
if [ "${MTPC_DEVICE_DRY:-0}" != "1" ] && ls .device/whl/*.whl >/dev/null 2>&1; then  # what the image lacks (device_prep)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mtpc_site .device/whl/*.whl \
    && export PYTHONPATH="/tmp/mtpc_site${PYTHONPATH:+:$PYTHONPATH}" || echo "warning: .device/whl not installed" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
[ -z "${MTPC_THIRD_PARTY:-}" ] && [ -d .device/third_party ] && export MTPC_THIRD_PARTY="$PWD/.device/third_party"
mkdir -p "$OUT"
log() { echo "[device.sh $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/device.log"; }

log "part 0: set-up (OUT=$OUT)"
timeout 60 "$PY" - /tmp/mtpc_hardware.json <<'EOF' >>"$OUT/device.log" 2>&1 || log "part 0 failed (rc=$?)"
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
        return subprocess.run(cmd, capture_output=True, text=True, timeout=40).stdout.strip()  # a cold import takes >10 s
    except Exception as e:  # noqa: BLE001
        return f"unavailable ({type(e).__name__})"
info["nvidia_smi"] = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,power.limit",
                          "--format=csv"])
info["git_sha"] = run(["git", "rev-parse", "HEAD"])
info["mtpc_importable"] = run([sys.executable, "-c", "import mtpc.backbones, mtpc.speculative; print('yes')"])
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info))
EOF

if [ -f .device/train.u8.xz ]; then
  log "part 1: pre-train the default model (timeout ${T0}s) -> $DEFAULT_OUT"
  timeout "$T0" "$PY" -m experiments.pretrain "${PRETRAIN_ARGS[@]}" --out "$DEFAULT_OUT" --ship \
    >>"$OUT/device.log" 2>&1
  log "part 1 exit code $?"
else
  log "part 1 skipped: no .device/train.u8.xz (make device-prep PRETRAIN=1 to train a new default); the shipped one is benchmarked"
fi
if [ -f "$DEFAULT_OUT/MANIFEST.json" ]; then  # the shipped form: shards as files, the rest in one tar
  cp "$DEFAULT_OUT"/*.safetensors "$OUT"/ && tar -C "$DEFAULT_OUT" --exclude='*.safetensors' -cf "$OUT/default_meta.tar" . \
    && log "part 1 model in \$OUT: $(cd "$DEFAULT_OUT" && ls | tr '\n' ' ')"
fi

if [ -f .device/head_train.jsonl ]; then  # device_prep writes it unless --no-heads
  log "part 1b: train the shipped head's design on the GPU (timeout ${T4}s) -> \$OUT/head_btree_n4_r16_known"
  timeout "$T4" "$PY" -m experiments.train fit --config experiments/configs/default.yaml \
    --model.circuit btree --model.window 4 --model.rank 16 --model.kl_beta 0.5 --model.leaf_delta_rank 16 \
    --model.known_byte true \
    --data.source .device/head_train.jsonl --data.val_fraction 0.01 --data.max_train_conversations null \
    "${HEAD_ARGS[@]}" --run.tracking false --run.checkpoint_every_n_steps 0 \
    --run.dir /tmp/mtpc_head_run --run.export_dir "$OUT/head_btree_n4_r16_known" >>"$OUT/device.log" 2>&1
  log "part 1b exit code $? ($(ls "$OUT/head_btree_n4_r16_known" 2>/dev/null | tr '\n' ' '))"
else
  log "part 1b skipped: no .device/head_train.jsonl (make device-prep writes it)"
fi

log "part 2: GPU benchmark (timeout ${T1}s)"
timeout "$T1" "$PY" bench/bench_gpu.py --default-model "$DEFAULT_OUT" --out "$OUT/bench_gpu.json" $TINY \
  >>"$OUT/device.log" 2>&1
log "part 2 exit code $?"
log "part 2b: where verify_16's time goes against the step's, kernel by kernel (timeout ${T5}s)"
timeout "$T5" "$PY" bench/profile_gpu_step.py --out "$OUT/profile_verify16.json" $TINY >>"$OUT/device.log" 2>&1
log "part 2b exit code $?"
log "part 3: EvaByte's own code on CUDA + triton (timeout ${T2}s)"
timeout "$T2" "$PY" bench/bench_evabyte_gpu.py --out "$OUT/evabyte_gpu.json" ${EVA_ARGS[@]+"${EVA_ARGS[@]}"} >>"$OUT/device.log" 2>&1
log "part 3 exit code $?"
log "part 4: offline against online acceptance on the GPU (timeout ${T3}s)"
if [ -d .device/heads ] && [ "${MTPC_DEVICE_DRY:-0}" != "1" ]; then  # the trained heads, where bench_offline finds them
  HEADS_DIR=$("$PY" -c "from mtpc.paths import cache_dir; print(cache_dir() / 'heads')") && mkdir -p "$HEADS_DIR" \
    && cp -r .device/heads/. "$HEADS_DIR"/
fi
PROMPT_ARGS=(); [ -f .device/heldout_prompts.jsonl ] && PROMPT_ARGS=(--prompt-source .device/heldout_prompts.jsonl)
timeout "$T3" "$PY" bench/bench_offline.py "${OFFLINE_ARGS[@]}" --sets 3 --no-two-step ${PROMPT_ARGS[@]+"${PROMPT_ARGS[@]}"} \
  --out "$OUT/offline_gpu.json" >>"$OUT/device.log" 2>&1
log "part 4 exit code $?"
log "done: $(ls "$OUT" | tr '\n' ' ')"
