#!/usr/bin/env bash
# dsdoctor compare on the GPU machine: plain vs ZeRO-3 vs tensor parallel for a 7B-shaped Llama (random
# weights, bf16), with real DeepSpeed ranks (torchrun when the deepspeed launcher is absent).
#
#   bash bench/compare/run_gpu.sh "$OUT/compare"
#
# Env: LAYERS (default 32: the full 7B shape), GPUS (default: 2, or 1 on a single-GPU machine),
# MODEL_DIR (default /tmp/dsdoctor-compare-7b, reused when the shape matches), PYTHON (default python3),
# NEW_TOKENS (default 16); for a CPU smoke test only: MODEL_ARGS (extra make_model.py flags), DTYPE.
# Writes into OUT: model.json, compare.txt, compare.json, report/ (report.md, report.json, raw runs, worker
# logs), bench.json (timings, exit code).
set -uo pipefail
OUT=${1:?usage: run_gpu.sh OUT_DIR}
PY=${PYTHON:-python3}
LAYERS=${LAYERS:-32}
MODEL_DIR=${MODEL_DIR:-/tmp/dsdoctor-compare-7b}
NEW_TOKENS=${NEW_TOKENS:-16}
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
GPUS=${GPUS:-$(( NGPU >= 2 ? 2 : 1 ))}
echo "expect: a ${LAYERS}-layer 7B-shaped Llama built on the GPU and saved (~$(( LAYERS * 405 / 1000 + 1 )) GiB), then"
echo "        plain vs zero3 vs tp (${DTYPE:-bf16}, ${GPUS} ranks): zero3 identical or within tolerance, tp within"
echo "        tolerance or near-tie splits only; about 4-5 minutes in all on 2 x H200"

t0=$(date +%s)
$PY bench/compare/make_model.py "$MODEL_DIR" --layers "$LAYERS" ${MODEL_ARGS:-} | tee "$OUT/model.json" || exit 1
t1=$(date +%s)
$PY -m dsdoctor compare "$MODEL_DIR" --paths plain,zero3,tp --gpus "$GPUS" --dtype "${DTYPE:-bf16}" \
    --max-new-tokens "$NEW_TOKENS" --timeout 240 --out "$OUT/report" --force > "$OUT/compare.txt"
rc=$?
t2=$(date +%s)
cat "$OUT/compare.txt"
cp "$OUT/report/report.json" "$OUT/compare.json" 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>/dev/null
printf '{"layers": %s, "gpus": %s, "model_s": %s, "compare_s": %s, "compare_exit": %s}\n' \
    "$LAYERS" "$GPUS" "$((t1 - t0))" "$((t2 - t1))" "$rc" | tee "$OUT/bench.json"
# exit 0 when dsdoctor itself ran (0 match, 1 mismatch found); 2 means bad input or an internal error
[ "$rc" -le 1 ]
