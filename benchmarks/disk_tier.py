"""What the disk tier's integrity checks cost on one snapshot, in milliseconds.

A snapshot of about 100 MB (bf16 rows shaped like the embedded pair's KV, four tensors) is
written and read through DiskTier, and with plain safetensors as the tier did before it had
checksums; the differences are the checksum on write (sha256 in 16 MiB pieces on a thread pool),
and the checksum plus the finite check on read. Each check is also timed alone, with
single-thread sha256, blake2b and crc32 over the same bytes for reference. Both reads are
followed by one copy of every tensor, as a restore makes (a CPU read is a lazy mmap until then).
The file is read back right after it was written, from the page cache: these are the checks'
costs, not the disk's.

    python benchmarks/disk_tier.py [--mb 100] [--device cpu|cuda] [--dir /tmp] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flashtree.runtime.disk_tier import DiskTier, all_finite, checksum
from flashtree.bench.provenance import provenance


def median_ms(fn: Callable[[], object], reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100.0, help="snapshot size in MB (10^6 bytes)")
    ap.add_argument("--device", default="cpu", help="where reads put the tensors (the finite check runs there)")
    ap.add_argument("--dir", default=None, help="directory for the files (default: a temporary one)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    layers, heads, dim = 8, 4, 64  # per row and tensor: 8 * 4 * 64 bf16 = 4 KiB
    rows = int(args.mb * 1e6 / (4 * layers * heads * dim * 2))
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(layers, rows, heads, dim, generator=g).to(torch.bfloat16)
               for name in ("tk", "tv", "dk", "dv")}
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    tokens = tuple(range(rows))
    device = torch.device(args.device)
    raw = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        tier, plain = DiskTier(Path(tmp) / "tier", "bench"), Path(tmp) / "plain.safetensors"

        def read_plain() -> list[torch.Tensor]:
            with safe_open(str(plain), framework="pt", device=str(device)) as f:
                return [f.get_tensor(k).clone() for k in f.keys()]

        def read_tier() -> list[torch.Tensor]:
            return [t.clone() for t in tier.read(path, tokens, device).values()]

        on_device = [t.to(device) for t in tensors.values()]

        path = tier.write(tokens, tensors, time.time()).path
        save_file(tensors, str(plain))
        ms = {
            "write_plain_safetensors": median_ms(lambda: save_file(tensors, str(plain))),
            "write_disk_tier": median_ms(lambda: tier.write(tokens, tensors, time.time())),
            "read_plain_safetensors": median_ms(read_plain),
            "read_disk_tier": median_ms(read_tier),
            "checksum_alone": median_ms(lambda: checksum({"tokens": "[]"}, tensors)),
            "finite_check_alone": median_ms(lambda: [all_finite(t) for t in on_device]),
            "reference_sha256_1_thread": median_ms(lambda: hashlib.sha256(raw).digest()),
            "reference_blake2b_1_thread": median_ms(lambda: hashlib.blake2b(raw).digest()),
            "reference_crc32_1_thread": median_ms(lambda: zlib.crc32(raw)),
        }
    result = {
        "benchmark": "disk_tier", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **provenance(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "device": str(device)},
        "snapshot_bytes": nbytes, "ms": ms,
        "checksum_GBps": round(nbytes / ms["checksum_alone"] / 1e6, 2),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"disk_tier_{device.type}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
