"""A 24 GB card, on a bigger GPU: a Qwen3.5-27B-shaped Q4_K_M GGUF target, its DFlash draft and 64K of
context with a quantized KV cache, served by `flashtree serve --gpu-memory 24G` to an agent
conversation that grows to 60K tokens, through the real openai client.

The weights are random (a real 27B file is 16 GB no machine here can download), but everything
else is what a user runs:
- the target is a GGUF file in llama.cpp's Q4_K_M type mix (Q4_K; Q5_K for the DeltaNet's fused
  qkv; Q6_K for the output and for attn_v / ffn_down in the layers llama-quantize gives more
  bits), with tensor names and layouts from the `gguf` package's writer and name map, and the
  embedded model's tokenizer padded to the 248,320-row vocabulary;
- the draft is a 5-layer DFlash checkpoint of the target's width (bf16 safetensors), quantized at
  load by `--quantize-draft`;
- the server is started as a user would start it, and the memory plan decides whether it fits;
- the conversation is a coding agent's: a system prompt, then rounds of tool calls whose results
  are source files, each turn a new request that shares the previous one as its prefix.
While it runs, nvidia-smi's per-process memory is sampled: the proof that the process stayed on
the card it was told it has.

  python benchmarks/card_24g.py --work /tmp/card --out benchmarks/results/card_24g_h200.json
  python benchmarks/card_24g.py --work /tmp/card --restart --out benchmarks/results/card_24g_h200_restart.json

The first starts from a fresh Triton cache (what a first start after installing pays); `--restart`
keeps the files and the Triton cache the first left in --work (what a restart pays).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf_convert import ARCH, write_metadata, converter_tensors, random_blocks, write_tokenizer  # noqa: E402

from clients.server import FlashtreeServer  # noqa: E402
from flashtree.bench.models import PRESETS, draft_config_for  # noqa: E402
from flashtree.models.dflash import DFlashDraft, DraftConfig  # noqa: E402
from flashtree.models.loader import target_config  # noqa: E402
from flashtree.models.qwen35 import HybridCausalLM  # noqa: E402

TOKENIZER = ROOT / "flashtree" / "assets" / "target"


def more_bits(i: int, n: int) -> bool:
    """llama-quantize's use_more_bits: the first and last eighth of the layers, every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_type(name: str, shape: tuple[int, ...], index: dict[str, tuple[int, int]]) -> Q:
    """The type llama-quantize's Q4_K_M gives a tensor (the rules that touch this architecture)."""
    if len(shape) != 2 or "ssm_conv1d" in name or shape[1] % 256:
        return Q.F32
    if name == "output.weight":
        return Q.Q6_K
    if ".attn_qkv." in name:
        return Q.Q5_K
    for part in ("attn_v", "ffn_down"):
        if f".{part}." in name and more_bits(*index[name]):
            return Q.Q6_K
    return Q.Q4_K


def target_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape) of every tensor a converter writes for `cfg`: the model built on the
    meta device, its weights through the test converter's transforms and gguf's name map."""
    lm = target_config(cfg)
    with torch.device("meta"):
        state = HybridCausalLM(lm, 16).state_dict()
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight")
    names = gguf.get_tensor_name_map(ARCH[cfg["model_type"]], cfg["num_hidden_layers"])
    return [(names.get_name(k, try_suffixes=(".weight", ".bias")), tuple(t.shape))
            for k, t in converter_tensors(state, cfg).items()]


def random_values(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """float32 values of a dense tensor in the file's convention: stored norms near 1 (1 + w),
    ssm_a = -exp(A_log) negative, the rest small."""
    if name.endswith(".ssm_a"):
        return -rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if "norm" in name:
        return np.ones(shape, np.float32)
    return (rng.standard_normal(shape) * 0.02).astype(np.float32)


def write_target(cfg: dict, path: Path, seed: int = 0) -> dict[str, int]:
    """The random Q4_K_M GGUF file, written one tensor at a time; returns the bytes per type."""
    tensors = target_tensors(cfg)
    index: dict[str, tuple[int, int]] = {}
    for part in ("attn_v", "ffn_down"):
        mine = [n for n, _ in tensors if f".{part}." in n]
        index.update({n: (i, len(mine)) for i, n in enumerate(mine)})
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[ARCH[cfg["model_type"]]])
    write_metadata(w, cfg)
    write_tokenizer(w, TOKENIZER, cfg["vocab_size"], "qwen2")
    plan, sizes = [], {}
    for name, shape in tensors:
        qtype = q4_k_m_type(name, shape, index)
        if qtype == Q.F32:
            nbytes = 4 * int(np.prod(shape))
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:
            elems, block = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = shape[0] * shape[1] // elems * block
            w.add_tensor_info(name, (shape[0], shape[1] // elems * block), np.dtype(np.uint8), nbytes, qtype)
        plan.append((name, shape, qtype))
        sizes[qtype.name] = sizes.get(qtype.name, 0) + nbytes
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, qtype in plan:
        w.write_tensor_data(random_values(name, shape, rng) if qtype == Q.F32
                            else random_blocks(shape[0], shape[1], qtype, rng))
    w.close()
    return sizes


def write_draft(cfg: dict, out: Path, seed: int = 1) -> int:
    """A random bf16 DFlash draft checkpoint (config.json + model.safetensors); returns its bytes."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    with torch.device("meta"):
        names = DFlashDraft(DraftConfig.from_hf(cfg), 16).state_dict()
    gen = torch.Generator().manual_seed(seed)
    state = {k: (torch.ones(t.shape) if t.dim() == 1 else torch.randn(t.shape, generator=gen) * 0.02
                 ).to(torch.bfloat16) for k, t in names.items()}
    save_file(state, str(out / "model.safetensors"))
    return sum(t.numel() * 2 for t in state.values())


class MemorySampler(threading.Thread):
    """The memory in use on the device (nvidia-smi's memory.used, MiB: every process and its CUDA
    context; per-process figures are not visible inside every container), its maximum kept."""

    def __init__(self, every: float = 0.25):
        super().__init__(daemon=True)
        self.every, self.peak, self.samples, self.stopped = every, 0, 0, False

    def run(self) -> None:
        while not self.stopped:
            try:
                out = subprocess.run(["nvidia-smi", "--id=0", "--query-gpu=memory.used",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10)
                used = int(out.stdout.split()[0])
                self.peak, self.samples = max(self.peak, used), self.samples + 1
            except (OSError, subprocess.SubprocessError, ValueError, IndexError):
                return
            time.sleep(self.every)

    @property
    def peak_mib(self) -> Optional[int]:
        """The largest reading so far; None where nvidia-smi gave none (no GPU)."""
        return self.peak if self.samples else None


def source_files(limit_chars: int) -> list[tuple[str, str]]:
    """Standard-library files (path, text) in a fixed order: the results of the agent's reads."""
    lib = Path(json.__file__).resolve().parents[1]
    out, total = [], 0
    for f in sorted(lib.glob("*.py")):
        text = f.read_text(errors="replace")
        out.append((f.name, text))
        total += len(text)
        if total > limit_chars:
            break
    return out


OVERHEAD = 40  # template tokens around one call and its result


def conversation(tokenize, turns: list[int]) -> list[list[dict]]:
    """The messages of each turn: each holds the previous one, then one more round of `read_file`
    calls and their results, so that the rendered prompt reaches about `turns[i]` tokens. Every
    turn adds at least one call, even where the previous turn's last result overshot its target
    (the 128K run's last two turns came out the same without this)."""
    files = iter(source_files(40 * max(turns)))
    messages = [{"role": "system", "content": "You are a coding agent. Use read_file to look at the code."},
                {"role": "user", "content": "Read the modules one by one and summarise what each does."}]
    out, n, used = [], 0, 300  # the system turn with the tool's schema
    for target in turns:
        start = len(messages)
        while used < target or len(messages) == start:
            name, text = next(files)
            call = {"id": f"call_{n}", "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps({"path": name})}}
            tokens = tokenize(text)
            if used + tokens + OVERHEAD > target:  # the last result of the turn: cut to fit
                text = text[: len(text) * max(0, target - used - OVERHEAD) // tokens]
                tokens = tokenize(text)
            messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": f"call_{n}", "content": text}]
            used += tokens + OVERHEAD
            n += 1
        out.append([dict(m) for m in messages])
    return out


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                          "required": ["path"]}}}]


ENGINE_TIMES = {"prefill_s": "flashtree_prefill_seconds_total", "decode_s": "flashtree_decode_seconds_total",
                "decode_steps": "flashtree_decode_steps_total", "snapshot_s": "flashtree_snapshot_seconds_total",
                "alloc_retries": "flashtree_cuda_alloc_retries_total",
                "step_s": "flashtree_decode_step_seconds_total", "device_mallocs": "flashtree_cuda_mallocs_total",
                "device_frees": "flashtree_cuda_frees_total"}


def compiled(cache: Optional[Path]) -> dict[str, str]:
    """What a Triton cache directory holds, one folder a compiled kernel (or launcher module):
    folder -> the kernel's name (its metadata file's stem), or the folder's first file."""
    if cache is None or not cache.is_dir():
        return {}
    found = {}
    for folder in cache.iterdir():
        files = sorted(f.name for f in folder.iterdir()) if folder.is_dir() else [folder.name]
        meta = [f[:-5] for f in files if f.endswith(".json") and not f.startswith("__grp__")]
        found[folder.name] = (meta or files or ["?"])[0]
    return found


def run_turns(srv: FlashtreeServer, turns: list[list[dict]], max_tokens: int, rows: list[dict[str, Any]],
              save: Callable[[], None], triton_cache: Optional[Path] = None) -> None:
    """Each turn through the openai client, its usage and time appended to `rows`, then saved; with
    the engine's own prefill and decode seconds and decode steps in the turn (/metrics before and
    after), so that a slow turn says which part was slow."""
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=1800)
    for messages in turns:
        before = srv.metrics(ENGINE_TIMES.values())
        kernels = compiled(triton_cache)
        t0 = time.perf_counter()
        r = client.chat.completions.create(model="x", messages=messages, tools=TOOLS, max_tokens=max_tokens,
                                           temperature=0)
        details = r.usage.prompt_tokens_details
        rows.append({"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                     "cached_tokens": details.cached_tokens if details else None,
                     "finish_reason": r.choices[0].finish_reason, "seconds": round(time.perf_counter() - t0, 2)})
        after = srv.metrics(ENGINE_TIMES.values())
        rows[-1].update({k: round(after[name] - before[name], 3) for k, name in ENGINE_TIMES.items()})
        new = [name for folder, name in compiled(triton_cache).items() if folder not in kernels]
        rows[-1]["kernels_compiled"], rows[-1]["kernels_compiled_names"] = len(new), sorted(new)
        if rows[-1]["decode_steps"]:
            rows[-1]["ms_per_decode_step"] = round(1000 * rows[-1]["decode_s"] / rows[-1]["decode_steps"], 1)
            rows[-1]["ms_inside_each_step"] = round(1000 * rows[-1]["step_s"] / rows[-1]["decode_steps"], 1)
        print("turn", rows[-1], flush=True)
        save()


def plan(args: argparse.Namespace, target: Path, draft: Path) -> dict:
    cmd = [sys.executable, "-m", "flashtree.cli", "plan", "--target", str(target), "--draft", str(draft),
           "--max-ctx", str(args.max_ctx), *args.flags, "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    return {"exit": done.returncode, **(json.loads(done.stdout) if done.stdout.strip() else {"stderr": done.stderr})}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3.5-27b", choices=[p for p in PRESETS if "3.5" in p])
    ap.add_argument("--shape", help="a JSON object of config overrides (a small shape for a CPU check)")
    ap.add_argument("--work", default="/tmp/card_24g", help="where the files are written")
    ap.add_argument("--turns", default="52000,57000,62000", help="prompt tokens of each turn, about")
    ap.add_argument("--plan-only", action="store_true", help="write the files and print the plan, serve nothing")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-ctx", type=int, default=65536)
    ap.add_argument("--flags", nargs=argparse.REMAINDER,
                    default=["--quantize", "int4", "--kv-type", "q4_0", "--quantize-draft", "int4", "--gpu-memory", "24G"],
                    help="the other engine flags, for the plan and the server (last on the line)")
    ap.add_argument("--restart", action="store_true",
                    help="keep the files and the Triton cache an earlier run left in --work: what a "
                         "server's restart on the same machine pays")
    ap.add_argument("--out", default="benchmarks/results/card_24g_h200.json")
    args = ap.parse_args(argv)
    cfg = dict(PRESETS[args.preset], **json.loads(args.shape or "{}"))
    interval = cfg["full_attention_interval"]
    cfg["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                          for i in range(cfg["num_hidden_layers"])]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    target, draft = work / "target-Q4_K_M.gguf", work / "draft"
    result: dict[str, Any] = {"preset": args.preset, "shape": cfg, "max_ctx": args.max_ctx, "flags": args.flags}
    t0 = time.perf_counter()
    result["restart"] = args.restart and target.exists() and (draft / "config.json").exists()
    if not result["restart"]:
        result["target_bytes_by_type"] = write_target(cfg, target)
        result["draft_bytes"] = write_draft(draft_config_for(cfg), draft)
        result["file_seconds"] = round(time.perf_counter() - t0, 1)
    result["target_file_bytes"] = target.stat().st_size
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each phase: a run that is cut off keeps what it did
        out.write_text(json.dumps(result, indent=1))

    result["plan"] = plan(args, target, draft)
    save()
    print("plan:", {k: result["plan"].get(k) for k in ("exit", "fits", "total", "available", "largest_max_ctx")}, flush=True)
    if args.plan_only:
        print(json.dumps(result["plan"], indent=1))
        return result["plan"]["exit"]
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    turns = conversation(lambda s: len(tok.encode(s).ids), [int(x) for x in args.turns.split(",")])
    sampler = MemorySampler()
    sampler.start()
    time.sleep(1)
    result["device_memory_before_MiB"] = sampler.peak_mib
    t0 = time.perf_counter()
    triton_cache = work / "triton-cache"  # its new files count the kernels compiled in each turn
    if not result["restart"]:  # a first start compiles every kernel
        shutil.rmtree(triton_cache, ignore_errors=True)
    with FlashtreeServer(out.with_suffix(".log"), "--target", str(target), "--draft", str(draft),
                         "--offline", *args.flags, max_ctx=args.max_ctx,
                         env={"TRITON_CACHE_DIR": str(triton_cache)}) as srv:
        result["ready_seconds"] = round(time.perf_counter() - t0, 1)
        result["device_memory_at_ready_MiB"] = sampler.peak_mib
        save()
        result["turns"] = []
        run_turns(srv, turns, args.max_tokens, result["turns"], save, triton_cache)
        result["server_counters"] = srv.counters()
        result["server_alive"] = srv.alive
    sampler.stopped = True
    result["device_memory_peak_MiB"] = sampler.peak_mib
    result["memory_samples"] = sampler.samples
    save()
    print(json.dumps({k: result[k] for k in ("turns", "device_memory_peak_MiB", "ready_seconds")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
