"""The target's MTP layer as a draft (`--draft mtp`, models/mtp.py) on tiny random Qwen3.5
checkpoints (dense MLP and MoE; Qwen3 dense checkpoints ship no MTP layer):

- its forward equals a reference built from transformers' own Qwen3.5 decoder layer, norms and
  RoPE (transformers has no MTP model) over a whole sequence, fed to ours in chunks;
- each decode step's proposed chain equals the reference's chain recomputed from scratch over
  the committed tokens (the draft's cache and carried hidden stay consistent across commits,
  prefix reuse and snapshots);
- greedy chain and ddtree output equal AR token for token;
- a checkpoint without mtp.* weights or a dense target: a ConfigError that says so (GGUF
  targets: tests/test_mtp_gguf.py);
- the memory plan counts the layer and its cache."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from flashtree import Engine
from flashtree.config import EngineConfig
from flashtree.errors import ConfigError
from flashtree.models.inputs import ForwardInput
from flashtree.models.loader import load_draft, read_configs
from flashtree.models.mtp import MTPConfig, MTPDraft
from flashtree.runtime.memory_plan import weight_items
from tiny_models import add_mtp, make_target

CPU = torch.device("cpu")
PROMPT = [5, 17, 99, 3, 250, 42, 7, 7, 300, 12, 64, 128, 9, 31, 200, 11]
N_TOKENS = 30


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def mtp_target(request, tmp_path_factory):
    return add_mtp(make_target(tmp_path_factory.mktemp(request.param), arch=request.param, layers=4))


def engine(target, **kw):
    kw.setdefault("max_ctx", 256)
    kw.setdefault("max_sequences", 1)
    kw.setdefault("prefill_ubatch", 7)
    return Engine.from_pretrained(str(target), "mtp", device="cpu", **kw)


def fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's per-expert MoE weights (as saved) in transformers' fused module form."""
    experts = sorted({int(k.split(".")[2]) for k in state if k.startswith("mlp.experts.")})
    if not experts:
        return state
    out = {k: v for k, v in state.items() if not k.startswith("mlp.experts.")}
    w = {name: [state[f"mlp.experts.{e}.{name}.weight"] for e in experts] for name in ("gate_proj", "up_proj", "down_proj")}
    out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(w["gate_proj"], w["up_proj"])])
    out["mlp.experts.down_proj"] = torch.stack(w["down_proj"])
    return out


class Reference:
    """The MTP definition over transformers' parts: the target's final-normed hidden states, and
    for row p: norm(layer(fc(cat(norm_e(embed(t[p+1])), norm_h(h[p]))))) at position p, causal."""

    def __init__(self, target):
        import transformers

        self.lm = transformers.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
        cfg = copy.deepcopy(self.lm.config)
        cfg.layer_types = ["full_attention"]
        module = transformers.models.qwen3_5_moe.modeling_qwen3_5_moe if "moe" in cfg.model_type \
            else transformers.models.qwen3_5.modeling_qwen3_5
        prefix = "Qwen3_5Moe" if "moe" in cfg.model_type else "Qwen3_5"
        self.layer = getattr(module, f"{prefix}DecoderLayer")(cfg, 0).eval()
        norm = getattr(module, f"{prefix}RMSNorm")
        self.norm_e, self.norm_h, self.norm = (norm(cfg.hidden_size, eps=cfg.rms_norm_eps) for _ in range(3))
        self.fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        state = {k[4:]: v for k, v in load_file(str(target / "model.safetensors")).items() if k.startswith("mtp.")}
        self.layer.load_state_dict(fused_experts({k[len("layers.0."):]: v for k, v in state.items()
                                                  if k.startswith("layers.0.")}))
        for name, mod in (("pre_fc_norm_embedding", self.norm_e), ("pre_fc_norm_hidden", self.norm_h),
                          ("norm", self.norm), ("fc", self.fc)):
            mod.weight.data.copy_(state[f"{name}.weight"])

    @torch.no_grad()
    def hidden(self, ids: list[int]) -> torch.Tensor:
        """The target's final-normed hidden state of every position [T, H]."""
        return self.lm.model(torch.tensor([ids])).last_hidden_state[0]

    @torch.no_grad()
    def mtp(self, next_ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """Rows p = 0..T-1 (token p+1, hidden p) -> final-normed outputs [T, H]."""
        e = self.lm.model.embed_tokens(torch.tensor(next_ids))
        x = self.fc(torch.cat([self.norm_e(e), self.norm_h(hidden)], dim=-1))[None]
        pos = torch.arange(x.shape[1])[None]
        out = self.layer(x, position_embeddings=self.lm.model.rotary_emb(x, pos), position_ids=pos)
        return self.norm(out[0] if isinstance(out, tuple) else out)[0]

    def chain(self, committed: list[int], bonus: int, depth: int) -> list[int]:
        """The draft's top-1 chain after `committed` and its pending `bonus`: the first step is
        the row (bonus, hidden of the last committed position), each next one feeds the previous
        step's argmax and output."""
        h = self.hidden(committed)
        tokens, hiddens, out = committed[1:] + [bonus], list(h), []
        for _ in range(depth):
            o = self.mtp(tokens, torch.stack(hiddens))[-1]
            out.append(int(self.lm.lm_head(o).argmax()))
            tokens.append(out[-1])
            hiddens.append(o)
        return out


@pytest.fixture(scope="module")
def reference(mtp_target):
    return Reference(mtp_target)


@torch.inference_mode()
def test_forward_matches_reference_across_chunks(mtp_target, reference):
    _, lm, cfg = read_configs(mtp_target, mtp_target, mtp=True)
    assert isinstance(cfg, MTPConfig) and cfg.target_layer_ids == [lm.num_layers - 1]
    draft = load_draft(mtp_target, cfg, torch.float32, CPU, 64)
    assert isinstance(draft, MTPDraft)
    h = reference.hidden(PROMPT)
    want = reference.mtp(PROMPT[1:], h[:-1])
    rows = torch.cat([reference.lm.model.embed_tokens(torch.tensor(PROMPT[1:])), h[:-1]], dim=-1)
    cache = draft.new_cache(64, torch.float32, CPU)
    got = [draft(ForwardInput(embeds=rows[a:b], cache=cache, lengths=torch.tensor([a], dtype=torch.int32)))
           for a, b in ((0, 6), (6, 7), (7, len(rows)))]
    torch.testing.assert_close(torch.cat(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_greedy_equals_ar_and_each_draft_is_the_reference_chain(mtp_target, reference, mode):
    """Every step's proposed chain is the reference's from the committed tokens alone, and the
    output is AR's: a second turn reuses the first's prefix (its checkpoint, the carried hidden
    restored with it) and keeps both."""
    ar = engine(mtp_target, mode="ar")
    eng = engine(mtp_target, mode=mode)
    turn2, checked = None, 0
    for prompt in (PROMPT, None):
        if prompt is None:  # the next turn: the conversation so far plus a few new tokens
            prompt = turn2
        want = ar.generate(prompt, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids
        res = eng.generate(prompt, max_tokens=N_TOKENS, stop_token_ids=[], trace=True)
        assert res.token_ids == want
        done = 1  # the prefill's token, the first bonus
        for step in res.trace:
            committed, bonus = prompt + want[:done - 1], want[done - 1]
            depth = eng.block_size - 1
            if step["draft_tokens"]:  # (the last steps have no room for a draft)
                assert step["draft_tokens"][:depth] == reference.chain(committed, bonus, depth)
                checked += 1
            done += len(step["accepted"])
        turn2 = prompt + want + [3, 19, 240]
    assert res.stats.cached_tokens > 0 and checked > N_TOKENS


@pytest.mark.parametrize("arch", ["qwen3_5_vl", "qwen3_5_moe_vl"])
@pytest.mark.parametrize("mode,budget", [("chain", 22), ("ddtree", 8)])
def test_vision_language_checkpoints_greedy_equals_ar(tmp_path_factory, arch, mode, budget):
    target = add_mtp(make_target(tmp_path_factory.mktemp(arch), arch=arch, layers=4))
    want = engine(target, mode="ar").generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids
    res = engine(target, mode=mode, budget=budget, block_size=3).generate(PROMPT, max_tokens=N_TOKENS,
                                                                           stop_token_ids=[])
    assert res.token_ids == want


def test_refused_without_mtp_weights_or_with_a_dense_target(tmp_path):
    plain = make_target(tmp_path / "hybrid", arch="qwen3_5", layers=4)
    with pytest.raises(ConfigError, match=r"no MTP weights \(mtp\.\*\)"):
        Engine(EngineConfig(target=str(plain), draft="mtp", device="cpu"))
    dense = make_target(tmp_path / "dense", arch="qwen3", layers=2)
    with pytest.raises(ConfigError, match="needs a Qwen3.5 / 3.6 target"):
        read_configs(dense, dense, mtp=True)


def test_memory_plan_counts_the_layer_and_its_cache(mtp_target):
    eng = engine(mtp_target, mode="ddtree")
    draft_weights = sum(b for name, b in eng.memory_plan.items if name.startswith("draft weights"))
    assert draft_weights == sum(t.numel() * t.element_size() for t in eng.draft.state_dict().values())
    assert eng.layout.draft_kv_bytes == eng.state.draft.pool.nbytes
    assert any(name.startswith("draft KV") for name, _ in eng.memory_plan.items)
    raw, lm, cfg = read_configs(mtp_target, mtp_target, mtp=True)
    assert any(name.startswith("draft weights") for name, _ in weight_items(lm, cfg, torch.float32, None))


def test_quantized_draft_greedy_equals_ar(mtp_target):
    want = engine(mtp_target, mode="ar").generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids
    eng = engine(mtp_target, mode="ddtree", quantize_draft="int8")
    assert eng.generate(PROMPT, max_tokens=N_TOKENS, stop_token_ids=[]).token_ids == want


def test_plan_counts_the_mtp_draft(mtp_target, capsys):
    from flashtree.cli import main

    assert main(["plan", "--target", str(mtp_target), "--draft", "mtp", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "draft weights" in out and "draft KV" in out
