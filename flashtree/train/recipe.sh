#!/usr/bin/env bash
# The embedded pair's training recipe: corpus -> tokenizer -> target -> [long-context agent stage]
# -> [client agent stage] -> [repair stage] -> regen -> draft.
#
#   flashtree/train/recipe.sh WORK_DIR
#
# Leaves WORK_DIR/{corpus,tokenizer,target,target_long,target_client,target_repair,regen,draft,logs}. The corpus, tokenizer,
# target, agent-stage and regen steps are skipped when their outputs already exist, so a corpus and
# tokenizer built on another machine (the committed pair's came from Python 3.11.7's standard
# library), or a finished target, can be brought along and the GPU spends its time on what is
# left. Every knob below can be overridden from the environment; STOP_AFTER=regen ends the run
# before the draft, so that a second run (which skips what exists) trains it, STOP_AFTER=client
# right after the client agent stage and STOP_AFTER=repair after the repair stage (the draft kept as
# it is). The *_BUDGET seconds cap each
# stage so that a run fits a 10-minute job limit; the steps actually run are logged in
# WORK_DIR/logs, and flashtree/assets/MODEL_CARD.md records the exact values behind
# the shipped pair.
set -euo pipefail
WORK=${1:?usage: recipe.sh WORK_DIR}
FT=${FLASHTREE:-python3 -m flashtree.cli}

: "${N_CHAT:=50000}" "${N_TOOL:=40000}" "${VOCAB:=8192}"
: "${TARGET_SIZE:=tiny}" "${TARGET_STEPS:=20000}" "${TARGET_BUDGET:=150}" "${TARGET_BATCH:=64}" "${SEQ_LEN:=1024}"
: "${TARGET_LR:=1.5e-3}" "${TARGET_WARMUP:=100}"
: "${REGEN_PER_KIND:=8000}" "${REGEN_BUDGET:=110}" "${REGEN_BATCH:=2048}" "${REGEN_TOKENS:=256}"
: "${CLIENT_AGENT:=0}" "${COPY_DRILL:=0}" "${CLIENT_STEPS:=2000}" "${CLIENT_BUDGET:=150}" "${CLIENT_LR:=3e-4}"
: "${ANCHOR_PER_KIND:=0}" "${ANCHOR_BUDGET:=80}"
: "${N_OPENINGS:=0}" "${N_TOOL_TEXT:=0}" "${REPAIR_STEPS:=4000}" "${REPAIR_BUDGET:=150}" "${REPAIR_LR:=3e-4}"
: "${REPAIR_ANCHOR_PER_KIND:=3000}" "${SHORT_SEQ:=1024}" "${SHORT_EVERY:=2}" "${REGEN_HELDOUT:=1}"
: "${N_AGENT:=0}" "${LONG_SEQ:=16384}" "${LONG_BATCH:=4}" "${LONG_STEPS:=2000}" "${LONG_BUDGET:=150}" "${LONG_LR:=3e-4}"
: "${DRAFT_LAYERS:=2}" "${DRAFT_INTER:=1024}" "${DRAFT_LAYER_IDS:=1,3,4}" "${DRAFT_STEPS:=20000}"
: "${DRAFT_BUDGET:=170}" "${DRAFT_BATCH:=32}" "${DRAFT_ANCHORS:=128}" "${DRAFT_LR:=1e-3}" "${DRAFT_WARMUP:=100}"
: "${DRAFT_INIT:=}"  # a draft directory to continue from (e.g. flashtree/assets/draft) instead of a fresh one

log() { echo "[recipe $(date +%H:%M:%S)] $*" >&2; }
mkdir -p "$WORK/logs" "$WORK/regen"

if [ ! -f "$WORK/corpus/train.jsonl.gz" ]; then
  log "corpus"
  $FT train corpus --out "$WORK/corpus" --n-chat "$N_CHAT" --n-tool "$N_TOOL" --n-agent "$N_AGENT" \
    --client-agent "$CLIENT_AGENT" --copy-drill "$COPY_DRILL" --openings "$N_OPENINGS" --tool-text "$N_TOOL_TEXT" \
    > "$WORK/logs/corpus.json"
fi
# The code parts of a corpus come from the standard library of the Python that builds it: the
# committed pair's from Python 3.11.7 (386 modules, 883 test files as unseen code), while the GPU
# image's Python 3.12 holds 55 test files. CODE_CORPUS_FROM, a folder with train.jsonl.gz,
# unseen_code.jsonl.gz and heldout.jsonl built where the committed pair's were, replaces those
# three files (the chat, tool and agent streams are the same wherever they are built), and the
# repair stage's openings.jsonl.gz and tool_text.jsonl.gz when the folder holds them (the openings
# are cut from the training code).
if [ -n "${CODE_CORPUS_FROM:-}" ]; then
  log "corpus: train, held-out and unseen code from $CODE_CORPUS_FROM"
  for f in train.jsonl.gz unseen_code.jsonl.gz heldout.jsonl; do cp "$CODE_CORPUS_FROM/$f" "$WORK/corpus/$f"; done
  for f in openings.jsonl.gz tool_text.jsonl.gz; do
    if [ -f "$CODE_CORPUS_FROM/$f" ]; then cp "$CODE_CORPUS_FROM/$f" "$WORK/corpus/$f"; fi
  done
fi
if [ ! -f "$WORK/tokenizer/tokenizer.json" ]; then
  log "tokenizer"
  $FT train tokenizer --corpus "$WORK/corpus/train.jsonl.gz" --out "$WORK/tokenizer" --vocab-size "$VOCAB" \
    > "$WORK/logs/tokenizer.json"
fi

if [ ! -f "$WORK/target/config.json" ]; then
  log "target"
  $FT train target --corpus "$WORK/corpus/train.jsonl.gz" --tokenizer "$WORK/tokenizer" --out "$WORK/target" \
    --size "$TARGET_SIZE" --steps "$TARGET_STEPS" --time-budget "$TARGET_BUDGET" --batch-size "$TARGET_BATCH" \
    --seq-len "$SEQ_LEN" --lr "$TARGET_LR" --warmup "$TARGET_WARMUP" --work-dir "$WORK/target_work" \
    > "$WORK/logs/target.json"
fi

# With agent conversations in the corpus (N_AGENT > 0 when it was built), a long-context stage
# continues the target on them mixed with the corpus, in rows of LONG_SEQ tokens, so that it answers
# requests inside an agent client's long frame; regen and draft then use that target.
TARGET="$WORK/target"
if [ -f "$WORK/corpus/agent.jsonl.gz" ]; then
  if [ ! -f "$WORK/target_long/config.json" ]; then
    log "target: long-context stage on agent conversations"
    $FT train target --init "$WORK/target" --corpus "$WORK/corpus/train.jsonl.gz" "$WORK/corpus/agent.jsonl.gz" \
      --out "$WORK/target_long" --seq-len "$LONG_SEQ" --batch-size "$LONG_BATCH" --steps "$LONG_STEPS" \
      --time-budget "$LONG_BUDGET" --lr "$LONG_LR" --warmup 20 --work-dir "$WORK/target_long_work" \
      > "$WORK/logs/target_long.json"
  fi
  TARGET="$WORK/target_long"
fi

# With the agent clients' tool rounds in the corpus (CLIENT_AGENT > 0 when it was built), the agent
# stage continues the target on them, mixed with the corpus and the agent-framed conversations, in
# rows of LONG_SEQ tokens (hermes' requests are 14.4K tokens), so that it calls each client's own
# tools and answers from their results; regen and draft then use that target. The tool rounds are
# predicted from their first assistant turn on (--answers-only): the client frames around them are
# context, and as targets they would outweigh the few tokens that copy the request's words. A copy
# drill (COPY_DRILL > 0 when the corpus was built: random vocabulary tokens repeated) joins them, so
# that every token, not only those of the training tasks' words, is a copy target.
if [ -f "$WORK/corpus/client_agent.jsonl.gz" ]; then
  if [ ! -f "$WORK/target_client/config.json" ]; then
    log "target: agent stage on the clients' tool rounds (from $TARGET)"
    CORPORA=("$WORK/corpus/train.jsonl.gz")
    [ -f "$WORK/corpus/agent.jsonl.gz" ] && CORPORA+=("$WORK/corpus/agent.jsonl.gz")
    ANSWERS=("$WORK/corpus/client_agent.jsonl.gz")
    [ -f "$WORK/corpus/copy_drill.jsonl.gz" ] && ANSWERS+=("$WORK/corpus/copy_drill.jsonl.gz")
    # ANCHOR_PER_KIND > 0: the stage's own starting target first answers that many prompts of each
    # kind (code ones from unseen code, as for the draft), and those answers join the stage with
    # the loss on them, so that it keeps answering chat, tool and code prompts as the draft learnt
    if [ "$ANCHOR_PER_KIND" -gt 0 ]; then
      if [ ! -f "$WORK/anchor/regen.jsonl" ]; then
        log "anchor: the starting target's own answers ($ANCHOR_PER_KIND a kind)"
        mkdir -p "$WORK/anchor"
        CODE_CORPUS=()
        [ -f "$WORK/corpus/unseen_code.jsonl.gz" ] && CODE_CORPUS=(--code-corpus "$WORK/corpus/unseen_code.jsonl.gz")
        $FT train regen --target "$TARGET" --corpus "$WORK/corpus/train.jsonl.gz" --per-kind "$ANCHOR_PER_KIND" \
          "${CODE_CORPUS[@]}" --seed 1 --out "$WORK/anchor/regen.jsonl" --batch-size "$REGEN_BATCH" \
          --max-new-tokens "$REGEN_TOKENS" --time-budget "$ANCHOR_BUDGET" > "$WORK/logs/anchor.json"
      fi
      ANSWERS+=("$WORK/anchor/regen.jsonl")
    fi
    $FT train target --init "$TARGET" --corpus "${CORPORA[@]}" --answers-only "${ANSWERS[@]}" \
      --out "$WORK/target_client" \
      --seq-len "$LONG_SEQ" --batch-size "$LONG_BATCH" --steps "$CLIENT_STEPS" --time-budget "$CLIENT_BUDGET" \
      --lr "$CLIENT_LR" --warmup 20 --work-dir "$WORK/target_client_work" > "$WORK/logs/target_client.json"
  fi
  TARGET="$WORK/target_client"
fi
if [ "${STOP_AFTER:-}" = client ]; then
  log "stopping after the client agent stage (STOP_AFTER=client)"
  exit 0
fi

# With code openings in the corpus (N_OPENINGS > 0 when it was built, or brought by
# CODE_CORPUS_FROM), the repair stage continues the target on the client stage's mix in long rows
# (the corpus and agent conversations, the client tool rounds and copy drill answers-only, and the
# starting target's own answers to REPAIR_ANCHOR_PER_KIND prompts of each kind as the anchor),
# with every SHORT_EVERY-th step a batch of SHORT_SEQ-token rows that each start with a function or
# class of the training code at position 0 and go on with the corpus's chat and tool dialogues and
# the plain-text-result tool dialogues (tool_text.jsonl.gz), answers only. The long stages' rows
# start anywhere inside agent frames, and after them a bare code prompt (`def fib(n):`) was
# continued with tool-schema prose or one repeated line.
if [ -f "$WORK/corpus/openings.jsonl.gz" ]; then
  if [ ! -f "$WORK/target_repair/config.json" ]; then
    log "target: repair stage (short rows from code openings; from $TARGET)"
    CORPORA=("$WORK/corpus/train.jsonl.gz")
    [ -f "$WORK/corpus/agent.jsonl.gz" ] && CORPORA+=("$WORK/corpus/agent.jsonl.gz")
    ANSWERS=()
    for f in client_agent.jsonl.gz copy_drill.jsonl.gz; do
      if [ -f "$WORK/corpus/$f" ]; then ANSWERS+=("$WORK/corpus/$f"); fi
    done
    if [ "$REPAIR_ANCHOR_PER_KIND" -gt 0 ]; then
      if [ ! -f "$WORK/repair_anchor/regen.jsonl" ]; then
        log "anchor: the starting target's own answers ($REPAIR_ANCHOR_PER_KIND a kind)"
        mkdir -p "$WORK/repair_anchor"
        $FT train regen --target "$TARGET" --corpus "$WORK/corpus/train.jsonl.gz" --per-kind "$REPAIR_ANCHOR_PER_KIND" \
          --code-corpus "$WORK/corpus/unseen_code.jsonl.gz" --seed 1 --out "$WORK/repair_anchor/regen.jsonl" \
          --batch-size "$REGEN_BATCH" --max-new-tokens "$REGEN_TOKENS" --time-budget "$ANCHOR_BUDGET" \
          > "$WORK/logs/repair_anchor.json"
      fi
      ANSWERS+=("$WORK/repair_anchor/regen.jsonl")
    fi
    SHORT=("$WORK/corpus/train.jsonl.gz")
    [ -f "$WORK/corpus/tool_text.jsonl.gz" ] && SHORT+=("$WORK/corpus/tool_text.jsonl.gz")
    $FT train target --init "$TARGET" --corpus "${CORPORA[@]}" --answers-only "${ANSWERS[@]}" \
      --openings "$WORK/corpus/openings.jsonl.gz" --short-answers-only "${SHORT[@]}" \
      --short-seq-len "$SHORT_SEQ" --short-every "$SHORT_EVERY" --out "$WORK/target_repair" \
      --seq-len "$LONG_SEQ" --batch-size "$LONG_BATCH" --steps "$REPAIR_STEPS" --time-budget "$REPAIR_BUDGET" \
      --lr "$REPAIR_LR" --warmup 20 --work-dir "$WORK/target_repair_work" > "$WORK/logs/target_repair.json"
  fi
  TARGET="$WORK/target_repair"
fi
if [ "${STOP_AFTER:-}" = repair ]; then
  log "stopping after the repair stage (STOP_AFTER=repair)"
  exit 0
fi

if [ ! -f "$WORK/regen/train.jsonl" ]; then
  log "regen (training prompts; code prompts from code the target never trained on, when the corpus has it)"
  CODE_CORPUS=()
  [ -f "$WORK/corpus/unseen_code.jsonl.gz" ] && CODE_CORPUS=(--code-corpus "$WORK/corpus/unseen_code.jsonl.gz")
  $FT train regen --target "$TARGET" --corpus "$WORK/corpus/train.jsonl.gz" --per-kind "$REGEN_PER_KIND" \
    "${CODE_CORPUS[@]}" \
    --out "$WORK/regen/train.jsonl" --batch-size "$REGEN_BATCH" --max-new-tokens "$REGEN_TOKENS" \
    --time-budget "$REGEN_BUDGET" > "$WORK/logs/regen.json"
  if [ "$REGEN_HELDOUT" != 0 ]; then  # REGEN_HELDOUT=0: no offline AL (eval-acceptance measures it)
    log "regen (held-out prompts)"
    $FT train regen --target "$TARGET" --prompts "$WORK/corpus/heldout.jsonl" --out "$WORK/regen/heldout.jsonl" \
      --batch-size "$REGEN_BATCH" --max-new-tokens "$REGEN_TOKENS" > "$WORK/logs/regen_heldout.json"
  fi
fi
if [ "${STOP_AFTER:-}" = regen ]; then  # split a run over two device calls: the draft comes next
  log "stopping after regen (STOP_AFTER=regen)"
  exit 0
fi
log "draft"
INIT=()
[ -n "$DRAFT_INIT" ] && INIT=(--init "$DRAFT_INIT")
[ -f "$WORK/regen/heldout.jsonl" ] && INIT+=(--eval "$WORK/regen/heldout.jsonl")
$FT train draft "${INIT[@]}" --target "$TARGET" --data "$WORK/regen/train.jsonl" \
  --out "$WORK/draft" --layers "$DRAFT_LAYERS" --intermediate-size "$DRAFT_INTER" --layer-ids "$DRAFT_LAYER_IDS" \
  --steps "$DRAFT_STEPS" --time-budget "$DRAFT_BUDGET" --batch-size "$DRAFT_BATCH" --max-anchors "$DRAFT_ANCHORS" \
  --lr "$DRAFT_LR" --warmup "$DRAFT_WARMUP" --work-dir "$WORK/draft_work" > "$WORK/logs/draft.json"
log "done"
