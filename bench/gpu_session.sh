#!/usr/bin/env bash
# The benchmark runs of one GPU session, split so each part fits one 10-minute device call.
# Run from the repository root on the GPU machine; results go to $OUT (default ./gpu-out).
#
#   bash bench/gpu_session.sh examples   # bench/run.py (3 examples) + skinny GEMMs + GPU tests
#   bash bench/gpu_session.sh decode     # bench/decode.py: batch 1 at 2048 and 32768, agreement
#   bash bench/gpu_session.sh batched    # bench/decode.py: batch 32 at 2048, and prefill of 2048
#   bash bench/gpu_session.sh core       # decode b1 and b32 at 2048 + the GPU tests of the decode templates
#   bash bench/gpu_session.sh pair       # two GPUs (nvidia-h200-x2), in parallel: GPU 0 examples then
#                                        # GPU tests, GPU 1 decode (3 cases, bf16 and fp8 KV)
#                                        # (session 3: every step overran its limit, the two jobs
#                                        # sharing the host's CPUs; one job per call is safer)
#
# Every step has its own time limit, so a slow step costs its own results, not the others'.
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() {  # step SECONDS NAME COMMAND...: run, log to $OUT/NAME.log, print the log's tail
    local limit=$1 name=$2
    shift 2
    echo "== $name (limit ${limit}s)"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $?"
    grep -v "^    \|AUTOTUNE\|triton_\|^  mm\|^  bmm\|Warning\|return cls" "$OUT/$name.log" | tail -15
}
case "${1:-}" in
    examples)
        # session 4: minigpt's max-autotune alone took 128 s; 330 s cut the Llama layer's build
        step 540 run python bench/run.py --out "$OUT/run.json" --build-dir /tmp/coopt-bench
        for e in mlp minigpt_block llama_layer; do cp "/tmp/coopt-bench/$e/report.md" "$OUT/report_$e.md" 2>/dev/null; done
        step 90 gemm python bench/gemm.py --quick --shapes skinny,decode
        step 150 pytest python -m pytest -q -x -p no:cacheprovider tests/templates tests/e2e/test_cuda_graph.py tests/llama/test_llama_generate.py
        ;;
    decode)
        step 560 decode python bench/decode.py --cases 1:2048:4096,1:32768:32832 --prefill 0 \
            --out "$OUT/decode.json" --build-dir /tmp/coopt-decode
        cp /tmp/coopt-decode/b1-pos2048/report.md "$OUT/report_decode_b1_2048.md" 2>/dev/null
        ;;
    batched)
        step 560 batched python bench/decode.py --cases 32:2048:4096 --prefill 2048 \
            --out "$OUT/batched.json" --build-dir /tmp/coopt-decode
        ;;
    core)  # one call: decode b1 and b32 at 2048 (issue 3's core cases) + the GPU template tests
        step 400 decode python bench/decode.py --cases 1:2048:4096,32:2048:4096 --modes eager,reduce-overhead,coopt \
            --prefill 0 --agreement-steps 16 --out "$OUT/decode.json" --build-dir /tmp/coopt-decode
        cp /tmp/coopt-decode/b1-pos2048/report.md "$OUT/report_decode_b1_2048.md" 2>/dev/null
        cp /tmp/coopt-decode/b32-pos2048/report.md "$OUT/report_decode_b32_2048.md" 2>/dev/null
        step 150 pytest python -m pytest -q -p no:cacheprovider tests/templates/test_matmul_gemv_fusions.py \
            tests/templates/test_decode_attention.py tests/templates/test_decode_attention_rope.py \
            tests/templates/test_kv_write_paged.py tests/templates/test_kv_write_per_row.py tests/templates/test_rope.py \
            tests/e2e/test_cuda_graph.py tests/llama/test_llama_generate.py
        ;;
    pair)
        # at most 8 files come back from a device call: the reports travel as one archive
        (
            export CUDA_VISIBLE_DEVICES=0
            step 330 run python bench/run.py --out "$OUT/run.json" --build-dir /tmp/coopt-bench
            step 220 pytest python -m pytest -q -p no:cacheprovider tests/templates tests/e2e/test_cuda_graph.py tests/llama/test_llama_generate.py
        ) > /tmp/gpu0.txt 2>&1 &
        (
            export CUDA_VISIBLE_DEVICES=1
            step 560 decode python bench/decode.py --cases 1:2048:4096,32:2048:4096,1:32768:32832 \
                --modes eager,reduce-overhead,coopt,coopt-fp8 --prefill 0 --agreement-steps 16 \
                --out "$OUT/decode.json" --build-dir /tmp/coopt-decode
        ) > /tmp/gpu1.txt 2>&1 &
        wait
        cat /tmp/gpu0.txt /tmp/gpu1.txt
        out_dir=$(cd "$OUT" && pwd)
        (cd /tmp && find coopt-bench coopt-decode -maxdepth 2 \( -name report.md -o -name build.json \) \
            | tar czf "$out_dir/reports.tar.gz" -T -)
        ;;
    *)
        echo "usage: bash bench/gpu_session.sh examples|decode|batched|core|pair" >&2
        exit 2
        ;;
esac
