"""The peers `flashtree bench` compares against, on the same random weights: transformers'
`generate` (default dynamic cache; static cache, eager and compiled) and the reference DFlash
chain loop (`dflash` 0.1.0 from PyPI).

Each peer runs in its own process (`python -m flashtree.bench.peers ...`, one JSON line out), so
one that hangs in compilation or runs out of memory costs its own time limit and nothing else;
the seeded weight init gives that process the weights our engine was measured on.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

import torch

from .models import RandomPair, build_pair

PEERS = ("hf_default", "hf_static_eager", "hf_static_compiled", "dflash")


def _hf_target(pair: RandomPair):
    """A transformers model whose parameters are our target's tensors (no copy)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**pair.target_cfg)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
    hf.load_state_dict(pair.target.state_dict(), strict=False, assign=True)
    device = pair.target.lm_head.weight.device
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg).to(device)
    if cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    return hf.eval()


def _sync_time(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def peer_prompt(vocab: int, length: int, seed: int, device: torch.device | str = "cuda") -> torch.Tensor:
    """The prompt [1, length] every implementation decodes (the last id is the draft's mask),
    drawn on `device`: the peers' GPU, whose generator gives every process the same ids."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, vocab - 1, (1, length), device=device, generator=gen)


def _generate_ms_per_token(hf, prompt: torch.Tensor, new_tokens: int, **kw) -> dict[str, Any]:
    """Decode ms/token: (time for 1 + n tokens - time for 1 token) / n, prefill excluded."""
    out: list[torch.Tensor] = []

    def gen(n: int) -> None:
        out.append(hf.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0, **kw))

    warm = _sync_time(lambda: gen(2))  # includes any compilation
    one = _sync_time(lambda: gen(1))
    many = _sync_time(lambda: gen(1 + new_tokens))
    return {"ms_per_token": 1000 * (many - one) / new_tokens, "first_call_s": warm,
            "tokens": out[-1][0, prompt.shape[1]:].tolist()}


def _dflash_chain(pair: RandomPair, hf, prompt: torch.Tensor, new_tokens: int) -> dict[str, float]:
    import transformers
    from dflash.model import DFlashDraftModel, dflash_generate

    cfg = transformers.Qwen3Config(**pair.draft_cfg)
    with torch.device("meta"):
        draft = DFlashDraftModel(cfg)
    draft.load_state_dict(pair.draft.state_dict(), strict=False, assign=True)
    device = pair.draft.fc.weight.device
    draft.rotary_emb = type(draft.rotary_emb)(config=cfg).to(device)
    draft.eval()
    dflash_generate(draft, hf, prompt, 8, None, return_stats=True)  # warm-up
    res = dflash_generate(draft, hf, prompt, new_tokens, None, return_stats=True)
    steps = len(res.acceptance_lengths)
    decode_s = res.time_per_output_token * res.num_output_tokens
    return {"ms_per_step": 1000 * decode_s / steps, "ms_per_token": 1000 * res.time_per_output_token,
            "steps": steps, "mean_accept_length": res.num_output_tokens / steps,
            "tokens": res.output_ids[0, prompt.shape[1]:].tolist()}


@torch.inference_mode()
def run_peer(which: str, preset: str, seed: int, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    pair = build_pair(preset, "cuda", seed=seed, max_pos=prompt_len + new_tokens + 64)
    hf = _hf_target(pair)
    prompt = peer_prompt(pair.target_cfg["vocab_size"], prompt_len, seed)
    if which == "hf_default":
        return _generate_ms_per_token(hf, prompt, new_tokens)
    if which == "hf_static_eager":
        return _generate_ms_per_token(hf, prompt, new_tokens, cache_implementation="static",
                                      disable_compile=True)
    if which == "hf_static_compiled":
        return _generate_ms_per_token(hf, prompt, new_tokens, cache_implementation="static")
    if which == "dflash":
        return _dflash_chain(pair, hf, prompt, new_tokens)
    raise ValueError(f"unknown peer {which!r}; choose from {', '.join(PEERS)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("which", choices=PEERS)
    p.add_argument("--preset", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    a = p.parse_args(argv)
    res = run_peer(a.which, a.preset, a.seed, a.prompt_len, a.new_tokens)
    print(json.dumps({"peer": a.which, **res}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
