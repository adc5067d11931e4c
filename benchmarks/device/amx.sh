#!/usr/bin/env bash
# The AMX rows of docs/benchmarks.md on a many-core Xeon that brings its own torch (no package registry needed):
# builds ipex_train's extension against that torch, then times bench_train_step's transformer and CNN rows
# (fp32, torch autocast bf16, optimize(bf16)) at 16 threads, and BERT-base again at 4 threads.
#
#   bash benchmarks/device/amx.sh            # from the repository root; writes under $OUT (or out/device)
#
# Environment: PY (python3), OUT (output folder), THREADS (16), STEPS (timed steps, 6), MODELS (the 16-thread rows),
# FEW_THREADS_MODELS (bert_base) at FEW_THREADS (4),
# BUILD=0 to reuse an extension already built, MODEL_S (seconds allowed per row, 60), LIMIT_S (no row starts after
# this many seconds, 420), PLAIN=1 to add the plain-loop check (--check-plain-loop: about half again the time),
# ATTENTION=1 to first time the tiled attention (thread scaling 4 -> THREADS with both tile products and the same-bits
# check, then bench_attention's long-sequence rows against torch; up to ~3.5 minutes, so pair it with fewer MODELS,
# e.g. `ATTENTION=1 MODELS=bert_base FEW_THREADS_MODELS= bash benchmarks/device/amx.sh`).
# Budget: the build (a few minutes on 16 cores) plus five rows of at most MODEL_S each, none started after LIMIT_S:
# under 8 minutes. A row that runs over is cut and says so in train.txt; one not started says so too.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
T=${THREADS:-16}
STEPS=${STEPS:-6}
MODELS=${MODELS:-"bert_base vit_b16 resnet50 llama_s256"}
O=${OUT:-out/device}
mkdir -p "$O"
start=$(date +%s)
{
  date -u +%Y-%m-%dT%H:%M:%SZ
  lscpu | grep -i "model name\|^CPU(s)\|numa node(s)"
  grep -o -w 'amx_bf16\|amx_tile\|avx512_bf16' /proc/cpuinfo | sort | uniq -c
  $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'threads', torch.get_num_threads())"
  $PY -c "import transformers, torchvision; print('transformers', transformers.__version__, 'torchvision', torchvision.__version__)"
  git rev-parse --short HEAD 2>/dev/null || true
} 2>&1 | tee "$O/env.txt"

if [ "${BUILD:-1}" != 0 ]; then
  t0=$(date +%s)
  MAX_JOBS=${MAX_JOBS:-$(nproc)} $PY setup.py build_ext --inplace > "$O/build.log" 2>&1
  rc=$?
  echo "build rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$O/env.txt"
  if [ $rc != 0 ]; then tail -30 "$O/build.log"; exit 1; fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import ipex_train, ipex_train._C; print('ipex_train', ipex_train.__file__, ipex_train.info()['kernel_variant'])" \
  2>&1 | tail -3 | tee -a "$O/env.txt"

row() {  # row MODEL THREADS; skipped once LIMIT_S (420) have passed, so that the whole run stays under 8 minutes
  if [ $(( $(date +%s) - start )) -gt "${LIMIT_S:-420}" ]; then
    echo "== $1, $2 threads: skipped, ${LIMIT_S:-420} s passed" | tee -a "$O/train.txt"
    return 0
  fi
  echo "== $1, $2 threads ($(( $(date +%s) - start )) s in)" | tee -a "$O/train.txt"
  timeout "${MODEL_S:-60}" $PY -m benchmarks.suite.bench_train_step --threads "$2" --steps "$STEPS" --max-warmup 4 \
    --no-memory --models "$1" --variants fp32 autocast_bf16 optimize_bf16 ${PLAIN:+--check-plain-loop} \
    --json "$O/train_step_${1}_t$2.json" 2>&1 | grep -v "^\s*$" | tail -24 | tee -a "$O/train.txt"
  rc=${PIPESTATUS[0]}
  [ "$rc" = 124 ] && echo "$1 at $2 threads: cut after ${MODEL_S:-60} s" | tee -a "$O/train.txt"
  return 0
}
# The patch-embedding route's op-level evidence (seconds): conv against GEMM at ViT stems.
timeout 60 $PY -m benchmarks.studies.patch_embedding --threads "$T" --json "$O/patch_embedding_t$T.json" 2>&1 \
  | grep -v "^W" | tee -a "$O/train.txt"
if [ "${ATTENTION:-0}" = 1 ]; then
  timeout 90 $PY -m benchmarks.studies.attention_scaling --threads 4 "$T" --json "$O/attention_scaling.json" 2>&1 \
    | grep -v "^W" | tee -a "$O/attention.txt"
  timeout 120 $PY -m benchmarks.standalone.bench_attention --threads "$T" --set issue --json "$O/attention_t$T.json" \
    2>&1 | grep -v "^W" | tee -a "$O/attention.txt"
fi
for M in $MODELS; do row "$M" "$T"; done
for M in ${FEW_THREADS_MODELS-bert_base}; do row "$M" "${FEW_THREADS:-4}"; done
echo "total $(( $(date +%s) - start )) s" | tee -a "$O/env.txt"
