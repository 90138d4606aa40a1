#!/usr/bin/env bash
# The GPU checks and benchmarks, one mode a command:
#   bash benchmarks/gpu_session.sh tests    # every GPU test
#   bash benchmarks/gpu_session.sh smoke    # the kernel and decode GPU tests, then the small preset's bench
#   bash benchmarks/gpu_session.sh decode   # the decode runs docs/PERFORMANCE.md's summary leads with
#   bash benchmarks/gpu_session.sh sessions # several sequences at once: their GPU tests, the 8B's and 27B's rounds
#   bash benchmarks/gpu_session.sh sessions-splits  # the 27B's rounds of 4 and 8 over 64 and 16 shared key splits
#   bash benchmarks/gpu_session.sh int4-ab BASE  # the 27B int4 step: the package at BASE, then this one's
#                                                 # with the L2 prefetch off and at 16 MB
#   bash benchmarks/gpu_session.sh deterministic [BASE]  # its GPU tests, then the 8B's step with and without
#                                                         # --deterministic (and the package at BASE with it)
#   bash benchmarks/gpu_session.sh topk     # the draft's top-k: GPU tests, then its chunk launches timed
#   bash benchmarks/gpu_session.sh card     # the 24 GB card's agent conversation (benchmarks/card_24g.py)
#   bash benchmarks/gpu_session.sh e2e      # the embedded pair end to end against the reference dflash
#   bash benchmarks/gpu_session.sh train [WORK]  # the embedded pair's recipe (flashtree/train/recipe.sh)
# Logs, JSON and markdown go to $OUT (default ./gpu-out). Wheels in .whl/ (what the machine lacks,
# e.g. the `dflash` peer: pip download dflash==0.1.0 --no-deps -d .whl) go into /tmp/site first.
# A tree without its .git names its commit through FLASHTREE_COMMIT=<commit> (flashtree/bench/
# provenance.py; each result's source_digest identifies the code anyway).
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
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

gpu_tests() {  # log name, timeout, pytest arguments...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m pytest -q -rs -m gpu "$@" -p no:cacheprovider 2>&1 | tee "$OUT/$name.log" | tail -25
}

bench() {  # name, timeout, flashtree.bench arguments...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m flashtree.bench --name "$name" --out-dir "$OUT" --markdown "$OUT/PERFORMANCE.md" "$@" \
    2>&1 | tee "$OUT/bench-$name.log" | grep -v '^|' | tail -40
}

base_bench() {  # BASE (a directory holding another commit's flashtree/), name, timeout, flashtree.bench arguments...
  [ -d "${1:-}/flashtree" ] || { echo "$MODE: BASE must hold a flashtree package" >&2; exit 2; }
  local base name=$2 limit=$3 out rest
  base=$(cd "$1" && pwd)
  out=$(cd "$OUT" && pwd)
  shift 3
  rest=${PYTHONPATH#"$PWD"}
  rest=${rest#:}  # the wheels' path, without this tree's
  (cd "$base" && PYTHONPATH=$base${rest:+:$rest} FLASHTREE_COMMIT=base timeout "$limit" python3 -m flashtree.bench \
     --name "$name" --out-dir "$out" "$@") 2>&1 | tee "$OUT/bench-$name.log" | grep -v '^|' | tail -12
}

card_conversation() {  # the 24 GB card's agent conversation (benchmarks/card_24g.py), four turns:
                      # [a name for its results] [more card_24g.py arguments, --flags last]
  local name=card_24g_h200${1:+_$1}
  shift || true
  timeout 420 python3 benchmarks/card_24g.py --work /tmp/card \
    --turns 52000,57000,62000,62100 --out "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.console.log" \
    | grep -v "GET /" | tail -8
}

case "$MODE" in
  tests)  # every GPU test
    gpu_tests gpu-tests 580 tests/
    ;;
  smoke)  # the kernel and decode GPU tests, then qwen3-1.7b's bench with the peers
    gpu_tests gpu-tests 300 tests/test_gpu_kernels.py tests/test_gpu_decode.py
    bench smoke-qwen3-1.7b 240 --preset qwen3-1.7b --contexts 1024,8192 --budgets 8,22 --prefill 1024,17408 \
      --prefill-ubatch 512 --iters 10 --peers hf_default,dflash --peer-presets qwen3-1.7b --peer-timeout 90
    ;;
  decode)  # the 27B int4 + q4_0 and the 8B bf16 decode runs (benchmarks/results/*-loop.json)
    bench q27-int4-q4_0-loop 200 --preset qwen3.5-27b --quantize int4 --kv-type q4_0 --contexts 4096 --budgets 22 \
      --prefill "" --iters 10 --peers ""
    bench q8b-loop 120 --preset qwen3-8b --contexts 4096 --budgets 22 --prefill "" --iters 10 --peers ""
    ;;
  sessions)  # the batched forward's GPU tests, then `bench --sessions` (each largest count's round profiled)
    gpu_tests gpu-sessions 240 tests/test_gpu_sequences.py tests/test_gpu_kv_pages.py tests/test_draft_top_k.py \
      tests/test_gpu_hybrid.py::test_a_batch_of_trees_scans_in_one_launch_with_the_bits_of_one_each
    bench sessions-q8b 150 --preset qwen3-8b --contexts 4096 --budgets 22 --prefill "" --peers "" --iters 10 \
      --sessions 1,2,4,8
    bench sessions-q27-int4 200 --preset qwen3.5-27b --quantize int4 --quantize-draft int4 --kv-type q4_0 \
      --contexts 4096 --budgets 22 --prefill "" --peers "" --iters 10 --sessions 1,2,4,8
    ;;
  sessions-splits)  # the 27B's wide tree launch over several sequences with fewer shared splits (the 8B's rule)
    bench sessions-q27-shared-splits 200 --preset qwen3.5-27b --quantize int4 --quantize-draft int4 --kv-type q4_0 \
      --contexts 4096 --budgets 22 --prefill "" --peers "" --iters 10 --sessions 4,8 \
      --tree-attention '[{}, {"nsplit": 16}]'
    ;;
  int4-ab)  # BASE: a directory holding another commit's flashtree/ (git archive REV flashtree | tar -x -C BASE)
    Q27=(--preset qwen3.5-27b --quantize int4 --kv-type q4_0 --contexts 4096 --budgets 22 --prefill "" --peers ""
         --iters 10)
    base_bench "${2:-}" q27-int4-base 170 "${Q27[@]}"
    for mb in 0 16; do
      FLASHTREE_L2_PREFETCH_MB=$mb bench q27-int4-prefetch$mb 170 "${Q27[@]}"
    done
    ;;
  deterministic)  # the 8B's ddtree(22) step at 4K, default and --deterministic; [BASE]: and the package at
                  # BASE (as int4-ab's) with --deterministic first
    Q8=(--preset qwen3-8b --contexts 4096 --budgets 22 --prefill "" --peers "" --iters 10)
    gpu_tests gpu-deterministic 240 tests/test_gpu_deterministic.py
    [ -n "${2:-}" ] && base_bench "$2" q8b-deterministic-base 150 "${Q8[@]}" --deterministic
    bench q8b-default 120 "${Q8[@]}"
    bench q8b-deterministic 150 "${Q8[@]}" --deterministic
    ;;
  topk)  # the draft's top-k: its GPU tests (other chunk launches included), then those launches timed
    gpu_tests gpu-topk 120 tests/test_draft_top_k.py
    timeout 120 python3 benchmarks/draft_topk.py --out "$OUT" 2>&1 | tail -6
    ;;
  card)  # the 24 GB card's conversation (arguments after the mode go to card_conversation)
    shift
    card_conversation "$@"
    ;;
  e2e)  # the embedded pair (ar, chain, ddtree) end to end against dflash's chain
    timeout 400 python3 benchmarks/e2e_pair.py --device cuda --limit-per-kind 10 --out "$OUT" 2>&1 | tail -40
    ;;
  train)  # flashtree/train/recipe.sh on WORK (default build/recipe), its knobs taken from the environment
    # CODE_CORPUS_FROM, when set, must name a corpus built on Python 3.11.7, like the committed pair's
    # (`flashtree train corpus --out DIR` run there); the pair (the last stage's target, the draft,
    # the logs) comes back as 15 MB tar parts in $OUT: cat pair.tar.part-* | tar x.
    # FROM_SHIPPED="target target_long ..." starts those stages (and the tokenizer) as the shipped target.
    W=${2:-build/recipe}
    for d in ${FROM_SHIPPED:-}; do [ -f "$W/$d/config.json" ] || { mkdir -p "$W"; cp -r flashtree/assets/target "$W/$d"; }; done
    if [ -n "${FROM_SHIPPED:-}" ] && [ ! -f "$W/tokenizer/tokenizer.json" ]; then cp -r flashtree/assets/target "$W/tokenizer"; fi
    if [ -n "${CODE_CORPUS_FROM:-}" ] && [ ! -f "$CODE_CORPUS_FROM/unseen_code.jsonl.gz" ]; then
      echo "train: CODE_CORPUS_FROM=$CODE_CORPUS_FROM holds no corpus" >&2
      exit 2
    fi
    timeout "${RECIPE_TIMEOUT:-575}" bash flashtree/train/recipe.sh "$W" 2>&1 | tr '\r' '\n' \
      | grep -v 'it/s]\|s/it]' | tail -14
    PARTS=()
    for d in target_repair target_client target_long target; do
      if [ -f "$W/$d/config.json" ]; then PARTS+=("$d"); break; fi
    done
    for d in draft logs; do [ -e "$W/$d" ] && PARTS+=("$d"); done
    [ ${#PARTS[@]} -gt 0 ] && tar -C "$W" -cf - "${PARTS[@]}" | split -b 15m - "$OUT/pair.tar.part-"
    ;;
  *) echo "usage: $0 tests|smoke|decode|sessions|sessions-splits|int4-ab BASE|deterministic [BASE]|topk|card|e2e|train [WORK]" >&2; exit 2 ;;
esac
