"""`flashtree generate | serve | bench | train | eval-acceptance | plan`.

Every user-facing failure is a FlashtreeError printed as one line (exit 2); running out of memory
in one-shot generation exits 3, so scripts can tell the two apart.

Importing this module loads no torch: a subcommand's module (bench and train import torch at
their top) is imported only when that subcommand is chosen, so `flashtree serve` starts its HTTP
process without torch and every command starts without paying for the others.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any, Optional

from .config import EngineConfig, ServerConfig, add_dataclass_flags, dataclass_from_args
from .errors import EngineOutOfMemory, FlashtreeError

EXIT_USAGE, EXIT_OOM = 2, 3
# (subcommands, module, the function of that module that adds their parsers)
LAZY_COMMANDS = (
    (("serve",), "flashtree.serve.cli", "add_serve_parser"),
    (("train", "eval-acceptance"), "flashtree.train.cli", "add_train_parsers"),
    (("plan",), "flashtree.runtime.plan_cli", "add_plan_parser"),
)


def add_generate_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text once, in-process")
    add_dataclass_flags(p, EngineConfig)  # their help states their defaults
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=Path, help="JSON file with a list of prompt token ids")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user message with the chat template")
    p.add_argument("--system", help="system message (with --chat)")
    default = " (default: %(default)s)"
    p.add_argument("--max-tokens", type=int, default=128, help="completion tokens at most" + default)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy" + default)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, 1 = off" + default)
    p.add_argument("--top-k", type=int, default=0, help="0 = off" + default)
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off" + default)
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off" + default)
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="0 = off" + default)
    p.add_argument("--presence-penalty", type=float, default=0.0, help="0 = off" + default)
    p.add_argument("--seed", type=int, default=None, help="makes a sampled generation reproducible")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--trace", action="store_true", help="with --json: per-step draft/tree/accept trace")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also log the engine's setup to stderr (CPU threads, memory plan, prefill); "
                        "without it stderr holds only the one-line summary, and warnings")
    p.set_defaults(func=run_generate)


def _prompt_ids(args: argparse.Namespace, engine: Any) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = json.loads(args.prompt_ids.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise FlashtreeError(f"cannot read --prompt-ids {args.prompt_ids}: {e}") from None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise FlashtreeError(f"--prompt-ids {args.prompt_ids} must hold a JSON list of integers")
        return ids
    from .serve.prompt_tokens import encode_prompt

    text = _render_chat(engine.tokenizer, args.prompt, args.system) if args.chat else args.prompt
    # bounded like the server's prompts: a template may render far more than fits the context
    return encode_prompt(engine.tokenizer, text, engine.max_ctx, engine.max_ctx - 1)


def _render_chat(tokenizer: Any, prompt: str, system: Optional[str]) -> str:
    """The --chat prompt rendered by the checkpoint's chat template in the server's sandbox, under
    the limits a server with default settings applies (serve/template_sandbox.py): the template is
    a program from a downloaded file, which may run for hours or take gigabytes; past a limit it
    is a one-line ChatTemplateLimit. Errors name the template's source."""
    from .checkpoint import ChatTemplateError, render_chat
    from .serve.template_sandbox import RenderLimits, TemplateSandbox

    messages = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": prompt})
    sandbox = TemplateSandbox(RenderLimits.for_server(ServerConfig()))
    try:
        return render_chat(tokenizer, messages, render=sandbox.render)
    except ChatTemplateError as e:
        source = tokenizer.chat_template_source or "the model"
        raise type(e)(f"the chat template from {source}: {e}") from None
    finally:
        sandbox.close()


def run_generate(args: argparse.Namespace) -> int:
    from . import Engine, SamplingParams
    from .serve.chat import IncrementalDetokenizer

    config = dataclass_from_args(EngineConfig, args)
    if config.max_sequences is None:  # one generation: one live sequence (no other caches or graphs)
        config.max_sequences = 1
    engine = Engine.from_config(config)
    ids = _prompt_ids(args, engine)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              frequency_penalty=args.frequency_penalty,
                              presence_penalty=args.presence_penalty, seed=args.seed)
    stream = engine.stream(ids, sampling, args.max_tokens, trace=args.trace)
    detok = IncrementalDetokenizer(engine.tokenizer)
    for step_ids in stream:
        if not args.json:
            sys.stdout.write(detok.push(step_ids))
            sys.stdout.flush()
    result = stream.result
    stats = result.stats.to_dict()
    if args.json:
        out: dict[str, Any] = {"token_ids": result.token_ids,
                               "text": engine.tokenizer.decode(result.token_ids, skip_special_tokens=True),
                               "finish_reason": result.finish_reason, "stats": stats}
        if args.trace:
            out["trace"] = result.trace
        print(json.dumps(out))
    else:
        sys.stdout.write(detok.flush() + "\n")
        print(f"[{engine.mode}] {stats['completion_tokens']} tokens, finish={result.finish_reason}, "
              f"prefill {stats['prefill_s']:.3f}s, decode {stats['tokens_per_s']:.1f} tok/s, "
              f"mean accept length {stats['mean_accept_length']:.2f}", file=sys.stderr)
    return 0


def add_bench_parser(sub: Any) -> None:
    """`flashtree bench` is listed here, but its flags (--help included) are parsed by
    flashtree.bench.cli, imported only when the subcommand runs: it builds random-weight models
    and drives the peers, none of which generate, serve or train need to import."""
    sub.add_parser("bench", add_help=False,
                   help="measure decode speed on this GPU against its ceilings and peers")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser for `argv`: with the chosen subcommand's module only, or with every module when
    no known subcommand is given (`flashtree --help` lists them all)."""
    parser = argparse.ArgumentParser(prog="flashtree", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_bench_parser(sub)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    known = chosen in ("generate", "bench") or any(chosen in names for names, _, _ in LAZY_COMMANDS)
    for names, module, adder in LAZY_COMMANDS:
        if not known or chosen in names:
            getattr(importlib.import_module(module), adder)(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:  # importing it parses FLASHTREE_FAULTS: a bad value is a usage error of any command,
        importlib.import_module(".runtime.faults", __package__)  # found before any work (torch-free)
    except FlashtreeError as e:
        print(f"flashtree: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    parser = build_parser(argv)
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    # one-shot generation prints its text and a one-line summary; its setup logs are for -v
    quiet = args.command == "generate" and not args.verbose
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="flashtree: %(message)s")
    try:
        if args.command == "bench":  # the rest of the line is bench's: see add_bench_parser
            from .bench.cli import main as bench_main
            return bench_main(rest)
        return args.func(args)
    except EngineOutOfMemory as e:
        print(f"flashtree: {e}", file=sys.stderr)
        return EXIT_OOM
    except FlashtreeError as e:
        print(f"flashtree: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
