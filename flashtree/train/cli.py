"""`flashtree train corpus|tokenizer|target|regen|draft|average|score` and `flashtree eval-acceptance`.

Each subcommand is one step of the recipe (flashtree/train/recipe.sh runs them in order) and
prints a JSON summary on stdout, so a run's numbers can be pasted into the model card as-is.
Heavy imports (torch, transformers) happen inside the handlers, keeping `flashtree --help` fast.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .loop import LoopConfig


def _device(name: str | None) -> Any:
    import torch

    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def _add_loop_flags(p: argparse.ArgumentParser, d: LoopConfig) -> None:
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (at most, with --time-budget)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds: after a few timed steps, cap --steps to what fits (the count is logged)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps between checkpoints")
    p.add_argument("--work-dir", type=Path, default=None, help="checkpoints and logs (default: OUT_work)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)


def _loop(args: argparse.Namespace) -> LoopConfig:
    return LoopConfig(steps=args.steps, time_budget=args.time_budget, lr=args.lr, warmup=args.warmup,
                      weight_decay=args.weight_decay, checkpoint_every=args.checkpoint_every)


def _print(summary: dict[str, Any]) -> int:
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=2))
    return 0


def run_corpus(args: argparse.Namespace) -> int:
    from .corpus import build_corpus

    return _print(build_corpus(args.out, args.seed, args.n_chat, args.n_tool, args.n_heldout,
                               n_agent=args.n_agent, n_client_agent=args.client_agent, n_copy=args.copy_drill,
                               n_openings=args.openings, n_tool_text=args.tool_text))


def run_tokenizer(args: argparse.Namespace) -> int:
    from .corpus import read_jsonl, training_text
    from .tokenizer_train import save_tokenizer, train_tokenizer

    tok = train_tokenizer((training_text(r) for r in read_jsonl(args.corpus)), args.vocab_size)
    save_tokenizer(tok, args.out)
    return _print({"vocab_size": tok.get_vocab_size(), "out": str(args.out)})


def run_target(args: argparse.Namespace) -> int:
    from .target_train import TargetTrainConfig, train_target

    cfg = TargetTrainConfig(size=args.size, seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
                            short_seq_len=args.short_seq_len, short_every=args.short_every, loop=_loop(args))
    tokenizer = args.tokenizer or args.init
    if tokenizer is None:
        raise SystemExit("train target: --tokenizer is required without --init")
    return _print(train_target(args.corpus, tokenizer, args.out, cfg, _device(args.device), args.work_dir,
                               init_dir=args.init, answers_only=args.answers_only, openings=args.openings,
                               short_corpus=args.short_corpus, short_answers_only=args.short_answers_only))


def run_regen(args: argparse.Namespace) -> int:
    from .corpus import read_jsonl
    from .regen import regenerate, sample_prompts

    if args.prompts:
        prompts = list(read_jsonl(args.prompts))
    else:
        prompts = sample_prompts(args.corpus, args.per_kind, args.seed, args.code_corpus)
    return _print(regenerate(args.target, prompts, args.out, _device(args.device), args.max_new_tokens,
                             args.batch_size, args.temperature, args.max_prompt_tokens, args.time_budget, args.seed))


def run_draft(args: argparse.Namespace) -> int:
    from .draft_train import DraftTrainConfig, train_draft

    ids = [int(i) for i in args.layer_ids.split(",")] if args.layer_ids else None
    cfg = DraftTrainConfig(block_size=args.block_size, num_layers=args.layers, intermediate_size=args.intermediate_size,
                           layer_ids=ids, num_features=args.num_features, mask_token_id=args.mask_token_id,
                           max_anchors=args.max_anchors, gamma=args.gamma, batch_size=args.batch_size,
                           max_len=args.max_len, seed=args.seed, init_dir=args.init, loop=_loop(args))
    return _print(train_draft(args.target, args.data, args.out, cfg, _device(args.device), args.eval, args.work_dir))


def run_average(args: argparse.Namespace) -> int:
    from .average import average_checkpoints

    return _print(average_checkpoints(args.first, args.second, args.out, args.weight))


def run_score(args: argparse.Namespace) -> int:
    from .heldout_score import score_target

    report = score_target(args.target, args.checks.split(","), n_tool=args.n_tool, prompts=args.prompts,
                          agent_prompts=args.agent_prompts, n_agent=args.n_agent, n_code=args.n_code,
                          n_client=args.n_client, max_tokens=args.max_tokens, device=args.device)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    return _print({k: v for k, v in report.items() if k != "failures"})


def run_eval(args: argparse.Namespace) -> int:
    from .eval_acceptance import evaluate, parse_modes, write_report

    report = evaluate(args.target, args.draft, args.prompts, parse_modes(args.modes), args.max_tokens,
                      args.max_ctx, args.device, args.limit_per_kind)
    print(write_report(report, args.out))
    return 0


def add_train_parsers(sub: Any) -> None:
    """Register `train ...` and `eval-acceptance` on the top-level CLI's subparsers."""
    fmt = argparse.ArgumentDefaultsHelpFormatter
    train = sub.add_parser("train", help="build the corpus and tokenizer, train a target or a DFlash draft")
    steps = train.add_subparsers(dest="train_command", required=True)

    p = steps.add_parser("corpus", help="write train.jsonl.gz + heldout.jsonl (stdlib code, synthetic dialogues)",
                         formatter_class=fmt)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-chat", type=int, default=40_000)
    p.add_argument("--n-tool", type=int, default=30_000)
    p.add_argument("--n-heldout", type=int, default=60, help="held-out prompts of each kind")
    p.add_argument("--n-agent", type=int, default=0,
                   help="agent-framed conversations (long instructions, many tools) for the long-context stage")
    p.add_argument("--client-agent", type=int, default=0,
                   help="tool rounds in the real agent clients' requests (Claude Code, Codex, hermes, "
                        "OpenCode) for the agent stage: client_agent.jsonl.gz + client_agent_heldout.jsonl")
    p.add_argument("--copy-drill", type=int, default=0,
                   help="conversations that repeat random vocabulary tokens, for the agent stage: copy_drill.jsonl.gz")
    p.add_argument("--openings", type=int, default=0,
                   help="functions and classes of the training code cut at their def/class line, for the repair "
                        "stage's short rows: openings.jsonl.gz")
    p.add_argument("--tool-text", type=int, default=0,
                   help="tool dialogues whose results are plain text, not JSON: tool_text.jsonl.gz")
    p.set_defaults(func=run_corpus)

    p = steps.add_parser("tokenizer", help="train the byte-level BPE and write the HF tokenizer files",
                         formatter_class=fmt)
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.set_defaults(func=run_tokenizer)

    p = steps.add_parser("target", help="train a Qwen3 target from scratch, or fine-tune one (--init)",
                         formatter_class=fmt)
    p.add_argument("--corpus", type=Path, nargs="+", required=True, help="corpus files, mixed")
    p.add_argument("--answers-only", type=Path, nargs="+", default=[],
                   help="corpus files mixed in with the loss on their conversations' answers only (from "
                        "the first assistant turn on), not on their prompts")
    p.add_argument("--openings", type=Path, nargs="+", default=[],
                   help="records that each start one short row at position 0 (code cut at a def/class line: the "
                        "corpus step's openings.jsonl.gz); every --short-every-th step is a batch of such rows")
    p.add_argument("--short-corpus", type=Path, nargs="+", default=[], help="what fills the short rows")
    p.add_argument("--short-answers-only", type=Path, nargs="+", default=[],
                   help="fills the short rows too, with the loss on the answers only")
    p.add_argument("--short-seq-len", type=int, default=1024, help="tokens per short row")
    p.add_argument("--short-every", type=int, default=2, help="every Nth step is a short-row batch")
    p.add_argument("--init", type=Path, default=None,
                   help="start from this HF checkpoint (its config and weights) instead of from scratch")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="directory with the tokenizer files (default: the --init checkpoint's)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--size", default="tiny", choices=["tiny", "test", "tiny-hybrid", "test-hybrid"],
                   help="model size; *-hybrid: a Qwen3.5-style Gated DeltaNet hybrid")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=64)
    _add_loop_flags(p, LoopConfig(lr=2e-3, warmup=100, weight_decay=0.1))
    p.set_defaults(func=run_target)

    p = steps.add_parser("regen", help="let a target answer corpus prompts (draft training data)",
                         formatter_class=fmt)
    p.add_argument("--target", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", type=Path, help="sample --per-kind prompts of each kind from this corpus")
    src.add_argument("--prompts", type=Path, help="use these prompt records as they are")
    p.add_argument("--per-kind", type=int, default=3000)
    p.add_argument("--code-corpus", type=Path, default=None,
                   help="cut code prompts from these records instead (code the target never trained on, "
                        "e.g. the corpus step's unseen_code.jsonl.gz)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; stop starting batches after it")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_regen)

    p = steps.add_parser("draft", help="train a DFlash draft for any HF causal LM", formatter_class=fmt)
    p.add_argument("--target", required=True, help="HF model directory of the (frozen) target")
    p.add_argument("--data", required=True, help="JSONL: prompt_ids/completion_ids, prompt/completion, messages or text")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--eval", default=None, help="JSONL of target-generated records: report chain AL on it")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=1, help="draft decoder layers")
    p.add_argument("--intermediate-size", type=int, default=None, help="draft MLP width (default: target's)")
    p.add_argument("--layer-ids", default=None, help="comma-separated target layers to read (default: z-lab spread)")
    p.add_argument("--num-features", type=int, default=3, help="how many target layers, without --layer-ids")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--max-anchors", type=int, default=512, help="anchor blocks per sequence")
    p.add_argument("--gamma", type=float, default=None, help="loss decay over block positions")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    p.add_argument("--max-len", type=int, default=2048, help="tokens per sequence (longer ones keep their end)")
    p.add_argument("--init", default=None,
                   help="continue training this draft dir (its shape wins over the shape flags above)")
    _add_loop_flags(p, LoopConfig(lr=6e-4, warmup=50))
    p.set_defaults(func=run_draft)

    p = steps.add_parser("average", help="average two checkpoints of one model, weight by weight",
                         formatter_class=fmt)
    p.add_argument("--first", type=Path, required=True, help="a checkpoint directory (safetensors)")
    p.add_argument("--second", type=Path, required=True, help="the other; its config and tokenizer are copied")
    p.add_argument("--weight", type=float, default=0.5, help="the second's share: (1 - w) * first + w * second")
    p.add_argument("--out", type=Path, required=True, help="a new directory")
    p.set_defaults(func=run_average)

    p = steps.add_parser("score", help="a target's held-out behaviour, greedy on the CPU: tool rounds answered "
                         "from their results, chat answers, client tool rounds, agent frames, code",
                         formatter_class=fmt)
    p.add_argument("--target", default=None, help="target dir (default: the embedded model)")
    p.add_argument("--checks", default="tool,tool_text,chat,client,readme,code",
                   help="comma-separated: tool, tool_text, chat, client, agent, readme, code")
    p.add_argument("--n-tool", type=int, default=100, help="held-out generic tool rounds")
    p.add_argument("--n-client", type=int, default=60,
                   help="held-out client tool rounds (the corpus holds the first 60; more are drawn past them)")
    p.add_argument("--n-code", type=int, default=30, help="held-out code prompts")
    p.add_argument("--n-agent", type=int, default=20, help="held-out agent-framed prompts")
    p.add_argument("--prompts", default=None, help="held-out prompts for `code` (default: the shipped file)")
    p.add_argument("--agent-prompts", default=None, help="the corpus's agent_heldout.jsonl, for `agent`")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=None, help="the whole report, failing outputs included")
    p.set_defaults(func=run_score)

    p = sub.add_parser("eval-acceptance", help="acceptance length of a target/draft pair per decoding mode",
                       formatter_class=fmt)
    p.add_argument("--target", default=None, help="target dir (default: the embedded model)")
    p.add_argument("--draft", default=None, help="draft dir (default: the embedded draft)")
    p.add_argument("--prompts", required=True, help="JSONL prompt records (e.g. heldout.jsonl)")
    p.add_argument("--modes", default="chain,ddtree:22", help="chain and/or ddtree:BUDGET, comma-separated")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-ctx", type=int, default=4096)
    p.add_argument("--limit-per-kind", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--out", type=Path, default=None, help="also write the JSON report here")
    p.set_defaults(func=run_eval)
