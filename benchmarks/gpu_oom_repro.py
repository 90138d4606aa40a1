"""Reproduce a real CUDA out-of-memory inside the engine and show the recovery.

    python benchmarks/gpu_oom_repro.py   (on a CUDA machine; embedded model by default)

The process is capped with torch.cuda.set_per_process_memory_fraction just above what the
engine holds once two conversations are cached (one live, one as a device snapshot), so a long
prompt's big prefill chunk fails for real. Recorded: the error or recovery, the cache_cleared
event, and whether the next request's greedy output equals the uncapped reference. Writes
benchmarks/results/gpu_oom_repro.json.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import torch

from flashtree import Engine
from flashtree.errors import EngineOutOfMemory


def main() -> int:
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    rng = random.Random(0)
    eng = Engine.from_pretrained(max_ctx=40000, prefill_ubatch=16384, prefix_cache_slots=4,
                                 host_cache_bytes=0, device="cuda")
    events: list = []
    eng.listeners.append(lambda kind, data: events.append({"kind": kind, **data}))
    vocab = eng.target.config.vocab_size
    conv_a = [rng.randrange(16, vocab) for _ in range(12000)]
    conv_b = [rng.randrange(16, vocab) for _ in range(6000)]
    long_c = [rng.randrange(16, vocab) for _ in range(32768)]
    reference = eng.generate(conv_a, max_tokens=32, stop_token_ids=[]).token_ids  # uncapped
    eng.generate(conv_b, max_tokens=8, stop_token_ids=[])     # conv_a -> device snapshot
    eng.generate(conv_a, max_tokens=8, stop_token_ids=[])     # restored; conv_b -> snapshot
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated()
    total = torch.cuda.get_device_properties(0).total_memory
    snapshot_bytes = eng.cache.stats()["device"]["bytes"]
    cap = held + 64 * 2**20  # 64 MiB of headroom: less than a 16K-token chunk needs
    torch.cuda.set_per_process_memory_fraction(cap / total)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "held_bytes_before_cap": held, "device_snapshot_bytes": snapshot_bytes, "cap_bytes": cap,
              "long_prompt_tokens": len(long_c), "prefill_ubatch": 16384}
    t0 = time.perf_counter()
    try:
        res = eng.generate(long_c, max_tokens=8, stop_token_ids=[])
        record["long_request"] = {"outcome": "succeeded after recovery", "cached_tokens": res.stats.cached_tokens}
    except EngineOutOfMemory as e:
        record["long_request"] = {"outcome": "out_of_memory error", "message": str(e)}
    record["long_request"]["seconds"] = round(time.perf_counter() - t0, 3)
    record["events"] = events
    record["cache_after"] = eng.cache_stats()
    torch.cuda.set_per_process_memory_fraction(1.0)
    again = eng.generate(conv_a, max_tokens=32, stop_token_ids=[])
    record["next_request"] = {"equals_reference": again.token_ids == reference,
                              "cached_tokens": again.stats.cached_tokens, "prompt_tokens": len(conv_a)}
    out = Path(__file__).parent / "results" / "gpu_oom_repro.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    return 0 if record["next_request"]["equals_reference"] and events else 1


if __name__ == "__main__":
    sys.exit(main())
