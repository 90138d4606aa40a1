#!/usr/bin/env bash
# Everything one GPU lease runs, in one command: the GPU correctness tests, then the benchmark.
#   bash benchmarks/gpu_session.sh smoke   # tests + the small preset, peers on it (a few minutes)
#   bash benchmarks/gpu_session.sh full    # qwen3-8b (all contexts/budgets, peers) + llama3.1-8b
#   bash benchmarks/gpu_session.sh recheck # after a kernel change: its tests + the 8B decode numbers
#   bash benchmarks/gpu_session.sh e2e     # the embedded pair end to end against the reference dflash
#   bash benchmarks/gpu_session.sh train; bash benchmarks/gpu_session.sh train-draft  # the embedded pair
#   bash benchmarks/gpu_session.sh redraft # more draft training for the shipped target, then e2e
#   bash benchmarks/gpu_session.sh train-client  # issue 16: the agent stage, regen and the draft, one call
#   bash benchmarks/gpu_session.sh train-repair  # issue 45: the repair stage on the shipped target, regen, draft
#   bash benchmarks/gpu_session.sh arch    # the GPU suite twice in a row, then `flashtree serve` on the GPU
#   bash benchmarks/gpu_session.sh hybrid  # the hybrid GPU tests and the qwen3.5 presets' decode numbers
#   bash benchmarks/gpu_session.sh wave2   # every GPU test, then the 27B hybrid decode numbers
#   bash benchmarks/gpu_session.sh hyfuse  # the fused hybrid kernels: their tests, 27B decode, prefill A/B
#   bash benchmarks/gpu_session.sh hyfuse  # the fused hybrid kernels' tests, 27B decode, prefill fla vs scan
#   bash benchmarks/gpu_session.sh quant   # the quantized linears' GPU tests, then their 27B and 8B step times
#   bash benchmarks/gpu_session.sh card    # a 27B hybrid snapshot's cost, then the 24 GB card's conversation
#   bash benchmarks/gpu_session.sh int4step  # quantized + hybrid GPU tests, tree scan, int4 linears, 27B and 8B int4 steps
#   bash benchmarks/gpu_session.sh int8launch  # the int8 GEMM's launches at 23 rows, then the 24 GB card's conversation
#   bash benchmarks/gpu_session.sh startup # the 24 GB card from a fresh and a kept Triton cache; PART=tests: all GPU tests
#   PART=kernels bash benchmarks/gpu_session.sh served  # int8 small groups scaled vs epilogue, quant + hybrid kernel GPU tests
#   bash benchmarks/gpu_session.sh served  # then the card's step split (inside steps, allocator calls), capped and not
#   bash benchmarks/gpu_session.sh int8tile  # int8 small groups as tiles, int4 g32 vs g128, the card, the quant GPU tests
#   PART=kernels bash benchmarks/gpu_session.sh int4tile  # int4 g32 vs g128 tiled, quant + hybrid kernel GPU tests
#   bash benchmarks/gpu_session.sh int4tile  # then the card's conversation (int4 g32 as a run's scale tile)
#   bash benchmarks/gpu_session.sh card128k  # the card at 128K (q4_0 draft cache), then the draft cache's GPU tests
# Logs, JSON and markdown go to $OUT (the device tool's folder) or ./gpu-out. The `dflash` peer
# is carried as a wheel in .whl/ (pip download dflash==0.1.0 --no-deps -d .whl). Serving there needs
# the server's and the openai client's wheels with their dependencies the device lacks (fastapi 0.165
# imports opentelemetry-api and annotated-doc; openai 3.57 needs httpx2, httpcore2, truststore). The device's copy
# of the tree may carry a stale .git: start the command with FLASHTREE_COMMIT=<the commit> so the
# results name it (flashtree/bench/provenance.py; their source_digest identifies the code anyway).
set -uo pipefail
MODE=${1:-smoke}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  nproc; } 2>&1 | tee "$OUT/machine.txt"

card_conversation() {  # the 24 GB card's agent conversation (benchmarks/card_24g.py), four turns:
                      # [a name for its results] [more card_24g.py arguments, --flags last]
  local name=card_24g_h200${1:+_$1}
  shift || true
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 420 python3 benchmarks/card_24g.py --work /tmp/card \
    --turns 52000,57000,62000,62100 --out "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.console.log" \
    | grep -v "GET /" | tail -8
}

bench() {  # name, timeout, args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m flashtree.bench --name "$name" --out-dir "$OUT" --markdown "$OUT/PERFORMANCE.md" "$@" \
    2>&1 | tee "$OUT/bench-$name.log" | grep -v '^|' | tail -40
}

case "$MODE" in
  smoke)
    timeout 300 python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py tests/test_gpu_decode.py -p no:cacheprovider \
      2>&1 | tee "$OUT/gpu-tests.log" | tail -25
    bench smoke-qwen3-1.7b 240 --preset qwen3-1.7b --contexts 1024,8192 --budgets 8,22 --prefill 1024,17408 \
      --prefill-ubatch 512 --iters 10 --peers hf_default,dflash --peer-presets qwen3-1.7b --peer-timeout 90
    ;;
  full)
    timeout 60 python3 -m pytest -q -rs -m gpu tests/test_gpu_decode.py -k oracle -p no:cacheprovider \
      2>&1 | tee "$OUT/gpu-tests-oracle.log" | tail -5
    bench qwen3-8b 300 --preset qwen3-8b --peers hf_default,dflash,hf_static_eager,hf_static_compiled \
      --peer-presets qwen3-8b --peer-timeout 80
    bench llama3.1-8b 100 --preset llama3.1-8b --contexts 1024,4096,32768 --budgets 8,22,64 --prefill 17408 \
      --prefill-ubatch 2048 --iters 15 --peers ""
    ;;
  recheck)  # after a kernel change: its tests, spec == AR, and the 8B decode numbers it moves
    timeout 120 python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py tests/test_gpu_decode.py \
      -k "attention or spec_equals_ar_256" -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -5
    bench qwen3-8b-recheck 120 --preset qwen3-8b --contexts 1024,4096,32768 --budgets 22 --prefill "" \
      --iters 20 --peers ""
    ;;
  e2e)  # issue 6, item 3: the embedded pair end to end, ours (ar, chain, ddtree) against dflash's chain
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 400 python3 benchmarks/e2e_pair.py --device cuda \
      --limit-per-kind 10 --out "$OUT" 2>&1 | tail -40
    ;;
  train)  # call 1 of 2 (carry build/recipe: the corpus built by `flashtree train corpus ... --n-agent
          # 1000` and the tokenizer; 24 MB): the agent stage on build/recipe/target (without one, on a
          # copy of the shipped target, which has had that stage already: MODEL_CARD.md), then regen
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    [ -f build/recipe/target/config.json ] || cp -r flashtree/assets/target build/recipe/target
    STOP_AFTER=regen LONG_BUDGET=${LONG_BUDGET:-150} REGEN_BUDGET=${REGEN_BUDGET:-140} timeout 570 \
      bash flashtree/train/recipe.sh build/recipe 2>&1 | tr '\r' '\n' | grep -v 'it/s]\|s/it]' | tail -20
    cp -r build/recipe/logs "$OUT/"
    ;;
  train-draft)  # call 2 of 2, right after call 1 (no carry: the machine keeps build/recipe): the draft,
                # continued from the shipped one, then issue 6's end-to-end run on the new pair.
                # Acceptance on the held-out prompts is measured afterwards on the CPU.
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    W=build/recipe
    DRAFT_INIT=${DRAFT_INIT-flashtree/assets/draft} DRAFT_STEPS=${DRAFT_STEPS:-20000} DRAFT_BUDGET=${DRAFT_BUDGET:-330} \
      DRAFT_BATCH=64 DRAFT_LR=${DRAFT_LR:-6e-4} timeout 420 \
      bash flashtree/train/recipe.sh $W 2>&1 | tr '\r' '\n' | grep -v 'it/s]\|s/it]' | tail -5
    cp -r $W/target_long $W/draft $W/logs "$OUT/"
    timeout 170 python3 benchmarks/e2e_pair.py --device cuda --target $W/target_long --draft $W/draft \
      --limit-per-kind 10 --out "$OUT" 2>&1 | tail -30
    ;;
  redraft)  # one call: continue the shipped draft on fresh regen data of the shipped target (carry a
             # WORK dir holding corpus/{train.jsonl.gz,unseen_code.jsonl.gz,heldout.jsonl} and the
             # tokenizer as build/recipe2), then the end-to-end pair benchmark on the result
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    W=build/recipe2
    [ -f $W/target/config.json ] || cp -r flashtree/assets/target $W/target
    REGEN_PER_KIND=${REGEN_PER_KIND:-12000} REGEN_BUDGET=${REGEN_BUDGET:-150} DRAFT_INIT=flashtree/assets/draft \
      DRAFT_STEPS=20000 DRAFT_BUDGET=${DRAFT_BUDGET:-210} DRAFT_BATCH=64 DRAFT_LR=${DRAFT_LR:-3e-4} DRAFT_WARMUP=50 \
      timeout 450 bash flashtree/train/recipe.sh $W 2>&1 | tr '\r' '\n' | grep -v 'it/s]\|s/it]' | tail -6
    cp -r $W/draft $W/logs "$OUT/"
    timeout 120 python3 benchmarks/e2e_pair.py --device cuda --draft $W/draft --limit-per-kind 6 --out "$OUT" \
      2>&1 | tail -40
    ;;
  train-client)  # issue 16 (carry DRAFT_INIT's folder when it is not in the repository): the corpus
                 # built here (no carry needed), the agent stage continuing the shipped target (already
                 # through the long-context stage, so it stands in for target_long too), the quick
                 # first-call check of the new target (clients.first_calls), regen on it, the draft
                 # continued from DRAFT_INIT; the pair comes back as tar parts (the device tool returns
                 # at most 8 files). With 8,000 tool rounds the corpus and its packing take ~150 s and
                 # a 330 s stage ~3,270 steps, so it takes two calls: STOP_AFTER=client first, then
                 # the stage's target carried as CLIENT_TARGET (e.g. copied over flashtree/assets/target,
                 # restored after the call) for regen and the draft (~300 s)
    # The corpus's code must come from Python 3.11.7's standard library, like the committed pair's
    # (recipe.sh CODE_CORPUS_FROM; session 9's round 8 was built here, from the image's 55 test
    # files): carry build/corpus311, made on the dev machine by `flashtree train corpus --out
    # build/corpus311` (11.6 MB).
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    export CODE_CORPUS_FROM=${CODE_CORPUS_FROM-build/corpus311}
    if [ -n "$CODE_CORPUS_FROM" ] && [ ! -f "$CODE_CORPUS_FROM/unseen_code.jsonl.gz" ]; then
      echo "train-client: carry a corpus built on Python 3.11.7 as $CODE_CORPUS_FROM (or set CODE_CORPUS_FROM=)" >&2
      exit 2
    fi
    W=build/client
    mkdir -p $W
    if [ -n "${CLIENT_TARGET:-}" ] && [ ! -f $W/target_client/config.json ]; then cp -r "$CLIENT_TARGET" $W/target_client; fi
    for d in target target_long; do [ -f $W/$d/config.json ] || cp -r flashtree/assets/target $W/$d; done
    [ -f $W/tokenizer/tokenizer.json ] || cp -r flashtree/assets/target $W/tokenizer  # the shipped tokenizer files
    N_CHAT=50000 N_TOOL=40000 N_AGENT=${N_AGENT:-300} CLIENT_AGENT=${CLIENT_AGENT:-8000} \
      COPY_DRILL=${COPY_DRILL:-50000} CLIENT_STEPS=${CLIENT_STEPS:-4000} \
      CLIENT_BUDGET=${CLIENT_BUDGET:-210} REGEN_BUDGET=${REGEN_BUDGET:-80} \
      DRAFT_INIT=${DRAFT_INIT-flashtree/assets/draft} DRAFT_STEPS=20000 DRAFT_BUDGET=${DRAFT_BUDGET:-130} \
      DRAFT_BATCH=64 DRAFT_LR=${DRAFT_LR:-6e-4} timeout 575 \
      bash flashtree/train/recipe.sh $W 2>&1 | tr '\r' '\n' | grep -v 'it/s]\|s/it]' | tail -12
    # the pair first, then the quick check (to $OUT directly): a call that runs out of its 600 s in
    # the check (round 11's did) still brings the stage's target back
    PARTS=(); for d in target_client draft logs; do [ -e $W/$d ] && PARTS+=($d); done  # no draft after STOP_AFTER=client
    tar -C $W -cf - "${PARTS[@]}" | split -b 15m - "$OUT/pair.tar.part-"
    [ -f $W/target_client/config.json ] && timeout 120 python3 -m clients.first_calls --target $W/target_client \
      --device cuda --out "$OUT/first_calls.json"
    ;;
  train-repair)  # issue 45, one call (carry build/repair311: `flashtree train corpus --out build/repair311
                 # --n-chat 50000 --n-tool 40000 --openings 40000 --tool-text 20000` on the dev machine's
                 # Python 3.11.7, without the client files, which are built here; and carry .whl with the
                 # gguf wheel: the draft step imports flashtree.models.loader, which needs it, and the
                 # image has none): the repair stage continuing the shipped target
                 # (it stands in for target, target_long and target_client, so recipe.sh skips those),
                 # regen on the repaired target, the shipped draft continued on it; the pair comes
                 # back as tar parts. Budgets (s): corpus ~30, anchor 40, stage 150 (+ packing), regen 60,
                 # draft 100
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    export CODE_CORPUS_FROM=${CODE_CORPUS_FROM-build/repair311}
    if [ ! -f "$CODE_CORPUS_FROM/openings.jsonl.gz" ]; then
      echo "train-repair: carry a corpus with openings built on Python 3.11.7 as $CODE_CORPUS_FROM" >&2
      exit 2
    fi
    W=build/repair
    mkdir -p $W
    for d in target target_long target_client; do [ -f $W/$d/config.json ] || cp -r flashtree/assets/target $W/$d; done
    [ -f $W/tokenizer/tokenizer.json ] || cp -r flashtree/assets/target $W/tokenizer
    # N_CHAT/N_TOOL 0: the chat and tool records come from CODE_CORPUS_FROM's train.jsonl.gz
    N_CHAT=0 N_TOOL=0 N_AGENT=${N_AGENT:-300} CLIENT_AGENT=${CLIENT_AGENT:-3000} COPY_DRILL=${COPY_DRILL:-20000} \
      REPAIR_ANCHOR_PER_KIND=${REPAIR_ANCHOR_PER_KIND:-3000} ANCHOR_BUDGET=${ANCHOR_BUDGET:-40} \
      REPAIR_BUDGET=${REPAIR_BUDGET:-150} REPAIR_LR=${REPAIR_LR:-3e-4} SHORT_EVERY=${SHORT_EVERY:-2} \
      REGEN_BUDGET=${REGEN_BUDGET:-60} REGEN_HELDOUT=0 \
      DRAFT_INIT=${DRAFT_INIT-flashtree/assets/draft} DRAFT_STEPS=20000 DRAFT_BUDGET=${DRAFT_BUDGET:-100} \
      DRAFT_BATCH=64 DRAFT_LR=${DRAFT_LR:-6e-4} timeout ${RECIPE_TIMEOUT:-575} \
      bash flashtree/train/recipe.sh $W 2>&1 | tr '\r' '\n' | grep -v 'it/s]\|s/it]' | tail -14
    PARTS=(); for d in target_repair draft logs; do [ -e $W/$d ] && PARTS+=($d); done
    tar -C $W -cf - "${PARTS[@]}" | split -b 15m - "$OUT/pair.tar.part-"
    ;;
  arch)  # issue 12: the GPU suite twice in a row in one process tree, then `flashtree serve` on it
    for pass in 1 2; do
      timeout 240 python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py tests/test_gpu_decode.py \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-$pass.log" | tail -6
    done
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 200 python3 benchmarks/serve_smoke.py --out "$OUT" \
      2>&1 | tail -30
    ;;
  hybrid)  # issue 13: the hybrid GPU tests, then the two hybrid presets' decode numbers at 4K
    timeout 240 python3 -m pytest -q -rs -m gpu tests/test_gpu_hybrid.py -p no:cacheprovider \
      2>&1 | tee "$OUT/gpu-tests-hybrid.log" | tail -15
    for preset in qwen3.5-4b qwen3.5-27b; do
      bench "$preset" 200 --preset "$preset" --contexts 4096 --budgets 8,22 --prefill "" --iters 10 --peers ""
    done
    ;;
  quant)  # issue 14: the quantized kernels' GPU tests, then every linear of one 27B and one 8B step
          # (QUANT_FLAGS= for the launch-parameter sweep too), then a prefill chunk through them
    timeout 240 python3 -m pytest -q -rs -m gpu tests/test_gpu_quant.py -k "launch or kernels_match or graph or float16" \
      -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-quant.log" | tail -8
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 330 python3 benchmarks/quant_gemv.py \
      ${QUANT_FLAGS---quick} --iters 10 --out "$OUT" 2>&1 | tee "$OUT/quant_gemv.log" | tail -12
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 150 python3 benchmarks/quant_prefill.py --out "$OUT" \
      2>&1 | tee "$OUT/quant_prefill.log" | tail -30
    ;;
  int4step)  # issue 14's int4 steps: the quantized and hybrid GPU tests, the tree scan's launches,
             # every int4 linear of a 27B and an 8B step, then the engine's AR and verify(22) steps
             # of both with both kernel profiles (a q4_0 cache at 4K)
    timeout 200 python3 -m pytest -q -rs -m gpu tests/test_gpu_quant.py tests/test_gpu_hybrid_kernels.py \
      tests/test_gpu_hybrid.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-int4step.log" | tail -5
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 60 python3 benchmarks/gated_delta_tree.py --out "$OUT" \
      2>&1 | tail -4
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 80 python3 benchmarks/quant_gemv.py --quick --bits 4 \
      --iters 10 --out "$OUT" 2>&1 | tail -3
    bench q27-int4-q4_0 200 --preset qwen3.5-27b --quantize int4 --kv-type q4_0 --contexts 4096 --budgets 22 \
      --prefill "" --iters 5 --peers ""
    bench q8b-int4-q4_0 100 --preset qwen3-8b --quantize int4 --kv-type q4_0 --contexts 4096 --budgets 22 \
      --prefill "" --iters 5 --peers ""
    ;;
  int8launch)  # issue 14's next leads: the int8 GEMM's launches at 23 rows (the heads and the 27B's
               # int8 linears; its default was chosen for the nibble kernel before whole codes),
               # then the 24 GB card's conversation, whose turns should compile nothing now that
               # start-up warms every short chunk (kernels_compiled_names in its JSON)
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 240 python3 benchmarks/quant_gemv.py --sweep wide --bits 8 \
      --m 23 --models lm_heads,qwen3.5-27b --iters 10 --name quant_gemv_int8_wide --out "$OUT" 2>&1 | tail -4
    card_conversation
    ;;
  startup)  # the start-up warm-ups: the 24 GB card's conversation from a fresh Triton cache, then
            # restarted over the kept one (turn 1 should compile nothing now that start-up runs
            # decode steps too); then every GPU test (PART=tests: the tests alone, a second call)
    if [ "${PART:-card}" = card ]; then
      card_conversation
      card_conversation restart --restart
    else
      timeout 560 python3 -m pytest -q -rs -m gpu tests/test_gpu_*.py -p no:cacheprovider \
        2>&1 | tee "$OUT/gpu-tests.log" | tail -15
    fi
    ;;
  served)  # the served step's 17 ms over the benchmark's at 62K (docs/PERFORMANCE.md), two calls.
           # PART=kernels first: int8 in small groups (the card's Q6_K head is int8 in groups of
           # 16), its codes scaled against the per-group epilogue, then the quantized linears' and
           # the hybrid kernels' GPU tests (the scaled int8 path, the scan's unspecialized row
           # count). Then (PART=card, the default) the card's conversation with the engine's split
           # of its decode time and its cudaMalloc/cudaFree counts, and the same files served with
           # no 24 GB cap (is it the allocator at its cap?)
    if [ "${PART:-card}" = kernels ]; then
      for group in 16 32; do
        PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 150 python3 benchmarks/quant_gemv.py --sweep scaled \
          --bits 8 --m 15,23 --group $group --models lm_heads,qwen3.5-27b --iters 10 \
          --name quant_gemv_int8_g${group}_scaled --out "$OUT" 2>&1 | tail -3
      done
      timeout 420 python3 -m pytest -q -rs -m gpu tests/test_gpu_quant.py tests/test_gpu_hybrid_kernels.py \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-kernels.log" | tail -4
    else
      card_conversation
      card_conversation uncapped --restart --flags --quantize int4 --kv-type q4_0 --quantize-draft int4
    fi
    ;;
  int8tile)  # int8 in small groups (the card's Q6_K and Q5_K linears) scaling whole tiles of a step:
             # scaled against the epilogue (with each one's error against the definition), the
             # card's conversation, then the quantized linears' GPU tests in what time is left
    for group in 16 32; do
      PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 100 python3 benchmarks/quant_gemv.py --sweep scaled \
        --bits 8 --m 15,23 --group $group --models lm_heads,qwen3.5-27b --iters 10 \
        --name quant_gemv_int8_g${group}_tiles --out "$OUT" 2>&1 | tail -2
    done
    for group in 32 128; do  # int4 in groups of 32 (the card's linears, a run's scales one tile) and of 128
      PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 70 python3 benchmarks/quant_gemv.py --quick --bits 4 \
        --m 1,15,23 --group $group --models qwen3.5-27b --iters 10 --name quant_gemv_int4_g${group} --out "$OUT" \
        2>&1 | tail -1
    done
    card_conversation
    timeout ${TESTS_S:-150} python3 -m pytest -q -rs -x -m gpu tests/test_gpu_quant.py -p no:cacheprovider \
      2>&1 | tee "$OUT/gpu-tests-quant.log" | tail -4
    ;;
  int4tile)  # int4 in groups of 32 (the card's linears) loading a run's scales as one tile: timed
             # in the engine's tiled layout against groups of 128, then the quantized linears' and
             # the hybrid kernels' GPU tests (PART=kernels); then the card's conversation
    if [ "${PART:-card}" = kernels ]; then
      for group in 32 128; do
        PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 70 python3 benchmarks/quant_gemv.py --quick --tiled \
          --bits 4 --m 1,15,23 --group $group --models qwen3.5-27b --iters 10 \
          --name quant_gemv_int4_g${group}_tiled --out "$OUT" 2>&1 | tail -12
      done
      timeout 230 python3 -m pytest -q -rs -x -m gpu tests/test_gpu_quant.py -p no:cacheprovider \
        2>&1 | tee "$OUT/gpu-tests-quant.log" | tail -4
      timeout 230 python3 -m pytest -q -rs -m gpu tests/test_gpu_hybrid_kernels.py -p no:cacheprovider \
        2>&1 | tee "$OUT/gpu-tests-hybrid-kernels.log" | tail -4
    else
      card_conversation
    fi
    ;;
  card128k)  # the 24 GB card at 128K: a Q4_K_M 27B with --draft-kv-type q4_0 (what makes it fit),
             # a conversation growing to ~126K tokens; then the quantized draft cache's GPU tests
    card_conversation 128k --turns 110000,118000,126000,126100 --max-ctx 131072 --flags --quantize int4 \
      --kv-type q4_0 --quantize-draft int4 --draft-kv-type q4_0 --gpu-memory 24G
    timeout ${TESTS_S:-120} python3 -m pytest -q -rs -m gpu tests/test_gpu_decode.py -k "draft_over_a_quantized" \
      -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-draft-kv.log" | tail -4
    ;;
  card)  # issue 14's card: the attention kernels' GPU tests, the prefill attention as planned, a
          # snapshot's cost (SNAPSHOT=1; pinned in threads, then torch's default), then the 24 GB
          # card's conversation (four turns: the last adds ~100 tokens, the per-turn fixed cost)
    timeout 200 python3 -m pytest -q -rs -m gpu tests/test_gpu_kernels.py tests/test_gpu_decode.py -k \
      "attention or quantized" -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-card.log" | tail -8
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 100 python3 benchmarks/prefill_attention.py --no-sweep \
      --out "$OUT" 2>&1 | tail -8
    if [ -n "${SNAPSHOT:-}" ]; then
      for how in "" --torch-default-pinning; do
        PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 benchmarks/snapshot_cost.py $how \
          --name "h200${how:+_torch_default}" --out "$OUT" 2>&1 | tail -28
      done
    fi
    card_conversation
    ;;
  wave2)  # after the wave-2 merges: every GPU test (dense, hybrid kernels, quantized weights and KV,
          # the capped process), then the 27B hybrid decode numbers with the fused kernels
    timeout 330 python3 -m pytest -q -rs -m gpu $(grep -l "mark.gpu" tests/test_*.py) -p no:cacheprovider \
      2>&1 | tee "$OUT/gpu-tests-wave2.log" | tail -30
    bench qwen3.5-27b 200 --preset qwen3.5-27b --contexts 4096 --budgets 8,22 --prefill "" --iters 10 --peers ""
    ;;
  hyfuse)  # issue 13 item 7 after the fused hybrid kernels (carry .whl/ with fla-core and einops
           # for the chunked prefill): their tests, the 27B decode numbers, the prefill A/B
    timeout 240 python3 -m pytest -q -rs -m gpu tests/test_gpu_hybrid_kernels.py tests/test_gpu_hybrid.py \
      -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests-hyfuse.log" | tail -15
    bench qwen3.5-27b 200 --preset qwen3.5-27b --contexts 4096 --budgets 8,22 --prefill "" --iters 10 --peers ""
    PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 120 python3 benchmarks/hybrid_prefill.py \
      --preset qwen3.5-27b --tokens 16384 --ubatch 2048 --out "$OUT/qwen3.5-27b-prefill-ab.json" 2>&1 | tail -20
    ;;
  train-hybrid)  # issue 13 item 8, call 1 of 2 (carry build/hyb: the corpus of `flashtree train corpus
                 # --out build/hyb/corpus` and the shipped tokenizer in build/hyb/tokenizer): a tiny
                 # hybrid target from scratch, then regen
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    TARGET_SIZE=tiny-hybrid STOP_AFTER=regen TARGET_BUDGET=${TARGET_BUDGET:-170} REGEN_BUDGET=${REGEN_BUDGET:-100} \
      timeout 560 bash flashtree/train/recipe.sh build/hyb 2>&1 | tr '\r' '\n' | grep -v 'it/s]\|s/it]' | tail -12
    cp build/hyb/logs/*.json "$OUT/" 2>/dev/null
    ;;
  train-hybrid-draft)  # call 2 of 2, right after call 1 (the machine keeps build/hyb): the draft; the
                       # pair comes back in 15 MB parts (cat pair.tgz.* | tar xz)
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    DRAFT_BUDGET=${DRAFT_BUDGET:-240} timeout 420 bash flashtree/train/recipe.sh build/hyb 2>&1 \
      | tr '\r' '\n' | grep -v 'it/s]\|s/it]' | tail -6
    cp build/hyb/logs/draft.json "$OUT/"
    tar czf - -C build/hyb target draft | split -b 15M - "$OUT/pair.tgz."
    ;;
  *) echo "usage: $0 smoke|full|recheck|e2e|train|train-draft|redraft|train-client|train-repair|arch|hybrid|wave2|hyfuse|quant|int4step|int8launch|card|train-hybrid[-draft]" >&2; exit 2 ;;
esac
