#!/usr/bin/env bash
# Real-target steps of the GPU runbook (docs/gpu-runbook.md), run by scripts/gpu_runbook.sh:
#
#   bash scripts/gpu_real_steps.sh STEP
#
# regen       the target's own first responses to every ShareGPT prompt, on every GPU
#             -> /tmp/regen/turn1.jsonl (and $KEEP/regen-turn1.jsonl.xz)
# train_pair  two drafters at once, each on one GPU with its own target (same recipe and steps):
#             A on the regenerated data (/tmp/runA), B on raw ShareGPT (/tmp/runB)
# decode_pair decode_bench.py for A on GPU 0 and B on GPU 1 over the same held-out prompts
#             (A's held-out split), bf16 and fp32; the newest A export -> $KEEP (15 MiB parts)
# multinode   two launchers as two nodes (node 0: the target on GPU 0, node 1: the drafter on
#             GPU 1), tcp between them
# train_regen configs/smollm2-135m-h200-regen.yaml on both GPUs (both roles on one, when only one) over regenerated data already there
#             (/tmp/regen/turn1.jsonl or .gpu/regen-turn1.jsonl.xz) -> /tmp/run-regen
# train_best  as train_regen, with the overrides of the ablation's /tmp/ablation/recipe.json -> /tmp/run-best
# decode_regen decode_bench.py for /tmp/run-regen at 96 (bf16, fp32) and 512 (bf16) new tokens, one
#             GPU each; its export -> $KEEP (15 MiB parts). ATTN: the target's attention (sdpa)
#
# ablation    scripts/ablation.py over the regenerated data (/tmp/regen/turn1.jsonl or
#             .gpu/regen-turn1.jsonl.xz), one variant per GPU at a time, ABL_STEPS steps each (1000),
#             ABL_VARIANTS (default: all built-in ones), plus raw ShareGPT as a variant; results in
#             /tmp/ablation (kept across calls: a later call continues) and $KEEP/ablation.md
#
# decode_one  one GPU: decode_speed.py's attention variants, then decode_bench.py for $CKPT ($CFG) with
#             each attention spec of $ATTNS at 96 new tokens and the first one at 512
#
# Needs /tmp/smollm2.gguf and /tmp/sharegpt.jsonl (scripts/gpu_runbook.sh's set-up does not make
# them: see docs/gpu-runbook.md). Step output goes to $OUT (the runbook gives each step its own).
# Env: STEPS (train.max_steps of train_pair, default 3500, and of train_regen / train_best, default 3000), KEEP (folder for files to bring back,
# default $OUT), REGEN_NEW (regen's --max-new-tokens; default the config's 512), TRAIN_OVERRIDES
# (train_regen / train_best: more config overrides, space-separated), DECODE_LONG (decode_one: 0 skips
# the 512-token bench).
set -u
step=$1
PY=${PY:-python3}
KEEP=${KEEP:-$OUT}
mkdir -p "$KEEP"
REAL=(target.path=/tmp/smollm2.gguf)
children=()
gpu_ids() { nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd,; }
# one GPU: the target and the drafter share it
ONE_GPU=()
[ "$(gpu_ids)" = 0 ] && ONE_GPU=("cluster.drafters=[0]" cluster.allow_shared_gpu=true)
trap 'for p in "${children[@]}"; do kill "$p" 2>/dev/null; done' EXIT TERM INT
# The regenerated data for training: /tmp/regen/turn1.jsonl, else .gpu/regen-turn1.jsonl.xz unpacked,
# else the complete rows of a cut-off regeneration's shards (-> /tmp/regen/partial.jsonl); sets REGEN_DATA.
regen_data() {
    mkdir -p /tmp/regen
    REGEN_DATA=/tmp/regen/turn1.jsonl
    [ -s $REGEN_DATA ] && return 0
    [ -f .gpu/regen-turn1.jsonl.xz ] && { xz -dc .gpu/regen-turn1.jsonl.xz >$REGEN_DATA; return; }
    REGEN_DATA=/tmp/regen/partial.jsonl
    $PY - /tmp/regen/turn1.jsonl.rank* >$REGEN_DATA <<'EOF'
import json, re, sys
for path in (p for p in sys.argv[1:] if re.search(r"\.rank[0-9]+$", p)):
    for line in open(path, encoding="utf-8"):
        try:
            json.loads(line)
        except ValueError:
            continue  # a row cut mid-write
        sys.stdout.write(line if line.endswith("\n") else line + "\n")
EOF
    [ -s $REGEN_DATA ] || { echo "no regenerated data: run the regen step first"; return 1; }
    echo "regeneration incomplete: training on the $(wc -l <$REGEN_DATA) rows its shards hold"
}

case $step in
regen)
    DFLASH_CACHE=/tmp/cacheA $PY -m dflash.inference.regenerate --config configs/smollm2-135m-h200-regen.yaml \
        --output /tmp/regen/turn1.jsonl --gpus "$(gpu_ids)" --batch-size "${REGEN_BATCH:-512}" \
        ${REGEN_NEW:+--max-new-tokens "$REGEN_NEW"} "${REAL[@]}" "${ONE_GPU[@]}" \
        data.dataset=/tmp/sharegpt.jsonl || exit
    xz -T16 -6 -c /tmp/regen/turn1.jsonl >"$KEEP/regen-turn1.jsonl.xz"
    ls -l /tmp/regen "$KEEP"
    ;;
train_pair)
    data_a=/tmp/regen/turn1.jsonl
    [ -s "$data_a" ] || { echo "no regenerated data: A trains on raw ShareGPT too"; data_a=/tmp/sharegpt.jsonl; }
    common=(--config configs/smollm2-135m-h200.yaml --overwrite "${REAL[@]}" log.wandb=disabled
            "cluster.targets=[0]" "cluster.drafters=[0]" cluster.allow_shared_gpu=true
            train.max_steps="${STEPS:-3500}" train.epochs=20 checkpoint.every=1000)
    CUDA_VISIBLE_DEVICES=0 DFLASH_CACHE=/tmp/cacheA $PY -m launch.cluster train "${common[@]}" \
        data.dataset="$data_a" run_dir=/tmp/runA >"$OUT/A.log" 2>&1 &
    children+=($!)
    CUDA_VISIBLE_DEVICES=1 DFLASH_CACHE=/tmp/cacheB $PY -m launch.cluster train "${common[@]}" \
        data.dataset=/tmp/sharegpt.jsonl run_dir=/tmp/runB >"$OUT/B.log" 2>&1 &
    children+=($!)
    wait "${children[0]}"; rc_a=$?
    wait "${children[1]}"; rc_b=$?
    for r in A B; do
        cp "/tmp/run$r/metrics.jsonl" "$OUT/metrics-$r.jsonl" 2>/dev/null
        cp "/tmp/run$r/config.yaml" "$OUT/config-$r.yaml" 2>/dev/null
        grep -h '"eval/' "/tmp/run$r/metrics.jsonl" 2>/dev/null | tail -n 3
    done
    echo "rc A $rc_a, B $rc_b"
    (( rc_a == 0 && rc_b == 0 ))
    ;;
decode_pair)
    for r in A B; do
        gpu=0; [ $r = B ] && gpu=1
        CUDA_VISIBLE_DEVICES=$gpu DFLASH_CACHE=/tmp/cacheA $PY -m scripts.decode_bench --config /tmp/runA/config.yaml \
            --checkpoint /tmp/run$r --prompts 16 --max-new-tokens 96 --modes compiled \
            --dtypes bfloat16,float32 --out "$OUT/decode-$r" >"$OUT/decode-$r.log" 2>&1 &
        children+=($!)
    done
    wait "${children[0]}"; rc_a=$?
    wait "${children[1]}"; rc_b=$?
    cat "$OUT"/decode-*/decode_bench.md
    $PY -m launch.cluster export --checkpoint /tmp/runA --out /tmp/exportA \
        && tar cf - -C /tmp exportA | split -b 15M - "$KEEP/exportA.tar.part-"
    echo "rc A $rc_a, B $rc_b"
    (( rc_a == 0 && rc_b == 0 ))
    ;;
multinode)
    port=29517
    conf=(--config configs/smollm2-135m-h200.yaml --nnodes 2 --master-addr 127.0.0.1 --master-port $port)
    over=("cluster.nodes=[{targets: [0]}, {drafters: [0]}]" log.wandb=disabled run_dir=/tmp/mn2
          train.max_steps="${MN_STEPS:-400}" checkpoint.every=0 train.eval_every=1000 "${REAL[@]}"
          data.dataset=/tmp/sharegpt.jsonl)
    CUDA_VISIBLE_DEVICES=1 DFLASH_CACHE=/tmp/cacheB $PY -m launch.cluster train "${conf[@]}" --node-rank 1 \
        "${over[@]}" >"$OUT/node1.log" 2>&1 &
    children+=($!)
    CUDA_VISIBLE_DEVICES=0 DFLASH_CACHE=/tmp/cacheB $PY -m launch.cluster train "${conf[@]}" --node-rank 0 \
        "${over[@]}" >"$OUT/node0.log" 2>&1
    rc0=$?
    wait "${children[0]}"; rc1=$?
    cp /tmp/mn2/metrics.jsonl "$OUT/metrics-mn2.jsonl" 2>/dev/null
    tail -n 5 "$OUT/node0.log" "$OUT/node1.log"
    echo "rc node 0 $rc0, node 1 $rc1"
    (( rc0 == 0 && rc1 == 0 ))
    ;;
train_regen|train_best)
    # the regeneration recipe on both GPUs (target on 0, drafter on 1), on regenerated data that is
    # already there (/tmp/regen/turn1.jsonl, or .gpu/regen-turn1.jsonl.xz unpacked) -> /tmp/run-regen;
    # train_best: with the ablation's stacked recipe (/tmp/ablation/recipe.json) -> /tmp/run-best
    regen_data || exit
    run=/tmp/run-regen recipe=()
    if [ "$step" = train_best ]; then
        run=/tmp/run-best
        [ -s /tmp/ablation/recipe.json ] || { echo "no /tmp/ablation/recipe.json: run the ablation step first"; exit 2; }
        mapfile -t recipe < <($PY -c 'import json, sys; sys.stdout.write("".join(o + "\n" for o in json.load(open(sys.argv[1]))["overrides"]))' \
            /tmp/ablation/recipe.json)
        echo "stacked recipe: ${recipe[*]:-(none beat the baseline: the base config)}"
    fi
    DFLASH_CACHE=/tmp/cacheA $PY -m launch.cluster train --config configs/smollm2-135m-h200-regen.yaml --overwrite \
        "${REAL[@]}" regenerate.enabled=false data.dataset=$REGEN_DATA run_dir=$run \
        train.max_steps="${STEPS:-3000}" "${ONE_GPU[@]}" "${recipe[@]}" ${TRAIN_OVERRIDES:-} >"$OUT/train.log" 2>&1
    rc=$?
    cp $run/metrics.jsonl "$OUT/metrics.jsonl" 2>/dev/null
    cp $run/config.yaml "$OUT/config.yaml" 2>/dev/null
    tail -n 4 "$OUT/train.log"
    exit $rc
    ;;
decode_regen)
    # /tmp/run-regen's drafter: 96 new tokens (bf16 and fp32) on GPU 0, 512 (bf16) on GPU 1, at once
    for n in 96 512; do
        gpu=0 dtypes=bfloat16,float32
        [ $n = 512 ] && gpu=1 dtypes=bfloat16
        CUDA_VISIBLE_DEVICES=$gpu DFLASH_CACHE=/tmp/cacheA $PY -m scripts.decode_bench --config /tmp/run-regen/config.yaml \
            --checkpoint /tmp/run-regen --prompts 16 --max-new-tokens $n --modes compiled --dtypes $dtypes \
            --attention "${ATTN:-sdpa}" --out "$OUT/decode-$n" >"$OUT/decode-$n.log" 2>&1 &
        children+=($!)
    done
    wait "${children[0]}"; rc_a=$?
    wait "${children[1]}"; rc_b=$?
    cat "$OUT"/decode-*/decode_bench.md
    $PY -m launch.cluster export --checkpoint /tmp/run-regen --out /tmp/export-regen \
        && tar cf - -C /tmp export-regen | split -b 15M - "$KEEP/export-regen.tar.part-"
    echo "rc 96: $rc_a, 512: $rc_b"
    (( rc_a == 0 && rc_b == 0 ))
    ;;
ablation)
    regen_data || exit
    gpus=$(gpu_ids)
    raw=(); [ -s /tmp/sharegpt.jsonl ] && raw=(--variant raw-sharegpt=data.dataset=/tmp/sharegpt.jsonl)
    DFLASH_CACHE=/tmp/cacheA $PY scripts/ablation.py --gpus "$gpus" --per-gpu "${ABL_PER_GPU:-1}" --steps "${ABL_STEPS:-1000}" \
        ${ABL_VARIANTS:+--variants "$ABL_VARIANTS"} "${raw[@]}" --out /tmp/ablation --work /tmp/ablation-runs \
        "${REAL[@]}" regenerate.enabled=false data.dataset=$REGEN_DATA
    rc=$?
    cp /tmp/ablation/ablation.md /tmp/ablation/ablation.json "$KEEP/" 2>/dev/null
    cat /tmp/ablation/ablation.md
    exit $rc
    ;;
decode_one)
    # one GPU: the attention variants' decoding speed (random weights, prompts of 480 tokens as long
    # as the held-out ones; SPEED_MODES=none skips it), then drafter $CKPT (default /tmp/run-regen, config $CFG) over 16
    # held-out prompts at 96 new tokens with each spec of $ATTNS (the first in bf16 and fp32, the
    # others in bf16), and at 512 new tokens (bf16) with the first spec that ran
    ckpt=${CKPT:-/tmp/run-regen} cfg=${CFG:-/tmp/run-regen/config.yaml} attns=(${ATTNS:-flex+sdpa sdpa})
    rc=0 ran=""
    if [ "${SPEED_MODES:-}" != none ]; then
        $PY scripts/decode_speed.py --out "$OUT/speed" --prompts 4 --prompt-tokens 480 --profile \
            --modes "${SPEED_MODES:-compiled,compiled-reduce,compiled-reduce+sdpa}" >"$OUT/speed.log" 2>&1 || rc=1
    fi
    bench() {  # attention spec, new tokens, dtypes
        DFLASH_CACHE=/tmp/cacheA $PY -m scripts.decode_bench --config "$cfg" --checkpoint "$ckpt" --prompts 16 \
            --max-new-tokens "$2" --modes compiled --dtypes "$3" --attention "$1" --out "$OUT/decode-$2-$1" \
            >"$OUT/decode-$2-$1.log" 2>&1
        local r=$?
        cat "$OUT/decode-$2-$1/decode_bench.md" 2>/dev/null || tail -n 5 "$OUT/decode-$2-$1.log"
        return $r
    }
    dtypes=bfloat16,float32
    for a in "${attns[@]}"; do
        if bench "$a" 96 $dtypes; then ran=${ran:-$a}; else rc=1; fi
        dtypes=bfloat16
    done
    [ -n "$ran" ] && [ "${DECODE_LONG:-1}" != 0 ] && { bench "$ran" 512 bfloat16 || rc=1; }
    exit $rc
    ;;
*) echo "unknown step $step (regen, train_pair, decode_pair, multinode, train_regen, train_best, decode_regen, ablation, decode_one)"; exit 2 ;;
esac
