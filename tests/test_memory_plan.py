"""The memory plan counts what the engine really allocates, per weight and KV type; --gpu-memory
sizes it and refuses what cannot fit in one line; `flashtree plan` prints it from config.json
files or a GGUF header alone (the directories here hold no weights at all)."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from flashtree import Engine
from flashtree.bench.models import draft_config, target_config
from flashtree.cli import main
from flashtree.runtime.byte_counts import kv_value_bytes
from flashtree.config import EngineConfig
from flashtree.errors import ConfigError
from flashtree.models.loader import read_configs
from flashtree.runtime.memory_plan import GiB, check_plan, planner, target_weights
from test_hybrid import hybrid_pair  # noqa: F401 (a fixture)

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS = REPO_ROOT / "flashtree" / "assets"
pytestmark = pytest.mark.skipif(not (ASSETS / "target").is_dir(), reason="no embedded model in this checkout")


def item(plan, prefix: str) -> int:
    """The bytes of the plan's items named `prefix...` (a per-sequence item: `N x prefix...`)."""
    return sum(b for name, b in plan.items if re.sub(r"^\d+ x ", "", name).startswith(prefix))


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def config_only(root: Path, preset: str) -> tuple[Path, Path]:
    """A target's and its draft's config.json, nothing else."""
    dirs = root / preset / "target", root / preset / "draft"
    for d, cfg in zip(dirs, (target_config(preset), draft_config(preset))):
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(cfg))
    return dirs


def plan_json(capsys, *args: str) -> tuple[int, dict]:
    code = main(["plan", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def test_kv_value_bytes_per_type():
    assert kv_value_bytes("auto", torch.float32) == 4 and kv_value_bytes("auto", torch.bfloat16) == 2
    assert kv_value_bytes("bf16", torch.float32) == 2 and kv_value_bytes("fp8", torch.bfloat16) == 1
    assert kv_value_bytes("q8_0", torch.bfloat16) * 32 == 34 and kv_value_bytes("q4_0", torch.bfloat16) * 32 == 18


def held(model) -> int:
    """Bytes a loaded model holds, tied tensors once, the RoPE tables (an item of their own) not."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return nbytes(tensors.values()) - nbytes(model.rope.buffers())


@pytest.mark.parametrize("dtype,quantize,kv_type,quantize_draft,draft_kv_type", [
    ("float32", None, "auto", None, "auto"), ("bfloat16", None, "auto", None, "auto"),
    ("float32", "int4", "q8_0", None, "auto"), ("bfloat16", "int8", "q4_0", None, "q8_0"),
    ("float32", None, "fp8", None, "fp8"), ("float32", "int4", "q8_0", "int8", "auto"),
    ("bfloat16", "int4", "q4_0", "int4", "q4_0"), ("bfloat16", None, "auto", "int8", "bf16")])
def test_plan_matches_the_embedded_pairs_real_allocation(dtype, quantize, kv_type, quantize_draft, draft_kv_type):
    """The embedded target ties its lm_head: quantized, the two share one int8 table."""
    eng = Engine.from_pretrained(dtype=dtype, max_ctx=300, quantize=quantize, kv_type=kv_type,
                                 quantize_draft=quantize_draft, draft_kv_type=draft_kv_type)
    plan = eng.memory_plan
    assert item(plan, "target weights") == held(eng.target)
    assert item(plan, "draft weights") == held(eng.draft)
    assert len(eng.sequences) == plan.layout.sequences > 1, "the tiny pair's states fit several times"
    target_pool, draft_pool = (cache.pool for cache in eng.state.kv_caches())
    assert all(seq.state.target.pool is target_pool and seq.state.draft.pool is draft_pool for seq in eng.sequences)
    assert item(plan, "target KV") == target_pool.nbytes
    assert item(plan, "draft KV") == draft_pool.nbytes
    assert item(plan, "RoPE") == nbytes([*eng.target.rope.buffers(), *eng.draft.rope.buffers()])


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_plan_matches_a_hybrids_real_allocation(tmp_path, arch):
    from tiny_models import make_draft, make_target
    target = make_target(tmp_path / "t", arch=arch, layers=6)
    eng = Engine.from_pretrained(str(target), str(make_draft(tmp_path / "d", target)), max_ctx=128, budget=30)
    plan, s, n = eng.memory_plan, eng.state.target, len(eng.sequences)
    assert n == plan.layout.sequences and all(seq.state.target.kv.pool is s.kv.pool for seq in eng.sequences)
    assert item(plan, "target weights") == nbytes({id(p): p for p in eng.target.parameters()}.values())
    assert item(plan, "target KV") == s.kv.pool.nbytes
    assert item(plan, "recurrent states") == n * nbytes([s.ssm, s.conv, s.pending_ssm, s.pending_conv])
    assert item(plan, "tree nodes") == n * nbytes([s.node_conv, s.node_k, s.node_v, s.node_g, s.node_beta])
    assert item(plan, "recurrent state checkpoints") == n * eng.config.state_checkpoints * nbytes([s.ssm, s.conv])
    assert eng.layout is plan.layout and s.capacity == plan.layout.rows and s.node_k.shape[0] == plan.layout.node_rows


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_plan_matches_an_untied_quantized_pairs_real_allocation(tmp_path, arch):
    """An untied lm_head and the embedding table are two int8 tables; the draft's linears int4."""
    from flashtree.models.quant import QuantizedEmbedding, QuantizedLinear
    from tiny_models import make_draft, make_target
    target = make_target(tmp_path / "t", arch=arch, layers=3, tie=False)
    eng = Engine.from_pretrained(str(target), str(make_draft(tmp_path / "d", target)), max_ctx=128,
                                 quantize="int4", quantize_draft="int4")
    head, table = eng.target.lm_head, eng.target.model.embed_tokens
    assert isinstance(head, QuantizedLinear) and isinstance(table, QuantizedEmbedding)
    assert head.bits == table.bits == 8 and head.codes.data_ptr() != table.codes.data_ptr()
    assert {m.bits for m in eng.draft.modules() if isinstance(m, QuantizedLinear)} == {4}
    assert isinstance(eng.draft.fc, QuantizedLinear)
    assert item(eng.memory_plan, "target weights") == held(eng.target)
    assert item(eng.memory_plan, "draft weights") == held(eng.draft)


@pytest.mark.parametrize("quantize,bits", [("int8", 8), ("int4", 4)])
def test_quantized_weights_are_codes_plus_a_scale_and_minimum_per_group(quantize, bits):
    """Qwen3-8B's shape: every projection quantized in groups of 128, the embedding and the
    (untied) lm_head int8 g128 whatever the layers get; norms stay in the model's dtype."""
    from flashtree.models.loader import target_config as parse
    lm = parse(target_config("qwen3-8b"))
    h, hd, layers = lm.hidden_size, lm.head_dim, lm.num_layers
    linear = layers * (h * hd * (2 * lm.num_heads + 2 * lm.num_kv_heads) + 3 * h * lm.intermediate_size)
    norms = layers * (2 * h + 2 * hd) + h
    got = target_weights(lm, torch.bfloat16, quantize)
    tables = 2 * lm.vocab_size * h
    want = {"bfloat16 (dense)": 2 * norms, "int8 g128": tables + tables // 128 * 4}
    want[f"int{bits} g128"] = want.get(f"int{bits} g128", 0) + linear * bits // 8 + linear // 128 * 4
    assert not lm.tie_word_embeddings and got == want
    assert sum(target_weights(lm, torch.bfloat16, None).values()) == 2 * (2 * lm.vocab_size * h + norms + linear)


def test_gguf_tensors_count_as_the_loader_keeps_them(tmp_path):
    """From the header alone: a packed slot's parts in their common format (q/k/v with a Q6_K
    value part: all int8 g16), single slots at their own in-memory size (not the file's), the
    quantized embedding table too (QuantizedEmbedding; IQ4_XS, 4-bit codes under an int8
    sub-scale per 32 and a float16 super-scale per 256, and its 64-byte table), norms dense in
    the model's dtype; an appended MTP block (blk.1 of a 1-layer model) is not loaded, so not
    counted."""
    import gguf
    from flashtree.runtime.byte_counts import gguf_weight_bytes
    Q = gguf.GGMLQuantizationType
    shapes = {"blk.0.attn_q.weight": (Q.Q4_K, 64, 512), "blk.0.attn_k.weight": (Q.Q4_K, 16, 512),
              "blk.0.attn_v.weight": (Q.Q6_K, 16, 512), "blk.0.ffn_gate.weight": (Q.Q5_K, 32, 512),
              "blk.0.ffn_up.weight": (Q.Q5_K, 32, 512), "blk.0.ffn_down.weight": (Q.Q6_K, 64, 256),
              "blk.0.attn_output.weight": (Q.Q4_0, 64, 96), "token_embd.weight": (Q.IQ4_XS, 100, 256),
              "output.weight": (Q.Q8_0, 100, 256), "output_norm.weight": (Q.F32, 1, 32),
              "blk.1.nextn.eh_proj.weight": (Q.Q8_0, 8, 64)}
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3")
    for name, (kind, rows, cols) in shapes.items():
        if kind in (Q.F16, Q.F32):
            writer.add_tensor(name, np.zeros((rows, cols), np.float16 if kind == Q.F16 else np.float32))
            continue
        block, size = gguf.GGML_QUANT_SIZES[kind]
        writer.add_tensor(name, np.zeros((rows, cols // block * size), np.uint8), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def quant(rows, cols, bits, group):
        return rows * cols * bits // 8 + rows * cols // group * 4

    assert gguf_weight_bytes(tmp_path / "m.gguf", torch.bfloat16, num_layers=1) == {
        "int8 g16": quant(96, 512, 8, 16) + quant(64, 256, 8, 16),
        "int8 g32": quant(64, 512, 8, 32) + quant(100, 256, 8, 32),
        "int4 g32": quant(64, 96, 4, 32),
        "int4 IQ4_XS g32/256": 100 * 256 * 4.3125 / 8 + 64,
        "bfloat16 (dense)": 2 * 32}


def test_plan_cli_reads_configs_alone_and_its_largest_max_ctx_is_exact(tmp_path, capsys):
    target, draft = config_only(tmp_path, "qwen3-8b")
    base = ["--target", str(target), "--draft", str(draft), "--gpu-memory", "24G", "--max-sequences", "1"]
    code, small = plan_json(capsys, *base, "--max-ctx", "4096")
    assert code == 0 and small["fits"] and small["free"] >= 0
    best = small["largest_max_ctx"]
    assert 4096 < best < 40960, "bf16 8B weights leave about 7 GiB of KV at 144 KiB a token"
    assert plan_json(capsys, *base, "--max-ctx", str(best))[0] == 0
    code, over = plan_json(capsys, *base, "--max-ctx", str(best + 1))
    assert code == 1 and not over["fits"] and over["largest_max_ctx"] == best
    code, q4 = plan_json(capsys, *base, "--max-ctx", str(best + 1), "--kv-type", "q4_0")
    assert code == 0 and q4["largest_max_ctx"] == 40960, "at most the model's max_position_embeddings"
    kv = {row["name"].split(",")[0]: row["bytes"] for row in over["items"] if " KV" in row["name"]}
    kv4 = {row["name"].split(",")[0]: row["bytes"] for row in q4["items"] if " KV" in row["name"]}
    assert kv4 == {"target KV pool": kv["target KV pool"] * 18 // 64, "draft KV pool": kv["draft KV pool"]}, \
        "q4_0 is 18 bytes per 32 values, bf16 64; the draft's cache stays in the model dtype"
    code, ar = plan_json(capsys, *base, "--max-ctx", str(best), "--mode", "ar")
    assert code == 0 and ar["draft"] is None and ar["largest_max_ctx"] > best
    assert not [row for row in ar["items"] if row["name"].startswith("draft")]


def test_plan_cli_text_for_a_27b_hybrid_at_64k(tmp_path, capsys):
    target, draft = config_only(tmp_path, "qwen3.5-27b")
    args = ["plan", "--target", str(target), "--draft", str(draft), "--gpu-memory", "24G", "--max-ctx", "65536"]
    assert main(args) == 1, "bf16 weights of 27B alone exceed 24 GB"
    out = capsys.readouterr().out
    assert "verdict: does not fit" in out and "no --max-ctx fits" in out and "recurrent states" in out
    code, q4 = plan_json(capsys, *args[1:], "--quantize", "int4", "--kv-type", "q4_0")
    assert q4["largest_max_ctx"] >= 16384 and code == (0 if q4["largest_max_ctx"] >= 65536 else 1)
    assert main(args[:-1] + [str(q4["largest_max_ctx"]), "--quantize", "int4", "--kv-type", "q4_0"]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits" in out and "int4 g128" in out and "K q4_0, V q4_0" in out


def test_the_27b_hybrid_with_its_quantized_draft_fits_a_24g_card_at_64k(tmp_path, capsys):
    """The int8 embedding/lm_head and a quantized draft are what make 64K fit (docs/QUANTIZATION.md,
    "24 GB card"): the plan's weight rows are the quantized sizes, and an int4 draft leaves more context
    than an int8 one, which leaves more than a dense one."""
    target, draft = config_only(tmp_path, "qwen3.5-27b")
    args = ["--target", str(target), "--draft", str(draft), "--gpu-memory", "24G", "--max-ctx", "65536",
            "--quantize", "int4", "--kv-type", "q8_0"]
    best = {}
    for kind in (None, "int8", "int4"):
        code, plan = plan_json(capsys, *args, *(["--quantize-draft", kind] if kind else []))
        rows = {row["name"]: row["bytes"] for row in plan["items"]}
        assert plan["quantize_draft"] == kind and rows["target weights, int8 g128"] > 0  # the embedding/lm_head
        if kind is not None:
            assert code == 0 and plan["fits"] and rows[f"draft weights, {kind} g128"] > 0
        best[kind] = plan["largest_max_ctx"]
    assert best[None] < 65536 <= best["int8"] < best["int4"]


def test_a_quantized_draft_cache_is_what_takes_the_27b_pair_to_128k_on_a_24g_card(tmp_path, capsys):
    """At 128K the draft's bf16 cache (5 layers) is as large as the target's q4_0 one; the plan
    counts it at --draft-kv-type's bytes, and a plan that does not fit names the flag."""
    target, draft = config_only(tmp_path, "qwen3.5-27b")
    args = ["--target", str(target), "--draft", str(draft), "--gpu-memory", "24G", "--max-ctx", "131072",
            "--quantize", "int4", "--kv-type", "q4_0", "--quantize-draft", "int4"]
    rows, best = {}, {}
    for kind in ("auto", "q8_0", "q4_0"):
        code, plan = plan_json(capsys, *args, "--draft-kv-type", kind)
        assert plan["draft_kv_type"] == kind and code == (0 if plan["fits"] else 1)
        rows[kind] = next(r["bytes"] for r in plan["items"] if r["name"].startswith("draft KV"))
        best[kind] = plan["largest_max_ctx"]
    values = 131072 + 64 + 64  # the context, 64 rows of scratch for the budget's tree, the pool's sink page
    assert rows["auto"] == 2 * 2 * values * 5 * 8 * 128  # K and V, bf16, 5 layers of 8 KV heads of 128
    assert rows["q8_0"] * 32 == rows["auto"] // 2 * 34 and rows["q4_0"] * 32 == rows["auto"] // 2 * 18
    assert best["auto"] < best["q8_0"] < best["q4_0"]
    cfg = EngineConfig(max_ctx=131072, quantize="int4", kv_type="q4_0", quantize_draft="int4")
    _, lm, dcfg = read_configs(target, draft)
    plan = planner(lm, dcfg, torch.bfloat16, "cuda", "int4", 20 * GiB, None, "int4")(cfg)
    assert not plan.fits
    with pytest.raises(ConfigError, match="--draft-kv-type q8_0"):  # what the engine's refusal suggests
        check_plan(plan, cfg, None)
    cfg.draft_kv_type = "fp8"  # already smaller than q8_0: not suggested
    with pytest.raises(ConfigError) as refused:
        check_plan(plan, cfg, None)
    assert "--draft-kv-type" not in str(refused.value)


def test_a_preset_is_planned_as_the_directories_of_its_config_files(tmp_path, capsys):
    """`flashtree plan --preset` needs no checkpoint: its figures are those of a target and draft
    directory holding the preset's config.json files; --help and an unknown name list the presets."""
    target, draft = config_only(tmp_path, "qwen3.5-27b")
    flags = ["--gpu-memory", "24G", "--max-ctx", "65536", "--quantize", "int4", "--kv-type", "q4_0",
             "--quantize-draft", "int4"]
    code, preset = plan_json(capsys, "--preset", "qwen3.5-27b", *flags)
    files_code, files = plan_json(capsys, "--target", str(target), "--draft", str(draft), *flags)
    names = preset.pop("preset"), preset.pop("target"), files.pop("preset")
    assert names == ("qwen3.5-27b", "preset qwen3.5-27b", None)
    assert preset.pop("draft") and files.pop("draft") == str(draft) and files.pop("target") == str(target)
    assert (code, preset) == (files_code, files) and preset["largest_max_ctx"] > 65536
    code, ar = plan_json(capsys, "--preset", "qwen3.5-27b", "--mode", "ar", *flags)
    assert ar["draft"] is None and not [row for row in ar["items"] if row["name"].startswith("draft")]
    for args in (["--help"], ["--preset", "qwen9"]):
        with pytest.raises(SystemExit):
            main(["plan", *args])
        out = capsys.readouterr()
        assert all(name in " ".join((out.out + out.err).split()) for name in ("qwen3.5-27b", "qwen3-8b", "llama3.1-8b"))


def test_plan_without_a_memory_figure_is_a_one_line_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    r = run_cli("plan")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "flashtree: error: no CUDA device here to plan for: pass --gpu-memory (e.g. 24G) or --device cpu"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FLASHTREE_FAULTS"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "flashtree.cli", *args], capture_output=True, text=True,
                          timeout=180, env=env, cwd=REPO_ROOT)


@pytest.mark.slow  # CLI processes / long unconstrained-length answers: seconds each
def test_generate_and_serve_refuse_a_too_small_gpu_memory_in_one_line():
    """On the CPU --gpu-memory is what the plan is checked against; 300K rows of the CPU path's
    attention scores need far more than 256 MiB."""
    too_big = ["--gpu-memory", "256M", "--max-ctx", "300000", "--device", "cpu"]
    r = run_cli("generate", "--prompt", "hi", *too_big)
    lines = [line for line in r.stderr.strip().splitlines() if "error" in line]  # not the log's
    assert r.returncode == 2 and len(lines) == 1 and r.stderr.strip().endswith(lines[0]), r.stderr
    for words in ("does not fit", "--gpu-memory 0.25G", "--max-ctx", "--kv-type q4_0", "--quantize int4",
                  "--quantize-draft int4"):
        assert words in lines[0]
    best = int(lines[0].split("try --max-ctx ")[1].split()[0])
    assert run_cli("generate", "--prompt", "hi", "--max-tokens", "2", *too_big[:2], "--max-ctx", str(best),
                   "--device", "cpu").returncode == 0
    r = run_cli("serve", "--port", "0", *too_big)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert lines[0].removeprefix("flashtree: error: ") in r.stderr.splitlines()[-1]


def test_the_prefix_cache_gets_what_the_rest_leaves(tiny_pair, hybrid_pair):
    """The device tier counts what its snapshots copy: a hybrid's recurrent states (and their
    checkpoints) a slot, a dense target's nothing (its rows stay in the KV pages). A
    --gpu-memory that holds everything but half of a hybrid's: the tier shrinks to the remainder
    instead of refusing (40K rows of CPU attention scores pass --gpu-memory's 256M floor)."""
    opts = dict(max_ctx=40000, device="cpu", max_sequences=1)
    dense = Engine.from_pretrained(*map(str, tiny_pair), **opts).memory_plan
    assert dense.items[-1] == ("prefix cache, device tier", 0)
    target, draft = map(str, hybrid_pair)
    full = Engine.from_pretrained(target, draft, **opts)
    plan, cfg = full.memory_plan, full.config
    per_copy = plan.layout.state_bytes + full.target.config.hidden_size * 4  # float32 on the CPU
    assert 0 < plan.prefix_cache_wanted <= cfg.prefix_cache_slots * (1 + cfg.state_checkpoints) * per_copy
    room = plan.prefix_cache_wanted // 2
    eng = Engine.from_pretrained(target, draft, gpu_memory=plan.required + room, **opts)
    assert eng.memory_plan.fits and eng.cache.device_bytes == room


def test_gpu_memory_on_cuda_counts_the_context_and_caps_the_allocator(monkeypatch):
    """A 141 GiB device, 40 GiB of it used by other processes, and --gpu-memory 24G: the plan
    gets 24 GiB less the CUDA context's 0.5 GiB (other processes would not be on a 24 GiB card),
    and the allocator may hold 23.5 GiB of the 141, so the process as a whole stays within 24
    GiB as on a 24 GiB card. Without --gpu-memory nothing is capped."""
    from flashtree.runtime.memory_plan import GiB, available_memory, cap_process
    free, total = 101 * GiB, 141 * GiB
    caps = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: caps.append((f, device)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda = torch.device("cuda")
    assert available_memory(cuda, 24 * GiB) == int(23.5 * GiB) and available_memory(cuda, None) == free
    cap_process(cuda, None)
    cap_process(cuda, 200 * GiB)  # more than the device: nothing to cap
    assert caps == []
    cap_process(cuda, 24 * GiB)
    assert caps == [(pytest.approx(23.5 / 141), 0)]  # an index: torch refuses a bare "cuda" device


def test_memory_outside_the_allocator_comes_off_the_cap_and_the_device_tier(monkeypatch, caplog):
    """Graphs and kernel modules take device memory the allocator does not hold. The engine
    measures it after its warm-ups (free memory gone less what the allocator took) and, under
    --gpu-memory, lowers the allocator's cap and the prefix cache's device tier by it; more than
    the tier holds is said in a warning."""
    from flashtree.runtime.memory_plan import cuda_mark, fit_outside_allocator, outside_allocator
    total, now = 141 * GiB, {"free": 100 * GiB, "reserved": 0}
    caps = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (now["free"], total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: now["reserved"])
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: caps.append(f))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    cuda = torch.device("cuda")
    start = cuda_mark(cuda)
    now.update(free=now["free"] - 20 * GiB - 96 * 2 ** 20, reserved=20 * GiB)  # weights, then graphs' 96 MiB
    outside = outside_allocator(cuda, start)
    assert outside == 96 * 2 ** 20
    now.update(free=now["free"] + 2 * GiB, reserved=18 * GiB)  # the allocator gave 2 GiB back: not "outside"
    assert outside_allocator(cuda, start) == outside
    assert fit_outside_allocator(cuda, None, outside, GiB) == GiB and caps == []  # no --gpu-memory: no card
    assert fit_outside_allocator(cuda, 24 * GiB, outside, GiB) == GiB - outside
    assert caps == [pytest.approx((23.5 * GiB - outside) / total)]
    with caplog.at_level("WARNING", logger="flashtree.memory"):
        assert fit_outside_allocator(cuda, 24 * GiB, outside, 32 * 2 ** 20) == 0
    assert "needs 0.062 GiB more" in caplog.text  # 96 MiB outside against a tier of 32
    assert outside_allocator(torch.device("cpu"), (0, 0)) == 0


CAPPED = """
import torch
from flashtree import Engine
from flashtree.runtime.memory_plan import GiB
eng = Engine.from_pretrained(device="cuda", max_ctx=2048, gpu_memory=4 * GiB)
assert eng.memory_plan.fits and eng.memory_plan.available < 4 * GiB
assert torch.cuda.mem_get_info()[0] > 8 * GiB
try:
    torch.empty(5 * GiB, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError:
    print("capped")
"""


@pytest.mark.gpu
def test_gpu_memory_caps_a_real_cuda_process():
    """The engine under --gpu-memory 4G, in a process of its own (what this one holds would
    count against the cap): its plan fits within it, and an allocation past the cap is an
    out-of-memory error although the device has far more free."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", CAPPED], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("capped")


def test_loading_a_model_does_not_import_torch_dynamo():
    """Models are built on the meta device (the plan, then the load); an op there that runs one of
    torch's Python references (nn.Embedding's normal_, arange for the RoPE table) imports
    torch._dynamo, 2-3 s of every server worker's start and restart. A fresh interpreter loads the
    embedded pair and a 27B hybrid's int4 plan without it."""
    script = textwrap.dedent("""
        import sys, torch
        from flashtree import Engine
        from flashtree.bench.models import draft_config, target_config
        from flashtree.models.dflash import DraftConfig
        from flashtree.models.loader import target_config as parse
        from flashtree.runtime.memory_plan import weight_items
        Engine.from_pretrained(max_ctx=256)
        weight_items(parse(target_config("qwen3.5-27b")), DraftConfig.from_hf(draft_config("qwen3.5-27b")),
                     torch.bfloat16, "int4")
        print(sorted(m for m in sys.modules if m.startswith("torch._dynamo"))[:3])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_the_plan_sizes_live_sequences_and_chooses_as_many_as_fit(tmp_path, capsys):
    """--max-sequences N counts N sets of every per-sequence state; without it the plan takes the
    most (at most 8) that leave the prefix cache's device tier whole, and the largest --max-ctx it
    reports is for one sequence."""
    target, draft = config_only(tmp_path, "qwen3-8b")
    base = ["--target", str(target), "--draft", str(draft), "--max-ctx", "16384"]

    def pools(plan):
        return {row["name"].split(",")[0]: row["bytes"] for row in plan["items"] if " KV pool, " in row["name"]}

    _, one = plan_json(capsys, *base, "--gpu-memory", "80G", "--max-sequences", "1")
    _, three = plan_json(capsys, *base, "--gpu-memory", "80G", "--max-sequences", "3")
    assert one["max_sequences"] == 1 and three["max_sequences"] == 3
    # the pools hold every sequence's rows and one sink page: 16448 + 64 rows, then 3 x 16448 + 64
    assert {k: v // (16448 + 64) * (3 * 16448 + 64) for k, v in pools(one).items()} == pools(three)
    assert [row["name"] for row in three["items"] if " KV pool, " in row["name"]] == [
        "target KV pool, K auto, V auto (49344 rows, 3 sequences of 16448)", "draft KV pool, bfloat16 (49344 rows)"]
    code, auto = plan_json(capsys, *base, "--gpu-memory", "32G")
    n = auto["max_sequences"]
    assert code == 0 and 1 < n < 8, "32 GB hold a few 16K sequences of an 8B beside its weights"
    assert auto["items"][-1] == {"name": "prefix cache, device tier", "bytes": 0}  # a dense target's snapshots copy nothing
    code, more = plan_json(capsys, *base, "--gpu-memory", "32G", "--max-sequences", str(n + 1))
    assert code != 0 and not more["fits"], "the most that fit were chosen"
    _, small = plan_json(capsys, *base, "--gpu-memory", "24G")
    _, small_one = plan_json(capsys, *base, "--gpu-memory", "24G", "--max-sequences", "1")
    assert small["max_sequences"] >= 1 and small["largest_max_ctx"] == small_one["largest_max_ctx"]


def test_several_27b_sessions_share_a_smaller_kv_pool_on_a_24g_card(tmp_path):
    """Two sessions of up to 64K each fit a 24 GB card when their KV pages are a 70K-row pool
    (and fewer state checkpoints); four do not, and the refusal names the per-sequence flags."""
    target, draft = config_only(tmp_path, "qwen3.5-27b")
    _, lm, dcfg = read_configs(target, draft)
    plan_for = planner(lm, dcfg, torch.bfloat16, "cuda", "int4", int(23.5 * GiB), None, "int4")
    base = dict(max_ctx=65536, quantize="int4", kv_type="q4_0", quantize_draft="int4", draft_kv_type="q8_0")
    two = plan_for(EngineConfig(**base, max_sequences=2, kv_pool_tokens=70000, state_checkpoints=2))
    assert two.fits
    pool = next(name for name, _ in two.items if name.startswith("target KV pool"))
    assert pool == "target KV pool, K q4_0, V q4_0 (70016 rows, 2 sequences of 65600)"
    cfg = EngineConfig(**base, max_sequences=4, kv_pool_tokens=90000)
    four = plan_for(cfg)
    assert not four.fits
    with pytest.raises(ConfigError, match=r"fewer --max-sequences \(now 4: each has its own recurrent states.*"
                                          r"fewer --state-checkpoints \(now 8\)"):
        check_plan(four, cfg, None)
