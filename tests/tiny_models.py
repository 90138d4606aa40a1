"""Real-format tiny checkpoints for tests: a byte-level BPE tokenizer with a Qwen-style chat
template, a random target saved by transformers' own `save_pretrained`, and a random z-lab-format
DFlash draft written with safetensors. Random weights: text is gibberish, formats are real."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from flashtree.train.chat_template import CHAT_TEMPLATE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<|MASK|>"]
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Hello world! 12345 + 678 = 13023",
    '{"name": "get_weather", "arguments": {"city": "Paris"}} caf\u00e9 na\u00efve \u2603 \u4f60\u597d',
    "import os\nfor i in range(10):\n    print(i * i)\nclass Foo:\n    pass\n",
] * 20


TOKENIZER_VOCAB = 400


def make_tokenizer(out: Path, vocab_size: int = TOKENIZER_VOCAB) -> int:
    """Train and save tokenizer.json + tokenizer_config.json; return the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 65536, "tokenizer_class": "PreTrainedTokenizerFast"}))
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return tok.get_vocab_size()


def hybrid_layer_types(layers: int) -> list[str]:
    """Gated DeltaNet layers with a full-attention layer every third (the last one included)."""
    return ["full_attention" if (i + 1) % 3 == 0 or i == layers - 1 else "linear_attention"
            for i in range(layers)]


def make_target(out: Path, arch: str = "qwen3", vocab_size: Optional[int] = None, seed: int = 0,
                layers: int = 4, hidden: int = 64, tie: bool = False, dtype=torch.float32,
                rope_scaling: Optional[dict] = None, text_extra: Optional[dict] = None) -> Path:
    """A random target saved with transformers (tokenizer files next to it). `text_extra`: more
    (or other) keys of a qwen3.5 text config, e.g. a newer release's published ones."""
    import transformers

    vocab = vocab_size or TOKENIZER_VOCAB
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=hidden // 4, max_position_embeddings=8192, tie_word_embeddings=tie,
                  rms_norm_eps=1e-6)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(rope_theta=10000.0, **common)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "llama":
        rope = rope_scaling or {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
        cfg = transformers.LlamaConfig(rope_theta=500000.0, rope_scaling=rope, **common)
        cls = transformers.LlamaForCausalLM
    elif arch in ("qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_5_moe_vl"):
        text = dict(common, layer_types=hybrid_layer_types(layers), linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=hidden // 8,
                    linear_value_head_dim=hidden // 8, linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.25})
        text.update(text_extra or {})
        moe = arch.startswith("qwen3_5_moe")
        if moe:  # 8 experts, 3 a token: rows of one forward hit different experts
            del text["intermediate_size"]
            text.update(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=hidden // 2,
                        shared_expert_intermediate_size=hidden)
        kinds = {"qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "Qwen3_5Config"),
                 "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeConfig")}
        text_cfg, causal_lm, vl_cfg = kinds["qwen3_5_moe" if moe else "qwen3_5"]
        if not arch.endswith("_vl"):
            cfg = getattr(transformers, text_cfg)(**text)
            cls = getattr(transformers, causal_lm)
        else:
            vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden)
            cfg = getattr(transformers, vl_cfg)(text_config=text, vision_config=vision, tie_word_embeddings=tie)
            cls = getattr(transformers, vl_cfg.replace("Config", "ForConditionalGeneration"))
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype)
    with torch.no_grad():  # larger-than-default init so logits are peaked enough to be interesting
        for name, p in model.named_parameters():
            if p.dim() == 2 or ".experts." in name:  # MoE experts are stacked [E, out, in]
                p.normal_(0, 0.08)
            elif name.endswith("norm.weight") and arch.startswith("qwen3_5"):
                p.normal_(0, 0.1)  # zero-centered norms: make the (1 + w) scale matter
    model.save_pretrained(str(out), safe_serialization=True)
    if vocab_size is None:  # after save_pretrained, which writes its own generation_config.json
        assert make_tokenizer(out) == vocab
    return out


def make_draft(out: Path, target_dir: Path, block_size: int = 8, layers: int = 1,
               target_layer_ids: Optional[list[int]] = None, seed: int = 1,
               layer_types: Optional[list[str]] = None, sliding_window: Optional[int] = None,
               mask_token_id: Optional[int] = None) -> Path:
    """A random z-lab-format DFlash draft for the target in `target_dir`."""
    tcfg = json.loads((target_dir / "config.json").read_text())
    tcfg = tcfg.get("text_config") or tcfg  # a vision-language wrapper's text model
    if mask_token_id is None:
        tok = json.loads((target_dir / "tokenizer.json").read_text())
        mask_token_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<|MASK|>")
    hidden, heads, kv, hd = tcfg["hidden_size"], 4, 2, tcfg["hidden_size"] // 4
    inter = hidden * 2
    ids = target_layer_ids if target_layer_ids is not None else [1, tcfg["num_hidden_layers"] - 2]
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": hd, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "vocab_size": tcfg["vocab_size"], "max_position_embeddings": 8192,
        "block_size": block_size, "num_target_layers": tcfg["num_hidden_layers"],
        "dflash_config": {"target_layer_ids": ids, "mask_token_id": mask_token_id},
        "torch_dtype": "float32",
    }
    if layer_types:
        cfg["layer_types"] = layer_types
        cfg["sliding_window"] = sliding_window
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    state = {"fc.weight": rnd(hidden, hidden * len(ids)), "hidden_norm.weight": 1 + rnd(hidden, std=0.1),
             "norm.weight": 1 + rnd(hidden, std=0.1)}
    for i in range(layers):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": rnd(heads * hd, hidden),
            p + "self_attn.k_proj.weight": rnd(kv * hd, hidden),
            p + "self_attn.v_proj.weight": rnd(kv * hd, hidden),
            p + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
            p + "self_attn.q_norm.weight": 1 + rnd(hd, std=0.1),
            p + "self_attn.k_norm.weight": 1 + rnd(hd, std=0.1),
            p + "mlp.gate_proj.weight": rnd(inter, hidden),
            p + "mlp.up_proj.weight": rnd(inter, hidden),
            p + "mlp.down_proj.weight": rnd(hidden, inter),
            p + "input_layernorm.weight": 1 + rnd(hidden, std=0.1),
            p + "post_attention_layernorm.weight": 1 + rnd(hidden, std=0.1),
        })
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def make_dflash2_draft(out: Path, target_dir: Path, block_size: int = 8, layers: int = 2,
                       target_layer_ids: Optional[list[int]] = None, seed: int = 2,
                       layer_types: Optional[list[str]] = None, sliding_window: Optional[int] = None,
                       is_causal: Optional[bool] = False, conv_kernel_size: int = 2, conv_group_size: int = 16,
                       selector_rank: int = 8, selector_top_k: int = 4, **dflash_extra) -> Path:
    """A random z-lab-format DFlash2 draft for the target in `target_dir`: the DFlash draft's
    tensors plus each layer's two grouped dynamic convolutions and the candidate selector (its
    codebooks under the published names, without `.weight`); the DFlash2 keys in
    `dflash_config` (`dflash_extra`: output_multiplier, final_logit_softcapping, ...)."""
    make_draft(out, target_dir, block_size, layers, target_layer_ids, seed)
    from safetensors.torch import load_file

    cfg = json.loads((out / "config.json").read_text())
    state = load_file(str(out / "model.safetensors"))
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    cfg["architectures"] = ["DFlash2DraftModel"]
    del cfg["block_size"]
    cfg["dflash_config"].update(block_size=block_size, conv_kernel_size=conv_kernel_size,
                                conv_group_size=conv_group_size, selector_rank=selector_rank,
                                selector_top_k=selector_top_k, **dflash_extra)
    if is_causal is not None:
        cfg["is_causal"] = is_causal
    if layer_types:
        cfg.update(layer_types=layer_types, sliding_window=sliding_window, use_sliding_window=True)
    g = torch.Generator().manual_seed(seed + 100)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    groups = hidden // conv_group_size
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = rnd(2, conv_kernel_size, hidden, std=0.3)
            base[:, 0] += 1.0  # about the identity, with a real pull from the row before
            state[f"layers.{i}.{conv}.base_kernel"] = base
            state[f"layers.{i}.{conv}.kernel_projection.weight"] = rnd(2 * conv_kernel_size * groups, hidden, std=0.08)
    state["candidate_selector.predecessor_codebook"] = rnd(vocab, selector_rank, std=1.0)
    state["candidate_selector.successor_codebook"] = rnd(vocab, selector_rank, std=1.0)
    state["candidate_selector.hidden_projection.weight"] = rnd(selector_rank, hidden, std=0.3)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    return out


def add_mtp(target_dir: Path, seed: int = 3) -> Path:
    """Give a saved qwen3.5 target the multi-token-prediction layer its published checkpoints
    ship (`mtp.*`, config `mtp_num_hidden_layers: 1`): fc, the two pre-fc norms, one layer of the
    target's full-attention kind (its last one's tensors, perturbed: same names and formats,
    MoE experts included) and the final norm."""
    from safetensors.torch import load_file

    cfg = json.loads((target_dir / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    text["mtp_num_hidden_layers"] = 1
    (target_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    files = sorted(target_dir.glob("*.safetensors"))
    assert len(files) == 1, files
    state = load_file(str(files[0]))
    full = max(i for i, t in enumerate(text["layer_types"]) if t == "full_attention")
    prefix = next(f"{p}layers.{full}." for p in ("model.language_model.", "model.")
                  if any(k.startswith(f"{p}layers.{full}.") for k in state))
    g = torch.Generator().manual_seed(seed)
    hidden = text["hidden_size"]

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    for key in [k for k in state if k.startswith(prefix)]:
        t = state[key]
        state["mtp.layers.0." + key[len(prefix):]] = t + rnd(*t.shape, std=0.05).to(t.dtype)
    dtype = state[prefix + "input_layernorm.weight"].dtype
    state.update({"mtp.fc.weight": rnd(hidden, 2 * hidden, std=0.08).to(dtype),
                  "mtp.pre_fc_norm_embedding.weight": rnd(hidden, std=0.1).to(dtype),
                  "mtp.pre_fc_norm_hidden.weight": rnd(hidden, std=0.1).to(dtype),
                  "mtp.norm.weight": rnd(hidden, std=0.1).to(dtype)})
    save_file({k: v.contiguous() for k, v in state.items()}, str(files[0]), metadata={"format": "pt"})
    return target_dir


def make_tiny_pair(root: Path, arch: str = "qwen3", **target_kw) -> tuple[Path, Path]:
    """(target_dir, draft_dir) under `root`."""
    target = make_target(root / "target", arch=arch, **target_kw)
    draft = make_draft(root / "draft", target)
    return target, draft


# What a hand-made model's "zero" matrices hold: the load refuses a weight matrix whose every value
# is 0 (models/checks.py: no trained one is, a zero-filled download is), and 1e-30 reads as nothing
FAINT = 1e-30


def make_scripted_target(out: Path, script: list[tuple[str, str]], new_tokens: list[str]) -> Path:
    """A qwen3 target that writes exactly what `script` says, for tests of what the server does
    with known output: reading the token `a`, it writes `b` for each (a, b) in `script` (texts
    of one token each; `new_tokens` are added to the tiny vocabulary so that they are), and
    `<|endoftext|>` (end of sequence) after any other token.

    Attention and MLP outputs are (all but) zero, so the last hidden state is the normalized embedding of
    the current token: a bigram table. Each scripted `a` embeds as its own unit vector, the
    lm_head row of its `b` reads that vector; every other token embeds as one more unit vector,
    which the end of sequence's row reads (not as zeros: logits equal for every token are what a
    zero-filled checkpoint gives, and the load refuses them)."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    make_target(out, vocab_size=TOKENIZER_VOCAB + len(new_tokens))
    make_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.add_tokens(new_tokens) == len(new_tokens)
    tok.save(str(out / "tokenizer.json"))

    def token(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, (text, ids)
        return ids[0]

    state = load_file(str(out / "model.safetensors"))
    for name, tensor in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.fill_(FAINT)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            tensor.zero_()
        elif name == "model.norm.weight":
            tensor.fill_(1.0)
    other = state["model.embed_tokens.weight"].shape[1] - 1  # the dimension of every unscripted token
    assert len({a for a, _ in script}) == len(script) <= other
    state["model.embed_tokens.weight"][:, other] = 1.0
    state["lm_head.weight"][token("<|endoftext|>"), other] = 10.0
    for k, (a, b) in enumerate(script):
        state["model.embed_tokens.weight"][token(a), other] = 0.0
        state["model.embed_tokens.weight"][token(a), k] = 1.0
        state["lm_head.weight"][token(b), k] = 10.0
    save_file(state, str(out / "model.safetensors"))
    return out


def make_tool_round_target(out: Path, call: str, answer: str, tokenizer_dir: Path) -> Path:
    """A qwen3 target on `tokenizer_dir`'s tokenizer and chat template that does one tool round,
    for real agent clients: at the end of a chat prompt (a newline) it writes `<tool_call>`,
    `call` (the call's JSON, added to the vocabulary as one token), `</tool_call>` and stops; at
    the end of a prompt that holds a `<tool_response>` (the client ran the tool and sent its
    result back) it writes `answer` (one added token) and stops.

    A bigram table, as in make_scripted_target, plus one attention head: every token embeds a
    constant direction B (read by the end-of-turn row, so an unscripted token ends the answer),
    scripted tokens their own direction, `<tool_response>` the direction R. At a newline the head's
    query matches only R's key (in the lowest-frequency RoPE pair, with a RoPE base so large that
    the score does not depend on the distance), and its value writes the flag F, which moves the
    newline's prediction from `<tool_call>` to `answer`. RMSNorm makes the scale of each row's
    readout independent of how many directions a position holds."""
    import shutil

    from tokenizers import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.add_tokens([call, answer]) == 2
    tok.save(str(out / "tokenizer.json"))

    def token(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, (text, ids)
        return ids[0]

    hidden, heads, kv_heads, hd = 64, 4, 2, 16
    vocab = tok.get_vocab_size()
    newlines = {i for text in ("\n", "\n\n") for i in tok.encode(text, add_special_tokens=False).ids[-1:]}
    script = [(token("<tool_call>"), token(call)), (token(call), token("</tool_call>"))]
    B, R, F, PAIR = hidden - 1, hidden - 2, hidden - 3, hd - 1  # PAIR: the lowest-frequency RoPE dim
    def z(*shape: int) -> torch.Tensor:  # a weight that reads as nothing (FAINT: not zeros, which the load refuses)
        return torch.full(shape, FAINT)

    embed, lm_head = z(vocab, hidden), z(vocab, hidden)
    embed[:, B] = 1.0
    lm_head[token("<|im_end|>"), B] = 5.0
    for k, (a, b) in enumerate(script):
        embed[a, k] = 1.0
        lm_head[b, k] = 10.0
    nl = len(script)
    for a in newlines:
        embed[a, nl] = 1.0
    lm_head[token("<tool_call>"), nl], lm_head[token("<tool_call>"), F] = 10.0, -20.0
    lm_head[token(answer), nl], lm_head[token(answer), F] = 5.0, 20.0
    embed[token("<tool_response>"), R] = 1.0
    q, k, v, o = z(heads * hd, hidden), z(kv_heads * hd, hidden), z(kv_heads * hd, hidden), z(hidden, heads * hd)
    q[PAIR, nl] = k[PAIR, R] = v[0, R] = 1.0
    o[F, 0] = 1.0 / (hidden / 2) ** 0.5  # the value is R's normalized coordinate: F becomes 1
    qk_norm = torch.ones(hd)
    qk_norm[PAIR] = 4.0  # score 4 * 4 * 4 = 64 against 0 for every other key
    p = "model.layers.0."
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head, "model.norm.weight": torch.ones(hidden),
             p + "input_layernorm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden),
             p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
             p + "self_attn.o_proj.weight": o, p + "self_attn.q_norm.weight": qk_norm,
             p + "self_attn.k_norm.weight": qk_norm.clone(), p + "mlp.gate_proj.weight": z(2 * hidden, hidden),
             p + "mlp.up_proj.weight": z(2 * hidden, hidden), p + "mlp.down_proj.weight": z(hidden, 2 * hidden)}
    save_file(state, str(out / "model.safetensors"))
    eos = [token("<|im_end|>"), token("<|endoftext|>")]
    (out / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": 1, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": hd, "rms_norm_eps": 1e-6, "vocab_size": vocab,
        "max_position_embeddings": 131072, "rope_theta": 1e12, "tie_word_embeddings": False,
        "eos_token_id": eos, "torch_dtype": "float32"}, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return out
