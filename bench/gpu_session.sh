#!/usr/bin/env bash
# The benchmark runs of one GPU session, split so each part fits one 10-minute device call.
# Run from the repository root on the GPU machine; results go to $OUT (default ./gpu-out).
#
#   bash bench/gpu_session.sh examples   # bench/run.py (3 examples) + skinny GEMMs + GPU tests
#   bash bench/gpu_session.sh decode     # bench/decode.py: batch 1 at 2048 and 32768, agreement
#   bash bench/gpu_session.sh batched    # bench/decode.py: batch 32 at 2048, and prefill of 2048
#   bash bench/gpu_session.sh core       # decode b1 and b32 at 2048 + the GPU tests of the decode templates
#   bash bench/gpu_session.sh core-pdl   # decode b1 and b32 at 2048, each step profiled with PDL off and on
#   bash bench/gpu_session.sh fp8-b1     # bf16 vs fp8 KV decode, b1 at 32768 and 131072 (~8 min)
#   bash bench/gpu_session.sh fp8-b32 / fp8-b32-8192  # bf16 vs fp8 KV decode, b32 at 2048 / at 8192 (~6 / ~7 min)
#   bash bench/gpu_session.sh fp8-b1-32768  # b1 at 32768 only: reduce-overhead, coopt, coopt-fp8 (~7 min)
#   bash bench/gpu_session.sh issue3     # b1 and b32 at 2048 in every mode (~9 min)
#   bash bench/gpu_session.sh prefill    # the 2048-token prompt in every mode: tokens/s (~6-8 min)
#   bash bench/gpu_session.sh sweep      # decode attention + GEMV: advised points vs a sample of the space, L2 prefetch (~9 min)
#   bash bench/gpu_session.sh accuracy   # bench/accuracy.py --config small --steps 2000 on the GPU
#   bash bench/gpu_session.sh layers32   # 32 layers, b1 / 2048, all modes incl. max-autotune-no-cudagraphs
#   bash bench/gpu_session.sh layers32-2048  # 32 layers at b1 and b32 / 2048 in one call (eager, reduce-overhead, coopt; ~9 min)
#   bash bench/gpu_session.sh layers32-b32 / layers32-long   # 32 layers at b32 / 2048 and at b1 / 32768
#   bash bench/gpu_session.sh layers32-rest  # both of those in one call (eager, reduce-overhead, coopt)
#   bash bench/gpu_session.sh prefill-quick  # the 2048-token prompt without max-autotune, then the unchunked 131072 coopt prefill
#   bash bench/gpu_session.sh sweep-fp8  # fp8 decode attention at b32 / 2048 and 8192: advised points vs a sample
#   bash bench/gpu_session.sh gpu-tests  # GPU runs of the paged prompt attention, GEMV forms, decode attention, PagedDecoder graphs
#   bash bench/gpu_session.sh long       # bench/long_prefill.py: a 131072-token prompt (8 layers), whole and
#                                        # in chunks of 4096, eager and coopt: time, peak memory (~7-9 min)
#   bash bench/gpu_session.sh long-quick # the same at 16384 tokens (~4-6 min)
#   bash bench/gpu_session.sh capacity   # bench/capacity.py --throughput: PagedDecoder.step() (graph-replayed) at capacity,
#                                        # paged bf16 / static / paged fp8, 8 layers, 4 GiB of KV (~6-8 min)
#   bash bench/gpu_session.sh accuracy-smooth   # the harness: bf16, per-head, smoothed K, smoothed K and V only
#   bash bench/gpu_session.sh gemv-sweep # the CUDA GEMV's GPU tests and points on the b1 GEMVs, norm or not (~8 min)
#   bash bench/gpu_session.sh gemv-align # the CUDA families' GPU tests, fp8 attention alone, the CUDA GEMV's sweep (~8 min)
#   bash bench/gpu_session.sh gemv-pdl-chain  # the family's o -> gate|up -> down with and without PDL (~2 min)
#   bash bench/gpu_session.sh mma-bf16   # the CUDA attention over bf16 caches: GPU tests, its kernel beside the template's (~4 min)
#   bash bench/gpu_session.sh mma-bf16-sass  # ncu source counters of the bf16 CUDA attention's bare / rope / folded launches (~3 min)
#   bash bench/gpu_session.sh mma-bf16-2048  # b1 / 2048 bf16 built with both CUDA families (~4 min)
#   bash bench/gpu_session.sh mma-bf16-b32  # b32 / 2048 bf16 with the CUDA attention (~5 min)
#   bash bench/gpu_session.sh layers32-2048-quick  # 32 layers at b32 and b1 / 2048, reduce-overhead and coopt (~9.5 min)
#   bash bench/gpu_session.sh layers32-fp8  # 32 layers at b1 / 32768, coopt-fp8 only (~5 min)
#   bash bench/gpu_session.sh fp8-b32-quick  # b32 / 2048 coopt-fp8 beside reduce-overhead, nothing else (~4 min)
#   bash bench/gpu_session.sh attention-b32-stream  # b32 attention points (ring depth, chunk, warps) beside their loads alone (~3 min)
#   bash bench/gpu_session.sh mlp-dataflow  # b32 gate|up + down as one launch whose down tasks wait only for their inputs (~3 min)
#   bash bench/gpu_session.sh tma-gemv   # the b32 GEMMs: TMA-fed split GEMV against pointer loads, cuBLAS, the template (~1 min)
#   bash bench/gpu_session.sh layers32-b32-quick  # 32 layers at b32 / 2048 alone, reduce-overhead and coopt (~7 min)
#   bash bench/gpu_session.sh h200-missed  # on an H200: 32 layers at b1 / 2048, then b32 / 2048 fp8 (~9.5 min)
#   bash bench/gpu_session.sh transformers-decode  # transformers' own Llama, 8 layers, b1 and b32 / 2048 (~9 min;
#                                        # first ../shared/tools/device-wheels.sh transformers==5.18.0 here)
#   bash bench/gpu_session.sh prefetch-bulk  # the o weights bulk-prefetched into L2 during the b1 / 2048 attention (~2 min)
#   bash bench/gpu_session.sh layers32-b1-quick  # 32 layers at b1 / 2048, reduce-overhead and coopt (~5 min)
#   bash bench/gpu_session.sh gemv-ncu   # the CUDA GEMV's GPU tests, then ncu on it with and without its norm (~3 min)
#   bash bench/gpu_session.sh kv-probe   # bench/fp8_kv_probe.py: fp8 K/V rounding variants in eager against bf16 (~1-2 min)
#   bash bench/gpu_session.sh kv-probe-recent  # the same with each query's newest rows exact (session 42's lead, ~2 min)
#   bash bench/gpu_session.sh attention-latency  # the decode attention's fixed cost against its streaming, b1 (~2-3 min)
#   bash bench/gpu_session.sh fold-profile-b1  # both b1 builds (folded, unfolded) profiled kernel by kernel (~6 min)
#   bash bench/gpu_session.sh fp8-values / accuracy-values  # values-only fp8 KV: latency at b32 / 2048, accuracy
#   bash bench/gpu_session.sh normstats-b32  # b32 / 2048: default against default without fuse-norm-statistics, profiled (~9 min)
#   bash bench/gpu_session.sh values-now   # values-only b1 / 32768 and b32 / 2048 beside reduce-overhead (~9 min)
#   BASE=dir bash bench/gpu_session.sh mma-prologues  # the CUDA attention's GPU tests; its kernel beside BASE's (~6 min)
#   bash bench/gpu_session.sh mma-cluster  # the CUDA attention's cluster meeting: GPU tests, its kernel beside the global meeting (~5 min)
#   bash bench/gpu_session.sh exact-recent  # the harness with fp8-recent, its kernel's GPU tests, a transformers GPU test (~9.5 min)
#   bash bench/gpu_session.sh fp8-recent-b32  # b32 / 2048: reduce-overhead, coopt-fp8, coopt-fp8-recent (~6 min)
#   bash bench/gpu_session.sh fp8-recent-mma  # the CUDA attention's exact-recent GPU tests, then fp8-recent-b32 (~8.5 min)
#   bash bench/gpu_session.sh fp8-recent-fold  # exact-recent's folded write's GPU tests, then fp8-recent-b32 (~9.5 min)
#   bash bench/gpu_session.sh gemv-timeline  # the b32 GEMVs' programs stamped: ramp, loop, tail, epilogue, gaps (~4 min)
#   bash bench/gpu_session.sh gemv-points  # the b32 GEMVs at other points (no split-K meeting, more programs) and the
#                                        # early epilogue loads' GPU tests (~3 min)
#   bash bench/gpu_session.sh points-fp8-b32  # gemv-points' probe, embedding_rows' GPU tests, b32 / 2048
#                                        # reduce-overhead and coopt-fp8 (~7 min)
#   bash bench/gpu_session.sh flag-fp8-b32  # the GEMV's flag meeting: its GPU tests, o and down with it against the
#                                        # count meeting, then status-fp8-b32 (~8.5 min)
#   bash bench/gpu_session.sh status-fp8-b32  # b32 / 2048 reduce-overhead and coopt-fp8, the step profiled without
#                                        # PDL and with it for the GEMVs (~8 min)
#   bash bench/gpu_session.sh e2e-tests-1 / e2e-tests-2 / e2e-tests-3 / e2e-tests-4  # tests/e2e on the GPU, four calls (~4-8 min each)
#   bash bench/gpu_session.sh lengths-fold  # the lengths' + 1 in the attention kernels: their GPU tests and builds' (~8 min)
#   bash bench/gpu_session.sh window-warps  # the window spread over warps: its GPU tests, then b1 / 32768 fp8 vs fp8-recent (~8 min)
#   bash bench/gpu_session.sh fp8-recent-b32-profile  # fp8-recent-b32, then both fp8 builds' steps profiled (~8.5 min)
#   bash bench/gpu_session.sh fp8-recent-b1  # b1 / 32768: reduce-overhead, coopt-fp8, coopt-fp8-recent (~7 min)
#   bash bench/gpu_session.sh paged-recent  # exact-recent through pages: the kernels' and PagedDecoder's GPU tests (~4 min)
#   bash bench/gpu_session.sh pending-43  # session 43's exact-recent tests, transformers' remaining GPU tests (~9 min)
#   bash bench/gpu_session.sh pending    # sessions 39-41's CPU work built and run on the GPU (~5 min)
#   bash bench/gpu_session.sh mma-values   # the CUDA attention over values-only caches: GPU tests, both values-only builds (~9.5 min)
#   bash bench/gpu_session.sh fp8-values-b1  # values-only and both-fp8 at b1 / 32768 and 131072 (~8 min)
#   bash bench/gpu_session.sh pdl-kinds-b32  # b32 / 2048 profiled with PDL off, on for the GEMVs only, off again (~8 min)
#   bash bench/gpu_session.sh fold-tests  # the folded fp32 steps' GPU tests, first failure with its traceback (~1 min)
#   bash bench/gpu_session.sh core-launch  # b1 and b32 at 2048 (coopt; each build times its step with and
#                                        # without PDL for the GEMVs and keeps the faster), both profiled (~8 min)
#   bash bench/gpu_session.sh normstats-chunk-b32  # b32 / 2048: the norm sums over 64- (default) and 32-column chunks, profiled (~9 min)
#   bash bench/gpu_session.sh launch-tests  # the GPU tests of session 15: the fold, its one-key exactness, the launch choice (~2 min)
#   bash bench/gpu_session.sh stream-k   # stream-K GEMVs (session 20; measured slower in session 21) beside the advisor's first points,
#                                        # one Llama layer's GEMVs at b1 and b32 and the skinny shapes, then its GPU tests (~7 min)
#   bash bench/gpu_session.sh fp8-warps  # fp8 decode attention at 8 warps against 4 (kernels, then the b1 / 32768 build; ~9 min)
#   bash bench/gpu_session.sh fp8-fold-b1  # the fp8 write folded into the attention against unfolded, both fp8
#                                        # and values-only, b1 / 32768, after the fold's GPU tests (~9 min)
#   bash bench/gpu_session.sh fp8-fold-profile-b1  # both fp8 b1 / 32768 builds (folded, not) profiled (~8 min)
#   bash bench/gpu_session.sh leads-22   # session 22's three kernel questions in one call: stats32, fp8-stages' two sweeps (~9.5 min)
#   bash bench/gpu_session.sh gpu-all    # every test marked gpu (pytest -m gpu), the fast Hypothesis profile (~5 min)
#   bash bench/gpu_session.sh residual32 # the b32 o and down GEMVs (+ residual): advised 8 vs 40 sampled (~6 min)
#   bash bench/gpu_session.sh stats32    # the b32 output head, q|k|v, gate|up (norm statistics' form): advised 8 vs 24 sampled (~6 min)
#   bash bench/gpu_session.sh fp8-stages # fp8 decode attention at pipeline depths 2-6 (past the space's 4), b1 / 32768 and b32 / 2048,
#                                        # then split counts 24-48 at b1 / 32768 (~5 min)
#   bash bench/gpu_session.sh qkv-attention  # the q|k|v GEMV and the decode attention in one launch (bench/qkv_attention_probe.py)
#                                        # against the template pair, b1 at 2048 and 32768 (~5 min)
#   bash bench/gpu_session.sh cuda-attention  # the CUDA decode attention whose splits meet through a cluster
#                                        # (bench/cuda_attention_probe.py, NVRTC): its GPU tests, then against the template, b1 (~4 min)
#   bash bench/gpu_session.sh cuda-fp8    # a CUDA fp8 decode attention on tensor cores (bench/cuda_fp8_attention_probe.py,
#                                        # NVRTC): its GPU tests, then against the template's advised points, b1 (~5 min)
#   bash bench/gpu_session.sh cuda-fp8-ncu  # its L2 -> SM traffic (2x the cache with compute, 1x loads alone)
#                                        # beside the template's and each ablation's (ncu metrics, ~1 min)
#   bash bench/gpu_session.sh cuda-fp8-copies  # its tests, then cp.async past / through the L1 against bulk (TMA)
#                                        # copies, b1 / 32768 and 131072 (~5 min)
#   bash bench/gpu_session.sh mma         # the CUDA fp8 decode attention family: GPU tests, b1 / 32768 fp8 built with it
#   bash bench/gpu_session.sh mma-131072  # its kernel bare / with rope / folded against the template, then b1 / 131072 fp8
#   bash bench/gpu_session.sh mma-32768   # its tests, its kernel bare / rope / folded beside the probe's, b1 / 32768 fp8
#   bash bench/gpu_session.sh mma-b32     # b32 / 2048 fp8 built with the CUDA family beside the template
#   bash bench/gpu_session.sh mma-next    # its GPU tests (the paged form's first run), then mma-ncu: session 27's first
#   bash bench/gpu_session.sh mma-sass    # the SASS of the family's kernel and the probe's as this machine builds them,
#                                        # and ncu's executed count of each instruction, b1 / 32768 (~3 min)
#   bash bench/gpu_session.sh mma-rope    # ncu source counters of the family's kernel with the query's rope (its 1.3 µs
#                                        # over bare, b1 / 32768), then mma-b32 (4 warps ranked first): session 28's first (~8 min)
#   bash bench/gpu_session.sh mma-ncu     # ncu: the family's kernel (bare / rope / folded) beside the probe's, b1 / 32768
#   bash bench/gpu_session.sh fp8-l2      # cuda-fp8-ncu then cuda-fp8-copies in one call (~7 min): session 26's first
#   bash bench/gpu_session.sh gemv-chain  # o, gate|up, down at b1 as one persistent launch with grid-wide meetings
#                                        # (bench/gemv_chain_probe.py) against one launch each and the template GEMVs (~5 min)
#   bash bench/gpu_session.sh v-layout   # fp8 decode attention with V stored keys-contiguous against row-major, fixed points (~5 min)
#   bash bench/gpu_session.sh v-words    # fp8 decode attention, V read as words against bytes, advised points (~5 min)
#   bash bench/gpu_session.sh fold-gpu    # the fold's GPU tests (templates, verified builds, launch) and fold-kernels (~6 min)
#   bash bench/gpu_session.sh fold-fix    # the fold's build tests (repros probed), template tests, fold-kernels (~10 min)
#   bash bench/gpu_session.sh fold-kernels  # the folded attention alone against kv_write + attention, fixed points (~3 min)
#   bash bench/gpu_session.sh fold-b1 / fold-b32  # coopt (kv_write folded into the decode attention) against
#                                        # coopt-unfolded, b1 / b32 at 2048, same run; fold-b1 adds its GPU tests
#   bash bench/gpu_session.sh parallel capacity long   # one step per GPU (nvidia-h200-x2 / -x4), at once;
#                                        # every file comes back in $OUT/parallel.tar.gz (session 3: two
#                                        # jobs sharing the host's CPUs overran their limits; pick steps
#                                        # with slack); `parallel kv-probe+long-eager fp8-b32`: two
#                                        # steps one after the other on GPU 0
#
# Every step has its own time limit, so a slow step costs its own results, not the others'.
set -uo pipefail
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() {  # step SECONDS NAME COMMAND...: run, log to $OUT/NAME.log, print the log's tail; the command's status
    local limit=$1 name=$2 status
    shift 2
    echo "== $name (limit ${limit}s)"
    # SIGINT first: pytest then prints its summary (the failures' names), a script its traceback
    timeout -s INT -k 15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    status=$?
    echo "== $name: exit $status"
    grep -v "^    \|AUTOTUNE\|triton_\|^  mm\|^  bmm\|Warning\|return cls" "$OUT/$name.log" | tail -15
    return $status
}
reports() {  # reports NAME DIR...: every build's report.md and build.json under DIRs as one $OUT/NAME.tar.gz
    # (at most 8 files come back from a device call: session 5 lost two reports to that limit)
    local name=$1
    shift
    (cd /tmp && find "$@" -maxdepth 2 \( -name report.md -o -name build.json \) 2>/dev/null \
        | tar czf "$OUT/$name.tar.gz" -T -)
}
case "${1:-}" in
    examples)
        # session 4: minigpt's max-autotune alone took 128 s; 330 s cut the Llama layer's build
        step 540 run python bench/run.py --out "$OUT/run.json" --build-dir /tmp/coopt-bench
        reports reports_examples coopt-bench
        step 90 gemm python bench/gemm.py --quick --shapes skinny,decode
        step 150 pytest python -m pytest -q -x -p no:cacheprovider tests/templates tests/e2e/test_cuda_graph.py tests/llama/test_llama_generate.py
        ;;
    decode)
        step 560 decode python bench/decode.py --cases 1:2048:4096,1:32768:32832 --prefill 0 \
            --out "$OUT/decode.json" --build-dir /tmp/coopt-decode
        reports reports_decode coopt-decode
        ;;
    batched)
        step 560 batched python bench/decode.py --cases 32:2048:4096 --prefill 2048 \
            --out "$OUT/batched.json" --build-dir /tmp/coopt-decode
        ;;
    core)  # one call: decode b1 and b32 at 2048 (issue 3's core cases) + the GPU template tests
        step 400 decode python bench/decode.py --cases 1:2048:4096,32:2048:4096 --modes eager,reduce-overhead,coopt \
            --prefill 0 --agreement-steps 16 --out "$OUT/decode.json" --build-dir /tmp/coopt-decode
        reports reports_decode coopt-decode
        step 150 pytest python -m pytest -q -p no:cacheprovider tests/templates/test_matmul_gemv_fusions.py \
            tests/templates/test_decode_attention.py tests/templates/test_decode_attention_rope.py \
            tests/templates/test_kv_write_paged.py tests/templates/test_kv_write_per_row.py tests/templates/test_rope.py \
            tests/e2e/test_cuda_graph.py tests/llama/test_llama_generate.py
        ;;
    core-pdl)  # one call: decode b1 and b32 at 2048, then each build's replayed step profiled without and with PDL
        step 360 decode python bench/decode.py --cases 1:2048:4096,32:2048:4096 --modes eager,reduce-overhead,coopt \
            --prefill 0 --agreement-steps 16 --out "$OUT/decode.json" --build-dir /tmp/coopt-decode
        reports reports_decode coopt-decode
        # (session 5: a b32 profile took more than 40 s, a b1 profile ~25 s)
        for pdl in 0 1; do
            regions=$([ "$pdl" = 0 ] && echo --regions)  # per-region time and bandwidth, once
            COOPT_PDL=$pdl step 60 "profile_b1_pdl$pdl" python bench/profile_step.py /tmp/coopt-decode/b1-pos2048 \
                $regions --out "$OUT/profile_b1_pdl$pdl.json"
            [ "$pdl" = 1 ] && break  # (b32 with PDL: the call's 600 s do not hold it)
            COOPT_PDL=$pdl step 90 "profile_b32_pdl$pdl" python bench/profile_step.py /tmp/coopt-decode/b32-pos2048 \
                --batch 32 $regions --out "$OUT/profile_b32_pdl$pdl.json"
        done
        ;;
    fp8-b1)  # issue 4: bf16 vs fp8 KV at batch 1, positions 32768 and 131072 (fp8 tiles widened to fp16 first)
        step 560 decode python bench/decode.py --cases 1:32768:32832,1:131072:131136 --modes reduce-overhead,coopt,coopt-fp8 \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_fp8_b1.json" --build-dir /tmp/coopt-fp8
        reports reports_fp8_b1 coopt-fp8
        ;;
    fp8-b1-32768)  # issues 3 and 4: b1 / 32768 alone, reduce-overhead, coopt bf16 and fp8 KV in one run (~7 min)
        step 540 decode python bench/decode.py --cases 1:32768:32832 --modes reduce-overhead,coopt,coopt-fp8 \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_b1_32768.json" --build-dir /tmp/coopt-fp8
        reports reports_b1_32768 coopt-fp8
        ;;
    fp8-b32)  # issue 4: bf16 vs fp8 KV at batch 32, position 2048 (~6 min; both positions no longer fit one
        # call: session 23's builds took 134-167 s each, and the 560 s limit cut 8192 after reduce-overhead)
        step 560 decode python bench/decode.py --cases 32:2048:4096 --modes reduce-overhead,coopt,coopt-fp8 \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_fp8_b32.json" --build-dir /tmp/coopt-fp8
        reports reports_fp8_b32 coopt-fp8
        ;;
    fp8-b32-quick)  # issue 4, session 37: the fp8 row alone, b32 / 2048 coopt-fp8 beside reduce-overhead (~4 min)
        step 400 decode python bench/decode.py --cases 32:2048:4096 --modes reduce-overhead,coopt-fp8 \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_fp8_b32.json" --build-dir /tmp/coopt-fp8
        reports reports_fp8_b32 coopt-fp8
        ;;
    fp8-b32-8192)  # issue 4: the same at position 8192 (~7 min; session 23: 411 s)
        step 560 decode python bench/decode.py --cases 32:8192:8256 --modes reduce-overhead,coopt,coopt-fp8 \
            --prefill 0 --agreement-steps 4 --out "$OUT/decode_fp8_b32_8192.json" --build-dir /tmp/coopt-fp8
        reports reports_fp8_b32_8192 coopt-fp8
        ;;
    layers32)  # issue 3: the full 32 layers at b1 / 2048 against every mode (max-autotune-no-cudagraphs last)
        step 560 decode python bench/decode.py --layers 32 --cases 1:2048:4096 \
            --modes eager,reduce-overhead,coopt,max-autotune-no-cudagraphs --prefill 0 --agreement-steps 8 \
            --out "$OUT/decode_32layers.json" --build-dir /tmp/coopt-32
        reports reports_32layers coopt-32
        ;;
    layers32-2048)  # issue 3: 32 layers at b1 and b32 / 2048 in one call (session 22; JSON after every variant)
        step 590 decode python bench/decode.py --layers 32 --cases 1:2048:4096,32:2048:4096 \
            --modes eager,reduce-overhead,coopt --prefill 0 --agreement-steps 8 \
            --out "$OUT/decode_32layers_2048.json" --build-dir /tmp/coopt-32-2048
        reports reports_32layers_2048 coopt-32-2048
        ;;
    layers32-b32)  # issue 3: 32 layers at b32 / 2048 (eager, reduce-overhead, coopt; max-autotune was 1.2x slower at 8)
        step 580 decode python bench/decode.py --layers 32 --cases 32:2048:4096 \
            --modes eager,reduce-overhead,coopt --prefill 0 --agreement-steps 16 \
            --out "$OUT/decode_32layers_b32.json" --build-dir /tmp/coopt-32-b32
        reports reports_32layers_b32 coopt-32-b32
        ;;
    layers32-long)  # issue 3: 32 layers at b1 / 32768 (reduce-overhead, coopt bf16 and fp8 KV)
        step 580 decode python bench/decode.py --layers 32 --cases 1:32768:32832 \
            --modes reduce-overhead,coopt,coopt-fp8 --prefill 0 --agreement-steps 16 \
            --out "$OUT/decode_32layers_long.json" --build-dir /tmp/coopt-32-long
        reports reports_32layers_long coopt-32-long
        ;;
    layers32-rest)  # issue 3: 32 layers at b32 / 2048 and b1 / 32768 in one call (eager, reduce-overhead, coopt;
                    # JSON after every variant: a cut keeps what finished)
        step 590 decode python bench/decode.py --layers 32 --cases 32:2048:4096,1:32768:32832 \
            --modes eager,reduce-overhead,coopt --prefill 0 --agreement-steps 8 \
            --out "$OUT/decode_32layers_rest.json" --build-dir /tmp/coopt-32-rest
        reports reports_32layers_rest coopt-32-rest
        ;;
    gpu-all)  # every test marked gpu (59 in session 29; last run whole in session 11), the fast profile (~5 min)
        step 560 pytest python -m pytest -q -p no:cacheprovider -m gpu tests -rs
        ;;
    gpu-tests)  # the GPU runs of this session's kernels and runtime paths (session 5: not run on a GPU yet)
        step 420 pytest python -m pytest -q -p no:cacheprovider tests/templates/test_attention_paged.py \
            tests/templates/test_matmul_gemv_fusions.py tests/templates/test_decode_attention.py \
            tests/runtime/test_serve_graph.py tests/llama/test_llama_paged.py tests/e2e/test_cuda_graph.py
        ;;
    issue3)  # issue 3's 8-layer table in one call: b1 and b32 at 2048, every mode (max-autotune last; ~9 min)
        step 560 decode python bench/decode.py --cases 1:2048:4096,32:2048:4096 \
            --modes eager,reduce-overhead,coopt,max-autotune-no-cudagraphs --prefill 0 --agreement-steps 64 \
            --out "$OUT/decode.json" --build-dir /tmp/coopt-decode
        reports reports_decode coopt-decode
        ;;
    prefill)  # issue 3: the 2048-token prompt, eager / reduce-overhead / coopt / max-autotune: tokens/s
              # (session 7: 130 s and 210 s limits ended inside max-autotune's autotuning; the coopt build takes ~145 s)
        step 560 prefill python bench/decode.py --cases "" --prefill 2048 \
            --modes eager,reduce-overhead,coopt,max-autotune-no-cudagraphs --out "$OUT/prefill.json" \
            --build-dir /tmp/coopt-prefill
        ;;
    prefill-quick)  # issue 3: the 2048-token prompt without max-autotune (its autotuning outlasted 130-210 s
                    # limits twice), then issue 4's unchunked 131072-token coopt prefill
        step 300 prefill python bench/decode.py --cases "" --prefill 2048 --modes eager,reduce-overhead,coopt \
            --out "$OUT/prefill.json" --build-dir /tmp/coopt-prefill
        step 280 long python bench/long_prefill.py --variants coopt --out "$OUT/long_prefill.json" \
            --build-dir /tmp/coopt-long-coopt
        ;;
    sweep-fp8)  # issue 4: fp8 decode attention at b32 (2048, 8192): the advisor's points against a sample
        step 290 attention python bench/attention_sweep.py --cases b32-2048-fp8,b32-8192-fp8 --advised 8 --sample 24 \
            --no-prefetch --json "$OUT/attention_sweep_fp8.json"
        ;;
    sweep)  # the advisor's first points against samples of the spaces: decode attention (4 cases) + L2
            # prefetch experiment, then one layer's four GEMV regions at 1 and 32 rows
        step 290 attention python bench/attention_sweep.py --sample 32 --json "$OUT/attention_sweep.json"
        step 290 gemv python bench/gemm.py --shapes layer --variants gemv --sample 28 --advised 8 --json "$OUT/gemv_sweep.json"
        ;;
    accuracy)  # issue 4: train the small model on the GPU, then every lossy configuration against bf16
        step 560 accuracy python bench/accuracy.py --config small --steps 2000 --device cuda --windows 128 \
            --out "$OUT/accuracy.json"
        ;;
    accuracy-smooth)  # issue 4: the harness with the bf16 baseline, per-head, and per-head smoothed K / K and V
                      # (session 9: ~100 s training + first build, ~70 s each build after: a call of its own;
                      # 128 windows = 16384 predictions since session 10: 4096 spread top-1 by ~0.4 points)
        step 560 accuracy python bench/accuracy.py --config small --steps 2000 --device cuda --windows 128 \
            --only "coopt bf16,coopt fp8 KV per-head,coopt fp8 KV per-head, smoothed K,coopt fp8 KV per-head, smoothed K and V" \
            --out "$OUT/accuracy_smooth.json"
        ;;
    layers32-b32-coopt)  # issue 3: coopt alone at 32 layers, b32 / 2048 (eager and reduce-overhead: layers32-rest)
        step 560 decode python bench/decode.py --layers 32 --cases 32:2048:4096 --modes coopt --prefill 0 \
            --agreement-steps 0 --out "$OUT/decode_32layers_b32_coopt.json" --build-dir /tmp/coopt-32-b32
        ;;
    fold-b1|fold-b32)  # issue 3: the default build (kv_write folded) against the one without the fold, same run (~5 min each)
        case=$([ "$1" = fold-b1 ] && echo 1:2048:4096 || echo 32:2048:4096)
        step 420 "$1" python bench/decode.py --cases "$case" --modes coopt,coopt-unfolded --prefill 0 --agreement-steps 16 \
            --out "$OUT/$1.json" --build-dir /tmp/coopt-decode
        if [ "$1" = fold-b1 ]; then
            step 120 pytest-fold python -m pytest -q -p no:cacheprovider \
                tests/templates/test_decode_attention_kv_write.py tests/passes/test_fuse_kv_write_attention.py
        else  # the tiny fp32 steps built on the GPU, folded and not (session 13: the folded kernel failed its check there)
            step 100 pytest-built python -m pytest -q -p no:cacheprovider tests/passes/test_decode_attention_raise.py \
                tests/passes/test_fuse_kv_write_attention.py -k "built and not batch"
        fi
        ;;
    fold-profile-b1)  # issue 3: both b1 builds (kv_write folded, not) profiled kernel by kernel (session 13)
        step 330 decode python bench/decode.py --cases 1:2048:4096 --modes coopt,coopt-unfolded --prefill 0 --agreement-steps 16 \
            --out "$OUT/fold-decode.json" --build-dir /tmp/coopt-decode
        for build in b1-pos2048 b1-pos2048-unfolded; do
            step 90 "profile_$build" python bench/profile_step.py "/tmp/coopt-decode/$build" --batch 1 --out "$OUT/profile_$build.json"
        done
        reports reports_fold coopt-decode
        step 100 pytest-fold python -m pytest -q -p no:cacheprovider tests/passes/test_fuse_kv_write_attention.py -k built
        ;;
    fold-tests)  # the folded steps' GPU tests, stopping at the first failure with its traceback (session 14: two
        # failed on the H200 without a trace inside fold-profile-b1's limit)
        step 150 pytest-fold python -m pytest -x -q -p no:cacheprovider -p no:logging --tb=short \
            tests/passes/test_fuse_kv_write_attention.py -k "built and RopedKey"
        ;;
    core-launch)  # issue 3: b1 and b32 at 2048, the default build (which now measures its own PDL choice: step 8b,
        # coopt/tune/launch.py), then each replayed step profiled kernel by kernel (session 15: written, CPU-tested)
        step 420 decode python bench/decode.py --cases 1:2048:4096,32:2048:4096 --modes coopt --prefill 0 \
            --agreement-steps 16 --out "$OUT/core-launch.json" --build-dir /tmp/coopt-decode
        for build in b1-pos2048 b32-pos2048; do
            batch=${build%%-*}
            step 100 "profile_$build" python bench/profile_step.py "/tmp/coopt-decode/$build" --batch "${batch#b}" \
                --out "$OUT/profile_$build.json"
        done
        ;;
    normstats-chunk-b32)  # issue 3: b32 / 2048, the norm statistics' sums over 64-column chunks (the default) against
        # 32 (session 15: with them the 33 GEMVs took 18.8 us more; 64-column chunks need BLOCK_N >= 64 in o / down)
        step 420 decode python bench/decode.py --cases 32:2048:4096 --modes coopt,coopt-normstats32 --prefill 0 \
            --agreement-steps 16 --out "$OUT/normstats-chunk.json" --build-dir /tmp/coopt-decode
        for build in b32-pos2048 b32-pos2048-normstats32; do
            step 100 "profile_$build" python bench/profile_step.py "/tmp/coopt-decode/$build" --batch 32 --out "$OUT/profile_$build.json"
        done
        ;;
    launch-tests)  # the GPU runs of session 15's tests: the fold (fp32 steps), its one-key exactness, the launch choice
        step 280 pytest-launch python -m pytest -q -p no:cacheprovider -p no:logging --tb=short \
            tests/passes/test_fuse_kv_write_attention.py tests/passes/test_launch_pdl.py \
            tests/templates/test_decode_attention_kv_write.py
        ;;
    fp8-values)  # issue 4: fp8-kv-cache{values-only} (V fp8, K bf16) against both caches fp8, b32 at 2048 (~6 min)
        step 560 fp8-values python bench/decode.py --cases 32:2048:4096 --modes coopt-fp8,coopt-fp8-values --prefill 0 \
            --agreement-steps 8 --out "$OUT/fp8_values.json" --build-dir /tmp/coopt-decode
        ;;
    normstats-b32)  # issue 3: b32 / 2048, the default against the default without fuse-norm-statistics in one call,
        # each step profiled kernel by kernel (session 15: 1765.9 us replayed with them, 1780.2 without)
        step 420 decode python bench/decode.py --cases 32:2048:4096 --modes coopt,coopt-rownorms --prefill 0 \
            --agreement-steps 16 --out "$OUT/normstats-decode.json" --build-dir /tmp/coopt-decode
        for build in b32-pos2048 b32-pos2048-rownorms; do
            step 100 "profile_$build" python bench/profile_step.py "/tmp/coopt-decode/$build" --batch 32 --out "$OUT/profile_$build.json"
        done
        ;;
    values-now)  # issue 4: values-only fp8 (V fp8, K bf16) re-measured with today's kernels beside reduce-overhead,
        # b1 / 32768 then b32 / 2048 (sessions 14 and 19 measured them before both CUDA families; ~9 min)
        step 290 values-b1 python bench/decode.py --cases 1:32768:32832 --modes reduce-overhead,coopt-fp8-values \
            --prefill 0 --agreement-steps 8 --out "$OUT/values_b1.json" --build-dir /tmp/coopt-values
        step 290 values-b32 python bench/decode.py --cases 32:2048:4096 --modes reduce-overhead,coopt-fp8-values \
            --prefill 0 --agreement-steps 8 --out "$OUT/values_b32.json" --build-dir /tmp/coopt-values
        reports values-reports coopt-values
        ;;
    mma-prologues)  # issue 3, session 34: the CUDA attention's prologue (q's math after the first copies, full
        # chunks copied from per-lane addresses, the folded row patched into its ring slot): every GPU test of
        # the family, then its kernel (bare / rope / folded) beside $BASE's (a snapshot of main), twice each (~6 min)
        step 240 mma-tests python -m pytest -q -p no:cacheprovider --tb=short tests/templates/test_decode_attention_mma.py
        for run in 1 2; do
            for tree in "$PWD" "${BASE:-}"; do
                [ -n "$tree" ] || continue
                name=$([ "$tree" = "$PWD" ] && echo this || echo base)
                step 120 "fold-times-$name-$run" python "$tree/bench/fold_kernel_times.py" \
                    --cases b1-2048,b1-2048-fp8,b1-32768-fp8 --splits "" --mma 16:16:ca:8:2 \
                    --json "$OUT/fold_times_${name}_$run.json"
            done
        done
        ;;
    pending)  # what no GPU has run yet, in one call (~5 min; sessions 33-38's CUDA attention, CUDA GEMV and
        # elementwise tests passed on an H100 in session 39: 169 GPU-marked, 117 elementwise).
        # session 39: the cast fns, log_softmax, the repeated-KV fold and a transformers-style layer, built on the GPU
        step 200 pending-39 python -m pytest -q -p no:cacheprovider --tb=short -rs tests/templates/test_row_reduction.py \
            tests/passes/test_fold_repeated_kv.py tests/passes/test_raise_hf_rms_norm.py tests/passes/test_raise_log_softmax.py \
            tests/e2e/test_transformers_style_llama.py tests/e2e/test_elementwise_ops_build.py
        # session 40: transformers' StaticCache forms, cse-aten, biased parallel linears, transformers' own models;
        # session 42: simplify-aten and fold-constants (the rotary tables one kernel)
        # (those skip unless .whl brought transformers: ../shared/tools/device-wheels.sh transformers==5.18.0)
        # (session 41 on an H100: the masks' tests passed; test_cse_aten's MovingOffset build ran its cache out of
        # range in the build's end-to-end timing, a device-side assert that ends the run's CUDA context; such a
        # model is no longer timed, but its file goes last until a GPU run shows it)
        step 330 pending-40 python -m pytest -q -p no:cacheprovider --tb=short -rs tests/passes/test_hf_static_cache.py \
            tests/passes/test_fuse_parallel_linears.py tests/passes/test_inplace_state_writes.py \
            tests/frontend/test_capture_fallback.py tests/e2e/test_grouped_state_writes.py tests/e2e/test_transformers_llama.py \
            tests/passes/test_simplify_aten.py tests/passes/test_cse_aten.py
        ;;
    exact-recent)  # issue 4, session 43: the harness with --kv-cache fp8-recent (the newest 4 keys unrounded,
        # rings beside the caches) beside bf16 and fp8 smoothed K; the exact-recent kernel's GPU tests; the
        # first transformers-model GPU test with its traceback (session 43: all seven failed on an H100) (~9.5 min)
        # (session 43's first call: smoothed K 98.64 % top-1 against the bf16 build; the third build cut at 330 s)
        step 90 exact-tests python -m pytest -q -p no:cacheprovider --tb=short tests/templates/test_decode_attention_exact_recent.py
        step 400 accuracy python bench/accuracy.py --config small --steps 2000 --device cuda --windows 128 \
            --only "coopt bf16,coopt fp8 KV per-head, smoothed K, newest 4 exact" --out "$OUT/accuracy_recent.json"
        step 100 hf-first python -m pytest -q -x -p no:cacheprovider --tb=long -p no:logging \
            "tests/e2e/test_transformers_llama.py::test_a_transformers_decode_step_builds_as_the_projects_own_llama[llama]"
        ;;
    pending-43)  # session 43's CPU work not yet run on a GPU (~9 min): the exact-recent builds and kernels (the
        # ring write in the decode kernel, the prompt kernel), then transformers' tests call 4 did not reach
        step 200 exact python -m pytest -q -p no:cacheprovider --tb=short -p no:logging \
            tests/templates/test_decode_attention_exact_recent.py tests/passes/test_fp8_kv_cache.py -k "exact or rings"
        step 360 hf python -m pytest -q -p no:cacheprovider --tb=short -p no:logging \
            "tests/e2e/test_transformers_llama.py::test_a_transformers_decode_step_builds_as_the_projects_own_llama[qwen2]" \
            "tests/e2e/test_transformers_llama.py::test_a_transformers_decode_step_builds_as_the_projects_own_llama[mistral]" \
            tests/e2e/test_transformers_llama.py::test_a_sliding_window_shorter_than_the_cache_stays_sdpa \
            tests/e2e/test_transformers_llama.py::test_a_transformers_prompt_chunk_attends_over_the_cache
        ;;
    fp8-recent-b1)  # issue 4, session 44: b1 / 32768 with --kv-cache fp8 and fp8-recent beside reduce-overhead
        # (the window in the last of 16-32 splits; ~7 min)
        step 540 decode python bench/decode.py --cases 1:32768:32832 --modes reduce-overhead,coopt-fp8,coopt-fp8-recent \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_fp8_recent_b1.json" --build-dir /tmp/coopt-recent-b1
        reports reports_recent_b1 coopt-recent-b1
        ;;
    paged-recent)  # issue 4, session 45: exact-recent through pages (ring slots): the Triton and CUDA kernels' GPU
        # tests, PagedDecoder over a paged fp8-recent build (also graph-replayed) (~4 min)
        step 420 paged-recent-tests python -m pytest -q -p no:cacheprovider --tb=short -p no:logging \
            tests/templates/test_decode_attention_exact_recent.py tests/templates/test_decode_attention_mma_exact.py \
            tests/llama/test_llama_paged_fp8_recent.py tests/runtime/test_serve_graph.py
        ;;
    fp8-recent-fold)  # issue 4, session 44: exact-recent's write folded into the attention (Triton and CUDA), the
        # kv_write's exact outputs, the pending exact-recent kernel tests; then b32 / 2048 fp8 against fp8-recent (~9.5 min)
        step 150 exact-tests python -m pytest -q -p no:cacheprovider --tb=short -p no:logging \
            tests/templates/test_decode_attention_mma_exact.py tests/templates/test_decode_attention_exact_folded.py \
            tests/templates/test_decode_attention_exact_recent.py tests/templates/test_kv_write.py
        step 400 decode python bench/decode.py --cases 32:2048:4096 --modes reduce-overhead,coopt-fp8,coopt-fp8-recent \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_fp8_recent_b32.json" --build-dir /tmp/coopt-recent
        reports reports_recent coopt-recent
        ;;
    fp8-recent-mma)  # issue 4, session 44: the CUDA attention reading the window (its GPU tests), then b32 / 2048
        # with --kv-cache fp8 and fp8-recent in one run (the kv_write over fp32 keys now a template) (~8.5 min)
        step 120 mma-exact python -m pytest -q -p no:cacheprovider --tb=short -p no:logging \
            tests/templates/test_decode_attention_mma_exact.py tests/templates/test_kv_write.py -k "exact or rings or fp32_keys"
        step 440 decode python bench/decode.py --cases 32:2048:4096 --modes reduce-overhead,coopt-fp8,coopt-fp8-recent \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_fp8_recent_b32.json" --build-dir /tmp/coopt-recent
        reports reports_recent coopt-recent
        ;;
    fp8-recent-b32)  # issue 4, session 43: b32 / 2048 with --kv-cache fp8 and fp8-recent in one run (~6 min)
        step 560 decode python bench/decode.py --cases 32:2048:4096 --modes reduce-overhead,coopt-fp8,coopt-fp8-recent \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_fp8_recent_b32.json" --build-dir /tmp/coopt-recent
        reports reports_recent coopt-recent
        ;;
    gemv-timeline)  # issue 4, session 46: inside the b32 GEMVs' launches (the build's four regions): each program's
        # start, loop end and end, and its first slab's arrival (%globaltimer stamps, six launches in a graph; ~4 min)
        step 420 gemv-timeline python bench/gemv_timeline_probe.py --json "$OUT/gemv_timeline.json"
        ;;
    gemv-points)  # issue 4, session 47: the b32 GEMV regions at other points against the build's (o and down
        # without a split-K meeting, q|k|v on more SMs), then the GEMV forms' GPU tests with the early epilogue loads (~3 min)
        step 200 gemv-points python bench/gemv_timeline_probe.py --alternatives --shapes qkv+,o+,down+,gate_up+ \
            --json "$OUT/gemv_points.json"
        step 150 gemv-tests python -m pytest -q -p no:cacheprovider --tb=short -p no:logging \
            tests/bench/test_gemv_timeline_probe.py tests/templates/test_matmul_gemv_fusions.py tests/verify/test_verify_lengths.py
        ;;
    points-fp8-b32)  # issue 4, session 48: the b32 GEMV regions at other points (gemv-points' probe), the
        # embedding_rows kernel's GPU tests, then b32 / 2048 reduce-overhead and coopt-fp8 (early epilogue
        # loads, the lengths' + 1 and the embedding gather in regions; ~8 min)
        step 100 gemv-points python bench/gemv_timeline_probe.py --alternatives --shapes qkv+,o+,down+,gate_up+ \
            --json "$OUT/gemv_points.json"
        step 40 embedding-rows-tests python -m pytest -q -p no:cacheprovider --tb=short -p no:logging tests/templates/test_embedding_rows.py
        # (MODES=coopt-fp8 when device time is short: the build alone, against its floor)
        step 330 decode python bench/decode.py --cases 32:2048:4096 --modes "${MODES:-reduce-overhead,coopt-fp8}" \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_fp8_b32.json" --build-dir /tmp/coopt-fp8
        reports reports_fp8_b32 coopt-fp8
        ;;
    e2e-tests-1|e2e-tests-2|e2e-tests-3|e2e-tests-4)  # sessions 51-53: tests/e2e on the GPU in four calls (the whole directory
        # took more than one call's 600 s in session 52: 29 of its 53 tests in 560 s); -rf names the failures
        E=tests/e2e
        case "$1" in
            e2e-tests-1) files="$E/test_bad_candidates.py $E/test_cuda_graph.py $E/test_dynamic_shapes.py
                         $E/test_elementwise_ops_build.py $E/test_end_to_end_bisection.py" ;;
            e2e-tests-2) files="$E/test_end_to_end_fp8_per_token.py $E/test_examples.py" ;;
            e2e-tests-3) files="$E/test_graph_timing_choice.py $E/test_grouped_state_writes.py $E/test_program_releases.py
                         $E/test_state_file.py $E/test_transformers_style_llama.py $E/test_twin_regions.py" ;;
            # (session 53: with transformers on the device, its file alone took ~7 of the old third call's 9.5 minutes)
            e2e-tests-4) files="$E/test_transformers_llama.py" ;;
        esac
        # shellcheck disable=SC2086 # (the file list splits on purpose)
        step 560 "$1" python -m pytest -q -rf -p no:cacheprovider --tb=short -p no:logging $files
        ;;
    lengths-fold)  # issue 4, session 47: the decode attentions add the lengths' + 1 (fuse-attention's lengths_add):
        # the CUDA and Triton kernels' GPU tests, the builds reading positions (plain, fp8, fp8-recent, paged; ~4 min)
        # (two steps: in session 47 one step of all of them ran past 330 s in the Llama builds)
        step 200 lengths-kernels python -m pytest -q -p no:cacheprovider --tb=short -p no:logging \
            tests/passes/test_decode_attention_raise.py tests/verify/test_verify_lengths.py tests/templates/test_decode_attention_mma.py
        step 380 lengths-builds python -m pytest -q -p no:cacheprovider --tb=short -p no:logging \
            tests/llama/test_llama_build.py tests/llama/test_llama_fp8.py tests/llama/test_llama_fp8_recent.py tests/llama/test_llama_paged_fp8_recent.py
        ;;
    flag-fp8-b32)  # issue 4, session 53: the GEMV's flag meeting (MEET="flag") on a GPU first, its GPU tests (a merger
        # that never sees its flags would hang: short limit) and the build's o and down points with it against
        # the count meeting; then, only where those pass, the status step (whose builds time both meetings of
        # each split point; ~8.5 min in all)
        if step 90 flag-tests python -m pytest -q -x -p no:cacheprovider --tb=short -p no:logging \
                tests/templates/test_gemv_flag_meeting.py \
            && step 120 flag-points python bench/gemv_timeline_probe.py --alternatives --shapes o+,down+ \
                --json "$OUT/flag_points.json"; then
            OUT=$OUT bash "$0" status-fp8-b32
        else
            echo "the flag meeting failed on this GPU: no build with it (fix it first)"
        fi
        ;;
    status-fp8-b32)  # issue 4, session 52: the status row (b32 / 2048, reduce-overhead and coopt-fp8), then the
        # build's step profiled launch by launch without PDL and with it for the GEMVs (where PDL loses on an H200),
        # PDL's gain at each place in a layer, and the launch choice's tests (~8 min)
        step 360 decode python bench/decode.py --cases 32:2048:4096 --modes "${MODES:-reduce-overhead,coopt-fp8}" \
            --prefill 0 --agreement-steps 8 --keep-weights --out "$OUT/decode_fp8_b32.json" --build-dir /tmp/coopt-fp8
        reports reports_fp8_b32 coopt-fp8
        for pdl in 0 gemv; do
            COOPT_PDL=$pdl step 75 "profile_fp8_b32_pdl_$pdl" python bench/profile_step.py /tmp/coopt-fp8/b32-pos2048-fp8 \
                --batch 32 --launches --out "$OUT/profile_fp8_b32_pdl_$pdl.json"
        done
        step 30 pdl-boundaries python bench/pdl_boundaries.py "$OUT/profile_fp8_b32_pdl_0.json" "$OUT/profile_fp8_b32_pdl_gemv.json"
        # (session 52's call ran the three steps above in 357 s) the launch choice's tests, the GPU one building with
        # the per-module refinement
        step 100 launch-tests python -m pytest -q -rf -p no:cacheprovider --tb=short -p no:logging tests/passes/test_launch_pdl.py
        ;;
    profile-fp8-b32)  # issue 4, session 46: the b32 / 2048 --kv-cache fp8 build's replayed step, kernel by kernel
        # (each launch's time and the gap before it; ~4 min)
        step 300 decode python bench/decode.py --cases 32:2048:4096 --modes coopt-fp8 --prefill 0 --agreement-steps 0 \
            --keep-weights --out "$OUT/decode_fp8_b32.json" --build-dir /tmp/coopt-fp8
        step 60 profile python bench/profile_step.py /tmp/coopt-fp8/b32-pos2048-fp8 --batch 32 --launches --out "$OUT/profile_fp8_b32.json"
        ;;
    window-warps)  # issue 4, session 46: the window's keys spread over the last split's warps (the CUDA attention's
        # exact-recent GPU tests, paged ones and PagedDecoder's among them), then b1 / 32768 fp8 against fp8-recent (~8 min)
        step 200 window-tests python -m pytest -q -p no:cacheprovider --tb=short -p no:logging \
            tests/templates/test_decode_attention_mma_exact.py tests/templates/test_decode_attention_exact_folded.py \
            tests/llama/test_llama_paged_fp8_recent.py
        step 360 decode python bench/decode.py --cases 1:32768:32832 --modes coopt-fp8,coopt-fp8-recent \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_fp8_recent_b1.json" --build-dir /tmp/coopt-recent-b1
        reports reports_recent_b1 coopt-recent-b1
        ;;
    fp8-recent-b32-profile)  # issue 4, session 46: fp8-recent-b32, then both fp8 builds' replayed steps profiled kernel
        # by kernel (each kernel's time and the gap before it: where the 38 µs to the 1.10x target are; ~8.5 min)
        step 480 decode python bench/decode.py --cases 32:2048:4096 --modes reduce-overhead,coopt-fp8,coopt-fp8-recent \
            --prefill 0 --agreement-steps 8 --keep-weights --out "$OUT/decode_fp8_recent_b32.json" --build-dir /tmp/coopt-recent
        reports reports_recent coopt-recent
        for build in b32-pos2048-fp8 b32-pos2048-fp8-recent; do
            step 45 "profile_$build" python bench/profile_step.py "/tmp/coopt-recent/$build" --batch 32 --launches --out "$OUT/profile_$build.json"
        done
        ;;
    attention-b32-stream)  # issue 4, session 42: is b32 / 2048 fp8's attention (35.9 µs a layer in the build, 32.0 of
        # bytes; bf16's 0.8 over) short of bytes in flight? Its 256 blocks of 4 warps hold one 4 KiB chunk each in
        # flight at 2 slots (~32 KiB an SM against the ~48 KiB a 32 GB/s share needs at ~1.5 µs of latency), bf16's
        # twice that. The family's kernel at deeper rings, wider chunks and 8 warps, fp8 and bf16, each beside its
        # loads alone (the key loop's body removed: fold_kernel_times.py --loads-only) (~3 min)
        step 200 attention-b32 python bench/fold_kernel_times.py --cases b32-2048-fp8,b32-2048 --splits "" \
            --mma 1:16:ca:4:2,1:16:ca:4:3,1:16:ca:4:4,1:32:ca:4:2,1:32:ca:4:3,1:16:ca:8:2,1:16:ca:8:3,2:16:ca:4:2 \
            --loads-only --json "$OUT/attention_b32_stream.json"
        ;;
    prefetch-bulk)  # issue 3, session 38: does pulling the o weights into L2 with the TMA's bulk prefetch during the
        # b1 / 2048 attention (latency-bound: 7 µs for 8.4 MB) make the o GEMV after it faster than the prefetch's own
        # launch costs? 8 layers of (attention, o GEMV) in one graph, a quarter / half / all of the weights (~2 min)
        step 150 prefetch python bench/attention_sweep.py --prefetch-only --json "$OUT/prefetch_bulk.json"
        ;;
    mlp-dataflow)  # issue 4, session 41: the b32 MLP's gate|up and down in one launch, each down task waiting only
        # for the gate|up tiles of its reduction group (no grid-wide meeting), beside two launches and the template (~3 min)
        step 60 mlp-dataflow-tests python -m pytest -q -p no:cacheprovider --tb=short tests/bench/test_mlp_dataflow_probe.py
        step 240 mlp-dataflow python bench/mlp_dataflow_probe.py --json "$OUT/mlp_dataflow.json"
        ;;
    tma-gemv)  # issue 3, session 39: do the b32 layer's four GEMMs stream faster with the weight brought by
        # tensor descriptors (TMA) than by pointer loads, in the same split GEMV beside cuBLAS and the template (~1 min)
        step 480 tma-gemv python bench/tma_gemv_probe.py --json "$OUT/tma_gemv.json"
        ;;
    transformers-decode)  # session 40: transformers' own LlamaForCausalLM (examples/transformers_llama/model.py,
        # through its exportable StaticCache wrapper) at 8 Llama-3-8B layers, b1 / 2048 and b32 / 2048: eager,
        # reduce-overhead and coopt in one run (~9 min). The device has no transformers: first, here,
        # `../shared/tools/device-wheels.sh transformers==5.18.0` (its wheels then travel in .whl)
        step 560 hf-decode python bench/decode.py --model-file examples/transformers_llama/model.py \
            --cases 1:2048:4096,32:2048:4096 --modes eager,reduce-overhead,coopt --prefill 0 --agreement-steps 8 \
            --out "$OUT/decode_transformers.json" --build-dir /tmp/coopt-hf
        reports reports_hf coopt-hf
        ;;
    h200-missed)  # issues 3 and 4, session 38: the two H200 rows still missed, in one call (~9.5 min; run it only on
        # an H200): 32 layers at b1 / 2048 (does the build pick the cluster meeting), then b32 / 2048 fp8
        step 330 decode python bench/decode.py --layers 32 --cases 1:2048:4096 \
            --modes reduce-overhead,coopt --prefill 0 --agreement-steps 8 --out "$OUT/decode_32layers_b1.json" \
            --build-dir /tmp/coopt-32-b1
        step 250 decode-fp8 python bench/decode.py --cases 32:2048:4096 --modes reduce-overhead,coopt-fp8 \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_fp8_b32.json" --build-dir /tmp/coopt-fp8
        reports reports_missed coopt-32-b1 coopt-fp8
        ;;
    mma-cluster)  # issue 3: the CUDA attention's splits meeting in a thread-block cluster (MEET=cluster): every GPU
        # test of the family (the cluster form among them), then the kernel at 16 splits meeting in global
        # memory, 8 in global memory and 8 in a cluster, bare / rope / folded (~5 min)
        step 300 mma-tests python -m pytest -q -p no:cacheprovider --tb=short tests/templates/test_decode_attention_mma.py
        step 150 fold-times python bench/fold_kernel_times.py --cases b1-2048,b1-2048-fp8,b1-32768-fp8 \
            --splits "" --mma 16:16:ca:8:2,8:16:ca:8:2,8:16:ca:8:2:cluster,4:16:ca:8:2:cluster \
            --json "$OUT/fold_times_cluster.json"
        ;;
    mma-values)  # issue 4: the CUDA attention over values-only caches (K bf16, V e4m3): its GPU tests, then
        # values-only b1 / 32768 and b32 / 2048 built with it beside reduce-overhead (~9.5 min)
        step 90 pytest-mma-values python -m pytest -q -p no:cacheprovider -p no:logging --tb=short \
            tests/templates/test_decode_attention_mma.py -k "values_only"
        step 200 values-b1 python bench/decode.py --cases 1:32768:32832 --modes reduce-overhead,coopt-fp8-values \
            --prefill 0 --agreement-steps 8 --out "$OUT/values_b1.json" --build-dir /tmp/coopt-values
        step 290 values-b32 python bench/decode.py --cases 32:2048:4096 --modes reduce-overhead,coopt-fp8-values \
            --prefill 0 --agreement-steps 8 --out "$OUT/values_b32.json" --build-dir /tmp/coopt-values
        reports values-reports coopt-values
        ;;
    fp8-values-b1)  # issue 4: values-only fp8 (V fp8, K bf16) against both caches fp8, b1 at 32768 and 131072 (~8 min)
        step 560 decode python bench/decode.py --cases 1:32768:32832,1:131072:131136 --modes coopt-fp8,coopt-fp8-values \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_fp8_values_b1.json" --build-dir /tmp/coopt-fp8
        ;;
    fp8-fold-b1)  # issue 4: the fp8 kv_write folded into the decode attention (session 16) against the unfolded
        # build, both caches fp8 and values-only, b1 at 32768; first the fold's GPU tests
        step 120 pytest-fp8-fold python -m pytest -q -p no:cacheprovider -p no:logging --tb=short \
            tests/templates/test_decode_attention_kv_write_fp8.py
        step 450 decode python bench/decode.py --cases 1:32768:32832 \
            --modes coopt-fp8,coopt-fp8-unfolded,coopt-fp8-values,coopt-fp8-values-unfolded \
            --prefill 0 --agreement-steps 4 --out "$OUT/decode_fp8_fold_b1.json" --build-dir /tmp/coopt-fp8
        ;;
    fp8-fold-profile-b1)  # issue 4: both fp8 b1 / 32768 builds (the write folded, not; top-k 2) profiled kernel by
        # kernel (session 16: the folded step measured 1.413 ms against 1.409 unfolded in fp8-fold-b1)
        step 300 decode python bench/decode.py --cases 1:32768:32832 --modes coopt-fp8,coopt-fp8-unfolded --prefill 0 \
            --agreement-steps 0 --top-k 2 --out "$OUT/fp8-fold-decode.json" --build-dir /tmp/coopt-fp8
        for build in b1-pos32768-fp8 b1-pos32768-fp8-unfolded; do
            step 90 "profile_$build" python bench/profile_step.py "/tmp/coopt-fp8/$build" --batch 1 --out "$OUT/profile_$build.json"
        done
        ;;
    leads-22)  # session 22's leads in one call (one cold start): the b32 GEMVs' space, fp8 pipeline depths, fp8 split counts
        step 280 gemm python bench/gemm.py --shapes stats32 --variants gemv --sample 24 --advised 8 \
            --json "$OUT/gemm_stats32.json"
        step 170 fp8-stages python bench/v_layout_probe.py --cases b1-32768-fp8,b32-2048-fp8 --layouts rows --warps 4 \
            --stages 2,3,4,5,6 --json "$OUT/fp8_stages.json"
        step 120 fp8-splits python bench/v_layout_probe.py --cases b1-32768-fp8 --layouts rows --warps 4 \
            --stages 3,4 --splits 24,32,40,48 --json "$OUT/fp8_splits.json"
        ;;
    cuda-attention)  # issue 3: the b1 attention's meeting through distributed shared memory instead of global memory
        step 150 cuda-tests python -m pytest -q -p no:cacheprovider -x tests/bench/test_cuda_attention_probe.py
        step 300 cuda-attention python bench/cuda_attention_probe.py --json "$OUT/cuda_attention.json"
        ;;
    mma)  # issue 4: the CUDA fp8 decode attention family's GPU tests (thorough), then b1 / 32768 fp8 built with it (~8 min)
        COOPT_VERIFY_PROFILE=thorough step 200 mma-tests python -m pytest -q -p no:cacheprovider -x \
            tests/templates/test_decode_attention_mma.py
        step 400 decode python bench/decode.py --cases 1:32768:32832 --modes reduce-overhead,coopt-fp8 \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_mma_b1_32768.json" --build-dir /tmp/coopt-fp8
        reports reports_mma_b1_32768 coopt-fp8
        ;;
    mma-131072)  # issue 4: the CUDA family's kernel bare, with rope and folded beside the template's, then b1 / 131072 fp8 (~8 min)
        step 150 fold-times python bench/fold_kernel_times.py --cases b1-32768-fp8,b1-131072-fp8 --splits 32 \
            --json "$OUT/fold_times_mma.json"
        step 420 decode python bench/decode.py --cases 1:131072:131136 --modes reduce-overhead,coopt-fp8 \
            --prefill 0 --agreement-steps 4 --out "$OUT/decode_mma_b1_131072.json" --build-dir /tmp/coopt-fp8
        reports reports_mma_b1_131072 coopt-fp8
        ;;
    mma-32768)  # issue 4: the family's GPU tests, its kernel beside the probe's, b1 / 32768 fp8 built with it (~8 min)
        COOPT_VERIFY_PROFILE=thorough step 150 mma-tests python -m pytest -q -p no:cacheprovider -x \
            tests/templates/test_decode_attention_mma.py
        step 100 fold-times python bench/fold_kernel_times.py --cases b1-32768-fp8 --splits 32 --mma 16:16:ca:8:2 \
            --json "$OUT/fold_times_mma.json"
        step 90 probe-times python bench/cuda_fp8_attention_probe.py --cases b1-32768-fp8 --splits "" --global-splits 16 \
            --warps 8 --chunks 16 --stages 2 --widens cvt --copies ca --loads-only-splits "" --advised 0
        OUT=$OUT bash "$0" mma-32768-build
        ;;
    mma-points)  # issue 4, session 30: the family's kernel alone off the heuristic's points (ring depth 3, two
        # blocks an SM at b1, two splits at b32), then the b32 / 2048 build (~8 min)
        step 100 points-b1 python bench/fold_kernel_times.py --cases b1-32768-fp8 --splits 32 \
            --mma 16:16:ca:8:2,16:16:ca:8:3,32:16:ca:8:2,32:16:ca:4:2,32:16:ca:4:3 --json "$OUT/points_b1.json"
        step 100 points-b32 python bench/fold_kernel_times.py --cases b32-2048-fp8 --splits 1 \
            --mma 1:16:ca:4:2,1:16:cg:4:2,1:16:ca:4:3,1:16:cg:4:3,2:16:ca:4:2,2:16:cg:4:2,2:16:ca:4:3 \
            --json "$OUT/points_b32.json"
        OUT=$OUT bash "$0" mma-b32
        ;;
    gemv-pdl)  # issue 3, session 30: a CUDA GEMV chain streaming weights before its PDL wait (~4 min)
        step 120 gemv-pdl-tests python -m pytest -q -p no:cacheprovider -x tests/bench/test_cuda_gemv_pdl_probe.py \
            tests/runtime/test_cuda_kernels.py
        step 300 gemv-pdl python bench/cuda_gemv_pdl_probe.py --json "$OUT/cuda_gemv_pdl.json"
        ;;
    gemv-cuda)  # issue 3, session 30: the CUDA GEMV family's GPU tests, then b1 / 32768 fp8 built with it (~5 min)
        step 150 gemv-cuda-tests python -m pytest -q -p no:cacheprovider -x tests/templates/test_gemv_cuda.py
        OUT=$OUT bash "$0" mma-32768-build
        ;;
    gemv-sweep)  # issue 3, session 31: the CUDA GEMV's GPU tests, then its points (the family's and fewer warps /
                 # deeper rings) on the b1 GEMVs with and without their norm, beside the template's first (~8 min)
        step 120 gemv-cuda-tests python -m pytest -q -p no:cacheprovider -x tests/templates/test_gemv_cuda.py
        step 420 gemv-sweep python bench/gemm.py --shapes b1cuda --family both --variants gemv --sample 1 \
            --advised 3 --json "$OUT/gemv_sweep.json"
        ;;
    gemv-align)  # issue 3, session 31: the CUDA families without static shared memory (rings on 128-byte boundaries):
                 # their GPU tests, the fp8 attention alone at b1 / 32768, the CUDA GEMV's sweep (~8 min)
        step 150 cuda-tests python -m pytest -q -p no:cacheprovider -x tests/templates/test_gemv_cuda.py \
            tests/templates/test_decode_attention_mma.py
        step 100 fold-times python bench/fold_kernel_times.py --cases b1-32768-fp8 --splits 32 --mma 16:16:ca:8:2 \
            --json "$OUT/fold_times_mma.json"
        step 300 gemv-sweep python bench/gemm.py --shapes b1cuda --family both --variants gemv --sample 1 \
            --advised 2 --json "$OUT/gemv_sweep.json"
        ;;
    gemv-pdl-chain)  # issue 3, session 31: o -> gate|up -> down in the family's modules, PDL off / on, one or two
                     # blocks an SM, beside the template's three GEMVs (~2 min)
        step 200 gemv-pdl-chain python bench/gemv_cuda_pdl_chain.py --json "$OUT/gemv_pdl_chain.json"
        ;;
    gemv-ncu)  # issue 3, session 31: why the CUDA GEMV with a norm prologue streams slower at 16 warps (ncu, ~2 min)
        step 150 gemv-cuda-tests python -m pytest -q -p no:cacheprovider -x tests/templates/test_gemv_cuda.py
        ncu=/usr/local/cuda/bin/ncu
        step 200 gemv-ncu $ncu --clock-control none --target-processes all --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
            --section SchedulerStats --section SourceCounters -k regex:coopt_gemv -o "$OUT/gemv" \
            python bench/gemv_cuda_ncu.py
        $ncu -i "$OUT/gemv.ncu-rep" --page details > "$OUT/gemv-details.txt" 2>&1
        $ncu -i "$OUT/gemv.ncu-rep" --page source --csv --print-source sass > "$OUT/gemv-source.csv" 2>&1
        grep -E "^  coopt_gemv|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued" \
            "$OUT/gemv-details.txt" | head -80
        tar -czf "$OUT/gemv-ncu.tar.gz" -C "$OUT" gemv-details.txt gemv-source.csv && rm -f "$OUT"/gemv.ncu-rep "$OUT"/gemv-source.csv
        ;;
    gemv-cuda-2048)  # issue 3, session 30: b1 / 2048 bf16 built with the CUDA GEMV family (~4 min)
        step 330 decode python bench/decode.py --cases 1:2048:4096 --modes reduce-overhead,coopt \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_gemv_b1_2048.json" --build-dir /tmp/coopt-2048
        reports reports_gemv_b1_2048 coopt-2048
        ;;
    mma-bf16)  # issue 3, session 32: the CUDA attention over bf16 caches: the family's GPU tests, then its kernel
               # beside the Triton template's at b1 / 2048, b32 / 2048 and b1 / 32768 (bare, rope, folded; ~4 min)
        step 200 mma-tests python -m pytest -q -p no:cacheprovider -x tests/templates/test_decode_attention_mma.py
        step 200 fold-times python bench/fold_kernel_times.py --cases b1-2048,b32-2048,b1-32768 --splits 8,16 \
            --mma 8:16:ca:8:2,16:16:ca:8:2,32:16:ca:8:2,16:16:ca:4:2,32:16:ca:4:2,1:16:ca:4:2,16:16:ca:8:3 \
            --json "$OUT/fold_times_mma_bf16.json"
        ;;
    mma-bf16-b32)  # issue 3, session 32: b32 / 2048 bf16 with the CUDA attention beside the template (~5 min)
        step 420 decode python bench/decode.py --cases 32:2048:4096 --modes reduce-overhead,coopt \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_mma_bf16_b32.json" --build-dir /tmp/coopt-b32
        reports reports_mma_bf16_b32 coopt-b32
        ;;
    layers32-2048-quick)  # issue 3, session 32 call 4: 32 layers at b32 and b1 / 2048, reduce-overhead and coopt (~9.5 min)
        step 575 decode python bench/decode.py --layers 32 --cases 32:2048:4096,1:2048:4096 --modes reduce-overhead,coopt \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_32layers_2048.json" --build-dir /tmp/coopt-32-2048
        reports reports_32 coopt-32-2048
        ;;
    layers32-b32-quick)  # issue 3, session 37: 32 layers at b32 / 2048 alone, reduce-overhead and coopt (~7 min); on
        # an H100 (80 GB) its end-to-end check ran out of memory in session 37 before the host snapshots
        step 540 decode python bench/decode.py --layers 32 --cases 32:2048:4096 --modes reduce-overhead,coopt \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_32layers_b32.json" --build-dir /tmp/coopt-32-b32
        reports reports_32b32 coopt-32-b32
        ;;
    layers32-b1-quick)  # issue 3, session 36: 32 layers at b1 / 2048 alone, reduce-overhead and coopt (~5 min); the
        # build's launch step times its PDL options with and without the GEMVs switched to PDL-ready kernels
        # (build.json "launch"); the attention's cluster meeting is among its candidates (session 37)
        step 420 decode python bench/decode.py --layers 32 --cases 1:2048:4096 \
            --modes reduce-overhead,coopt --prefill 0 --agreement-steps 8 --out "$OUT/decode_32layers_b1.json" \
            --build-dir /tmp/coopt-32-b1
        reports reports_32b1 coopt-32-b1
        ;;
    layers32-fp8)  # issue 4, session 32 call 5: 32 layers at b1 / 32768, coopt-fp8 only (~5 min)
        step 500 decode python bench/decode.py --layers 32 --cases 1:32768:32832 --modes coopt-fp8 \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_32layers_fp8.json" --build-dir /tmp/coopt-32-fp8
        reports reports_32fp8 coopt-32-fp8
        ;;
    mma-bf16-2048)  # issue 3, session 32: b1 / 2048 bf16 built with both CUDA families (= gemv-cuda-2048; ~4 min)
        OUT=$OUT bash "$0" gemv-cuda-2048
        ;;
    mma-kernel)  # issue 4: the family's GPU tests (fast profile), its kernel alone at b1 / 32768 (~3 min)
        step 120 mma-tests python -m pytest -q -p no:cacheprovider -x tests/templates/test_decode_attention_mma.py
        step 100 fold-times python bench/fold_kernel_times.py --cases b1-32768-fp8 --splits 32 --mma 16:16:ca:8:2 \
            --json "$OUT/fold_times_mma.json"
        ;;
    mma-merge)  # issue 4: mma-kernel, then the b1 / 32768 fp8 build (~9 min)
        OUT=$OUT bash "$0" mma-kernel
        OUT=$OUT bash "$0" mma-32768-build
        ;;
    mma-32768-build)  # issue 4: b1 / 32768 fp8 built with the CUDA family (~6 min)
        step 330 decode python bench/decode.py --cases 1:32768:32832 --modes reduce-overhead,coopt-fp8 \
            --prefill 0 --agreement-steps 8 --out "$OUT/decode_mma_b1_32768.json" --build-dir /tmp/coopt-fp8
        reports reports_mma_b1_32768 coopt-fp8
        ;;
    mma-b32)  # issue 4: b32 / 2048 fp8 built with the CUDA family beside the template (~5 min)
        step 380 decode python bench/decode.py --cases 32:2048:4096 --modes reduce-overhead,coopt-fp8 \
            --prefill 0 --agreement-steps 4 --out "$OUT/decode_mma_b32.json" --build-dir /tmp/coopt-fp8
        reports reports_mma_b32 coopt-fp8
        ;;
    mma-fold-order)  # session 28's name for mma-kernel (its call 5 ran it)
        OUT=$OUT bash "$0" mma-kernel
        ;;
    mma-b32-tests)  # issue 4: the family's GPU tests (thorough), then mma-b32 (~7 min)
        COOPT_VERIFY_PROFILE=thorough step 150 mma-tests python -m pytest -q -p no:cacheprovider -x \
            tests/templates/test_decode_attention_mma.py
        OUT=$OUT bash "$0" mma-b32
        ;;
    mma-b32-8192)  # issue 4: b32 / 8192 fp8 with the CUDA family beside the template (session 23, template only: 2.445 ms)
        step 560 decode python bench/decode.py --cases 32:8192:8256 --modes reduce-overhead,coopt-fp8 \
            --prefill 0 --agreement-steps 4 --out "$OUT/decode_mma_b32_8192.json" --build-dir /tmp/coopt-fp8
        reports reports_mma_b32_8192 coopt-fp8
        ;;
    mma-next)  # issue 4, session 27's first call: the family's GPU tests (its paged form's first run), then mma-ncu (~4 min)
        COOPT_VERIFY_PROFILE=thorough step 200 mma-tests python -m pytest -q -p no:cacheprovider -x \
            tests/templates/test_decode_attention_mma.py
        OUT=$OUT bash "$0" mma-ncu
        ;;
    mma-sass)  # issue 4: where the family's kernel spends its time at b1 / 32768 beside the probe's (session 27: a quarter of
        # its warps' stall samples before the loop, q staged through shared memory behind a barrier)
        step 120 mma-sass python bench/cuda_sass.py --out "$OUT/sass"
        ncu=/usr/local/cuda/bin/ncu
        step 150 mma-source-family $ncu --clock-control none --target-processes all --section SourceCounters \
            --section WarpStateStats -k regex:coopt_decode_attention_mma --launch-count 1 -o "$OUT/family" \
            python bench/fold_kernel_times.py --once --cases b1-32768-fp8 --splits 32 --mma 16:16:ca:8:2
        step 150 mma-source-probe $ncu --clock-control none --target-processes all --section SourceCounters \
            --section WarpStateStats -k regex:coopt_decode_fp8 --launch-count 1 -o "$OUT/probe" \
            python bench/cuda_fp8_attention_probe.py --once --cases b1-32768-fp8 --splits "" --global-splits 16 \
            --warps 8 --chunks 16 --stages 2 --widens cvt --copies ca --loads-only-splits "" --advised 0
        for kernel in family probe; do
            $ncu -i "$OUT/$kernel.ncu-rep" --page source --csv --print-source sass > "$OUT/$kernel-source.csv" 2>&1
            $ncu -i "$OUT/$kernel.ncu-rep" --page details > "$OUT/$kernel-details.txt" 2>&1
            echo "$kernel: $(wc -l < "$OUT/$kernel-source.csv") source lines"
        done
        # a call brings back only a few files (session 27 lost the probe's CSV): one archive of them all
        tar -czf "$OUT/mma-sass.tar.gz" -C "$OUT" sass family-source.csv probe-source.csv family-details.txt \
            probe-details.txt && rm -rf "$OUT/sass" "$OUT"/*.ncu-rep "$OUT"/*-source.csv "$OUT"/*-details.txt
        ;;
    mma-bf16-sass)  # issue 3, session 32's lead: where the bf16 CUDA attention's rope and fold cost 0.8 µs at b1 / 2048
                    # (its bare, rope and folded launches under ncu's source counters, one launch each; ~3 min)
        ncu=/usr/local/cuda/bin/ncu
        step 200 mma-bf16-source $ncu --clock-control none --target-processes all --section SourceCounters \
            --section WarpStateStats -k regex:coopt_decode_attention_mma --launch-count 3 -o "$OUT/bf16" \
            python bench/fold_kernel_times.py --once --cases b1-2048 --splits 16 --mma 8:16:ca:8:2
        $ncu -i "$OUT/bf16.ncu-rep" --page source --csv --print-source sass > "$OUT/bf16-source.csv" 2>&1
        $ncu -i "$OUT/bf16.ncu-rep" --page details > "$OUT/bf16-details.txt" 2>&1
        tar -czf "$OUT/mma-bf16-sass.tar.gz" -C "$OUT" bf16-source.csv bf16-details.txt \
            && rm -f "$OUT"/*.ncu-rep "$OUT"/bf16-source.csv "$OUT"/bf16-details.txt
        ;;
    mma-rope)  # issue 4: where the rope form loses 1.3 µs to the bare one (session 27), then b32 with 4-warp points
        ncu=/usr/local/cuda/bin/ncu
        step 150 mma-source-rope $ncu --clock-control none --target-processes all --section SourceCounters \
            --section WarpStateStats -k regex:coopt_decode_attention_mma --launch-skip 1 --launch-count 1 -o "$OUT/rope" \
            python bench/fold_kernel_times.py --once --cases b1-32768-fp8 --splits 32 --mma 16:16:ca:8:2
        $ncu -i "$OUT/rope.ncu-rep" --page source --csv --print-source sass > "$OUT/rope-source.csv" 2>&1
        rm -f "$OUT/rope.ncu-rep"  # (a call brings back a few files: the CSV holds what is needed)
        OUT=$OUT bash "$0" mma-b32
        ;;
    mma-ncu)  # issue 4: where the family's kernel loses 2-3.5 µs to the probe's at b1 / 32768 (ncu, one launch each; ~2 min)
        metrics=gpu__time_duration.sum,sm__cycles_elapsed.max,dram__bytes_read.sum,l1tex__m_xbar2l1tex_read_bytes.sum,\
lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,launch__registers_per_thread,smsp__inst_executed.sum
        step 150 mma-ncu-family /usr/local/cuda/bin/ncu --clock-control none --target-processes all \
            -k 'regex:coopt_decode_attention_mma|_decode_split_kernel' --metrics $metrics \
            python bench/fold_kernel_times.py --once --cases b1-32768-fp8 --splits 32 --mma 16:16:ca:8:2,16:32:ca:8:2
        step 150 mma-ncu-probe /usr/local/cuda/bin/ncu --clock-control none --target-processes all \
            -k 'regex:coopt_decode_fp8' --metrics $metrics \
            python bench/cuda_fp8_attention_probe.py --once --cases b1-32768-fp8 --splits "" --global-splits 16 \
            --warps 8 --chunks 16,32 --stages 2 --widens cvt --copies cg,ca --loads-only-splits "" --advised 0
        ;;
    cuda-fp8)  # issue 4: the fp8 attention on tensor cores through mma.sync, V's bytes paired by prmt, against the template
        step 150 cuda-fp8-tests python -m pytest -q -p no:cacheprovider -x tests/bench/test_cuda_fp8_attention_probe.py
        step 400 cuda-fp8 python bench/cuda_fp8_attention_probe.py --json "$OUT/cuda_fp8_attention.json"
        ;;
    cuda-fp8-ncu)  # issue 4: every fp8 attention with compute reads 2x its cache from L2 (the probe's loads alone 1x):
        # the template too? which part of the loop doubles it? (ncu, the GPU's own clocks; ~1 min)
        step 200 cuda-fp8-ncu /usr/local/cuda/bin/ncu --clock-control none --target-processes all \
            -k 'regex:coopt_decode_fp8|_decode_split_kernel' --metrics gpu__time_duration.sum,dram__bytes_read.sum,\
l1tex__m_xbar2l1tex_read_bytes.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_tex_op_read_lookup_hit.sum,\
smsp__inst_executed_op_ldgsts.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts.sum \
            python bench/cuda_fp8_attention_probe.py --once --cases b1-131072-fp8 --splits "" --global-splits 16 --warps 4 \
            --chunks 32 --stages 2 --widens cvt,none --ablate qk,pv,softmax --copies cg,bulk --loads-only-splits 16 --advised 1
        ;;
    fp8-l2)  # issue 4, one call: cuda-fp8-ncu's profile, then cuda-fp8-copies (tests and timings; ~7 min)
        OUT=$OUT bash "$0" cuda-fp8-ncu
        OUT=$OUT bash "$0" cuda-fp8-copies
        ;;
    cuda-fp8-copies)  # issue 4: the rows into shared memory by cp.async past the L1 (cg), through it (ca), or by bulk (TMA) copies
        step 200 cuda-fp8-tests python -m pytest -q -p no:cacheprovider -x tests/bench/test_cuda_fp8_attention_probe.py
        step 380 cuda-fp8-copies python bench/cuda_fp8_attention_probe.py --cases b1-32768-fp8,b1-131072-fp8 \
            --copies cg,ca,bulk --widens cvt --stages 2 --advised 2 --json "$OUT/cuda_fp8_copies.json"
        ;;
    gemv-chain)  # issue 3: every b1 GEMV pays ~3 µs of ramp and tail: does one launch for a layer's MLP half save them?
        step 420 gemv-chain python bench/gemv_chain_probe.py --stages 4 --json "$OUT/gemv_chain.json"
        ;;
    qkv-attention)  # issue 3: b1 / 2048's attention latency: the q|k|v GEMV and the attention in one launch, a probe
        step 320 probe-2048 python bench/qkv_attention_probe.py --cases 2048 --json "$OUT/qkv_attention_2048.json"
        step 200 probe-32768 python bench/qkv_attention_probe.py --cases 32768 --block-k 256 --gemv-stages 3 \
            --json "$OUT/qkv_attention_32768.json"
        ;;
    residual32)  # issue 3/4: the b32 o and down GEMVs (12.9 and 33.5 µs a layer, session 28): advised 8 vs 40 sampled
        step 560 gemm python bench/gemm.py --shapes residual32 --variants gemv --sample 40 --advised 8 \
            --json "$OUT/gemm_residual32.json"
        ;;
    stats32)  # issue 3: b32 / 2048 is 5-33 µs over its target; its output head takes 256 µs at 32 rows against
        # 231 at one (session 22's build): is a point of the space (BLOCK_N 256, 8 warps, ...) faster than the advised four?
        step 560 gemm python bench/gemm.py --shapes stats32 --variants gemv --sample 24 --advised 8 \
            --json "$OUT/gemm_stats32.json"
        ;;
    fp8-stages)  # issue 4: 3 stages beat 2 by 10-40 % at every fp8 point (session 22): do 4-6 beat 3?
        step 300 fp8-stages python bench/v_layout_probe.py --cases b1-32768-fp8,b32-2048-fp8 --layouts rows --warps 4 \
            --stages 2,3,4,5,6 --json "$OUT/fp8_stages.json"
        # and split counts between 32 and 64 at b1 (three programs an SM where shared memory holds them)
        step 200 fp8-splits python bench/v_layout_probe.py --cases b1-32768-fp8,b1-32768 --layouts rows --warps 4 \
            --stages 2,3,4 --splits 24,32,40,48 --json "$OUT/fp8_splits.json"
        ;;
    v-layout)  # issue 4: the fp8 attention at ~2.5 TB/s; V's tiles with each head's keys contiguous (session 22)
        step 540 v-layout python bench/v_layout_probe.py --json "$OUT/v_layout.json"
        ;;
    v-words)  # issue 4: fp8 decode attention with V read as words (V_WORDS, session 16) against bytes: first its GPU
        # tests (the inline-PTX widening runs only there), then b1 at 32768 and 2048, b32 at 2048: the advisor's
        # first 6 points (each point without V_WORDS, then with) and a sample (~5-7 min)
        step 100 pytest-v-words python -m pytest -q -p no:cacheprovider -p no:logging --tb=short \
            tests/templates/test_decode_attention.py tests/templates/test_decode_attention_kv_write_fp8.py -k "v_words or fp16"
        step 330 attention python bench/attention_sweep.py --cases b1-32768-fp8,b1-2048-fp8,b32-2048-fp8 --advised 6 \
            --sample 8 --no-prefetch --json "$OUT/attention_v_words.json"
        ;;
    stream-k)  # issue 3: the GEMVs' last 5 % (b1, +62 µs over 4.2 TB/s) and the M = 32 ramp and tail (b32, +144 µs):
        # each advised GEMV point of one program a tile beside its stream-K twins (1, 2, 4 programs an SM), checked
        # against eager before and after timing (the arrival counters under real concurrency); then the GEMV tests
        step 420 gemm python bench/gemm.py --shapes layer,skinny --variants stream-k --advised 2 --json "$OUT/stream_k.json"
        step 150 pytest-gemv python -m pytest -q -p no:cacheprovider -p no:logging --tb=short \
            tests/templates/test_matmul_epilogue.py tests/templates/test_matmul_gemv_fusions.py -k "gemv or stream or glu or stats"
        ;;
    fp8-warps)  # issue 4: fp8 decode attention at 8 warps (BLOCK_N 128, admitted in session 19: half the loop a
        # thread, compiled spill-free without a GPU) against 4, b1 at 32768 and 2048, b32 at 2048: the advisor's first
        # 4 points (2 splits x 4 / 8 warps) and a sample; then the fp8 b1 / 32768 build, which now measures them (~9 min)
        step 200 attention python bench/attention_sweep.py --cases b1-32768-fp8,b1-2048-fp8,b32-2048-fp8 --advised 4 \
            --sample 4 --no-prefetch --json "$OUT/attention_fp8_warps.json"
        step 330 decode python bench/decode.py --cases 1:32768:32832 --modes coopt-fp8 --prefill 0 --agreement-steps 4 \
            --out "$OUT/decode_fp8_warps.json" --build-dir /tmp/coopt-fp8
        ;;
    fold-gpu)  # the fold's GPU tests (its templates, the builds of tests/passes that verify it, the launch choice)
        # and the folded kernel alone against kv_write + attention (session 17; ~6 min)
        step 420 pytest-fold python -m pytest -q -p no:cacheprovider -p no:logging --tb=short --durations=5 \
            tests/templates/test_decode_attention_kv_write.py tests/templates/test_decode_attention_kv_write_fp8.py \
            tests/passes/test_fuse_kv_write_attention.py tests/passes/test_launch_pdl.py \
            tests/templates/test_decode_attention.py -k "not test_decode_attention.py or one_valid_key"
        step 150 fold-kernels python bench/fold_kernel_times.py --json "$OUT/fold_kernel_times.json"
        ;;
    fold-fix)  # the fold (its row stored before the key loop) on the H200: the fold's build tests (which failed in
        # session 17 from the multiply-and-sum lanes' contracted products, not a stale read; any repro they write is
        # probed), its template tests and the one-key exactness, then the folded kernel against kv_write + attention
        # (~10 min cold: 230 s ran 5 of the 7 build tests in session 18)
        step 330 pytest-fold-builds python -m pytest -q -p no:cacheprovider -p no:logging --tb=line \
            tests/passes/test_fuse_kv_write_attention.py -k "built or batch_view" --basetemp /tmp/fold-builds
        repros=$(find /tmp/fold-builds -path '*verify/repro/*.py' 2>/dev/null | head -8)
        step 60 probe python bench/fold_probe.py $repros
        [ -n "$repros" ] && step 90 variants python bench/repro_variants.py $repros --knob NUM_WARPS=1,4 --knob NUM_STAGES=1
        step 150 pytest-fold-templates python -m pytest -q -p no:cacheprovider -p no:logging --tb=line \
            tests/templates/test_decode_attention_kv_write.py tests/templates/test_decode_attention_kv_write_fp8.py \
            tests/templates/test_decode_attention.py -k "not test_decode_attention.py or one_valid_key"
        step 130 fold-kernels python bench/fold_kernel_times.py --json "$OUT/fold_kernel_times.json"
        ;;
    fold-kernels)  # the folded attention alone against kv_write + attention at fixed points: b1 fp8 at 32768 and
        # 2048, bf16 at 2048 (bench/fold_kernel_times.py; ~2-3 min)
        step 200 fold-kernels python bench/fold_kernel_times.py --json "$OUT/fold_kernel_times.json"
        ;;
    accuracy-values)  # issue 4: the harness with the bf16 baseline, --kv-cache fp8 and values-only (~5 min)
        step 560 accuracy python bench/accuracy.py --config small --steps 2000 --device cuda --windows 128 \
            --only "coopt bf16,coopt fp8 KV per-head, smoothed K,coopt fp8 V per-head (K bf16)" \
            --out "$OUT/accuracy_values.json"
        ;;
    pdl-kinds-b32)  # issue 3: b32 / 2048 profiled with PDL off, for the GEMVs (and their norm row kernels) only, off again
        # (session 12: COOPT_PDL=gemv replayed 1775.6 us against bench/decode.py's 1789 with PDL off, not in one process;
        # at b1 no kind gained; a b32 profile needs more than 45 s)
        step 200 decode python bench/decode.py --cases 32:2048:4096 --modes coopt --prefill 0 --agreement-steps 0 \
            --out "$OUT/decode.json" --build-dir /tmp/coopt-decode
        for run in 1 2 3; do
            pdl=$([ "$run" = 2 ] && echo gemv || echo 0)
            COOPT_PDL=$pdl step 100 "profile_b32_$run" python bench/profile_step.py /tmp/coopt-decode/b32-pos2048 \
                --batch 32 --out "$OUT/profile_b32_$run.json"
        done
        ;;
    attention-latency)  # issue 3: b1 decode attention timed at growing lengths beside an empty launch (bench/NOTES-decode.md)
        step 240 latency python bench/attention_sweep.py --latency b1-2048-rope --advised 3 --json "$OUT/attention_latency.json"
        ;;
    kv-probe-recent)  # issue 4, session 42: the build's fp8 rounding with each query's newest 4 / 16 / 32 rows exact
        # (a bf16 ring of the last rows beside the fp8 cache), on the GPU-trained model (CPU: 99.19 % at 4; ~2 min)
        step 240 kv-probe-recent python bench/fp8_kv_probe.py --device cuda --only "K smoothed" \
            --out "$OUT/fp8_kv_probe_recent.json"
        ;;
    kv-probe)  # issue 4: which fp8 KV quantization reaches the top-1 target (eager, the harness's model; ~1-2 min)
        step 200 kv-probe python bench/fp8_kv_probe.py --device cuda --out "$OUT/fp8_kv_probe.json"
        ;;
    long)  # issue 4: two builds (unchunked, chunk 4096), each loaded then its weights.pt deleted; JSON after every variant
        step 580 long python bench/long_prefill.py --out "$OUT/long_prefill.json" --build-dir /tmp/coopt-long
        reports reports_long coopt-long
        ;;
    long-eager)  # long's eager rows only (with long-coopt: `parallel long-eager long-coopt` on nvidia-h200-x2)
        step 580 long python bench/long_prefill.py --variants eager,eager-chunked --out "$OUT/long_prefill.json" \
            --build-dir /tmp/coopt-long-eager
        ;;
    long-coopt)  # long's coopt rows only: the unchunked and chunk-4096 builds
        step 580 long python bench/long_prefill.py --variants coopt,coopt-chunked --out "$OUT/long_prefill.json" \
            --build-dir /tmp/coopt-long-coopt
        reports reports_long coopt-long-coopt
        ;;
    long-quick)
        step 420 long python bench/long_prefill.py --quick --out "$OUT/long_prefill_quick.json" --build-dir /tmp/coopt-long-quick
        ;;
    capacity)  # issue 4: three decode builds (paged bf16, static, paged fp8) in one 4 GiB KV budget; JSON after each
               # (session 7: 32-row paged steps, ~500 s; now each paged step takes its pool's 96 / 216 sequences)
        step 580 capacity python bench/capacity.py --throughput --out "$OUT/capacity.json" --build-dir /tmp/coopt-capacity
        reports reports_capacity coopt-capacity
        ;;
    capacity-paged)  # capacity's paged bf16 and static rows only (with capacity-fp8: `parallel capacity-paged capacity-fp8`)
        step 580 capacity python bench/capacity.py --throughput --variants paged,static --out "$OUT/capacity.json" \
            --build-dir /tmp/coopt-capacity-paged
        reports reports_capacity coopt-capacity-paged
        ;;
    capacity-fp8)  # paged fp8 only
        step 580 capacity python bench/capacity.py --throughput --variants paged-fp8 --out "$OUT/capacity.json" \
            --build-dir /tmp/coopt-capacity-fp8
        reports reports_capacity coopt-capacity-fp8
        ;;
    parallel)  # parallel STEP...: step i on GPU i (nvidia-h200-x2 / -x4), each under $OUT/gpu<i>, all back as one
               # archive; STEP may be A+B: A then B on the same GPU
        shift
        i=0
        for name in "$@"; do
            mkdir -p "$OUT/gpu$i"
            (for part in ${name//+/ }; do CUDA_VISIBLE_DEVICES=$i OUT="$OUT/gpu$i" bash "$0" "$part"; done) \
                > "$OUT/gpu$i/console.txt" 2>&1 &
            i=$((i + 1))
        done
        wait
        for dir in "$OUT"/gpu*; do echo "==== $dir"; tail -30 "$dir/console.txt"; done
        (cd "$OUT" && tar czf parallel.tar.gz gpu* && rm -rf gpu*)
        ;;
    *)
        echo "usage: bash bench/gpu_session.sh STEP (the steps above) | parallel STEP STEP..." >&2
        exit 2
        ;;
esac
