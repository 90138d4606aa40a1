"""What the host tier's integrity check costs on one snapshot, in milliseconds.

A snapshot of about 100 MB (bf16 rows shaped like the embedded pair's KV, four tensors) goes
to host memory as the prefix cache moves it there (prefix_cache._host_copy, pinned on CUDA) and
back to the device as a restore copies it; the check adds one CRC-32 of the host bytes
(disk_tier.fast_checksum, 16 MiB pieces on a thread pool) to each of the two moves. A restore
computes it while its copies run (async from pinned memory on CUDA; on the CPU they are not), so
"restore_checked" is the restore as the cache does it. sha256 (what disk files carry) over the
same bytes is timed for comparison.

    python benchmarks/host_checksum.py [--mb 100] [--device cpu|cuda] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from disk_tier import median_ms
from flashtree.runtime.disk_tier import checksum, fast_checksum
from flashtree.runtime.prefix_cache import _host_copy
from flashtree.bench.provenance import provenance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="snapshot size in MB (10^6 bytes)")
    ap.add_argument("--device", default="cpu", help="where the snapshot comes from and goes back to")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    device = torch.device(args.device)
    layers, heads, dim = 8, 4, 64
    rows = int(args.mb * 1e6 / (4 * layers * heads * dim * 2))
    g = torch.Generator().manual_seed(0)
    on_device = {name: torch.randn(layers, rows, heads, dim, generator=g).to(torch.bfloat16).to(device)
                 for name in ("tk", "tv", "dk", "dv")}
    nbytes = sum(t.numel() * t.element_size() for t in on_device.values())
    pin = device.type == "cuda"
    host = {k: _host_copy(v, pin) for k, v in on_device.items()}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def to_host() -> None:
        {k: _host_copy(v, pin) for k, v in on_device.items()}
        sync()

    def to_device(check: bool = False) -> None:
        for k, v in host.items():
            on_device[k].copy_(v, non_blocking=pin)
        if check:
            fast_checksum(host)
        sync()

    ms = {
        "copy_to_host": median_ms(to_host),
        "copy_to_device": median_ms(to_device),
        "restore_checked": median_ms(lambda: to_device(check=True)),
        "crc32_check": median_ms(lambda: fast_checksum(host)),
        "reference_sha256_pieces": median_ms(lambda: checksum({}, host)),
    }
    result = {
        "benchmark": "host_checksum", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **provenance(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "device": str(device)},
        "snapshot_bytes": nbytes, "ms": ms,
        "crc32_GBps": round(nbytes / ms["crc32_check"] / 1e6, 2),
        "save_overhead": round(ms["crc32_check"] / ms["copy_to_host"], 2),
        "restore_overhead": round(ms["restore_checked"] / ms["copy_to_device"] - 1, 2),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"host_checksum_{device.type}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
