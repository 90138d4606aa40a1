"""A batch of hybrid trees through the Triton kernels, run by Triton's CPU interpreter: with the
DeltaNet layers one launch per kernel for all sequences (ForwardInput.scans_at_once, each
program finding its sequence's buffers through their addresses), every sequence's hidden states,
per-node delta-rule inputs and conv windows are the bits of the launches one sequence at a time,
for trees of one row count but different shapes (their tables padded to one length), built on
the host or in a captured step's static buffers."""

from __future__ import annotations

import textwrap

import pytest
from interpreted import run_interpreted
from tiny_models import make_target

pytest.importorskip("triton", reason="triton is not installed (it is a Linux x86-64 test dependency)")

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from flashtree.kernels.gated_delta import TreeIndex
    from flashtree.models import inputs
    from flashtree.models.inputs import ForwardInput
    from flashtree.models.loader import load_target, read_configs
    sys.path.insert(0, "tests")
    from test_batched_forward import ancestors

    from pathlib import Path
    path = Path(sys.argv[1])
    _, cfg, _ = read_configs(path, None)
    model = load_target(path, cfg, torch.float32, torch.device("cpu"), 256)
    conv = model.config.conv_kernel
    shapes = [[-1, 0, 0, 1, 3], [-1, 0, 1, 2, 3], [-1, 0, 0, 0, 0]]  # a tree, a chain, a bush

    def parts():
        g = torch.Generator().manual_seed(3)
        vocab = model.config.vocab_size
        pool, out = 3 * 256 + 64, []
        for n, parents, static in zip((6, 4, 7), shapes, (False, True, False)):
            cache = model.new_cache(256, torch.float32, "cpu", 8, pool=pool)
            pool = cache.kv.pool
            cache.kv.ensure(n + len(parents))
            model(ForwardInput.prefill(torch.randint(0, vocab, (n,), generator=g), cache))
            cache.keep_rows(0, None)
            tree = TreeIndex.build(parents, conv, "cpu")
            if static:  # a captured step's buffers: larger, the rows past the tree roots
                buffers = TreeIndex.static(len(parents), conv, "cpu")
                buffers.fill_(tree)
                tree = buffers
            depths = [0] * len(parents)
            for i, p in enumerate(parents):
                depths[i] = depths[p] + 1 if p >= 0 else 0
            out.append(ForwardInput(ids=torch.randint(0, vocab, (len(parents),), generator=g), cache=cache,
                                    lengths=torch.tensor([n], dtype=torch.int32),
                                    positions=n + torch.tensor(depths), block_mask=ancestors(parents), tree=tree))
        return out

    @torch.inference_mode()
    def run(at_once):
        inputs.AT_ONCE = at_once
        ps = parts()
        batch = ForwardInput.batch(ps)
        batched = batch.scans_at_once() is not None
        hidden, _ = model(batch)
        states = [{n: getattr(p.cache, n)[:5].clone() for n in ("node_k", "node_v", "node_g", "node_beta", "node_conv")}
                  for p in ps]
        return batched, hidden, states

    one, h1, s1 = run(True)
    each, h2, s2 = run(False)
    same = torch.equal(h1, h2) and all(torch.equal(a[n], b[n]) for a, b in zip(s1, s2) for n in a)
    print(json.dumps([one, each, bool(same), bool(torch.isfinite(h1).all())]))
""")


@pytest.mark.slow  # half a minute under the interpreter
def test_a_batch_of_hybrid_trees_scans_in_one_launch_with_the_bits_of_one_each(tmp_path):
    path = make_target(tmp_path / "hybrid", arch="qwen3_5", layers=4)
    found = run_interpreted(SCRIPT, str(path), threads=1)
    assert found == [True, False, True, True], "one launch for all, a launch each, the same bits, finite"


def layouts(kernel, consts: dict, types: dict) -> list[str]:
    """The register layouts of `kernel` compiled for sm_90 (its TTGIR's #blocked definitions)."""
    import re

    from test_attention_smem import compile_for
    ttgir = compile_for(kernel, 90, consts, types, 1).asm["ttgir"]
    return re.findall(r"^#blocked\w* = .*$", ttgir, re.M)


@pytest.mark.slow  # four compiles
def test_the_batched_delta_kernels_lay_out_their_values_as_a_launch_alone():
    """Compiled for sm_90 at the 27B's DeltaNet shapes, the BATCH mode (each sequence's buffers at
    addresses loaded from a table) has the layouts of a launch alone: Triton lays a load out by
    what it knows of the pointer's alignment, and the state's layout orders the sums over Dk, so
    an address loaded without its alignment declared summed otherwise on the GPU (not in the
    interpreter, which has no layouts)."""
    from flashtree.kernels import triton_delta_inputs as tdi
    from flashtree.kernels import triton_gated_delta as tgd
    types = {n: "*fp32" for n in ("Q", "K", "V", "G", "BETA", "ALOG", "DTB")}
    types |= {n: "*bf16" for n in ("P", "WIN", "W", "NEWWIN")} | {"ROWS": "*i64", "ADDRESSES": "*i64", "q_scale": "fp32"}
    inputs = [layouts(tdi._delta_inputs_kernel, dict(HK=16, HV=48, DK=128, DV=128, KW=4, BD=128, TREE=True,
                                                     BATCH=batch, PDL=False), types) for batch in (False, True)]
    assert inputs[0] and inputs[0] == inputs[1]
    types = {n: "*fp32" for n in ("Q", "K", "V", "G", "B", "S_IN", "S_OUT", "OUT")}
    types |= {"STEPS": "*i32", "BOUNDS": "*i32", "N_SEGMENTS": "*i32", "ADDRESSES": "*i64"}
    scans = [layouts(tgd._scan_kernel, dict(DK=128, DV=128, BK=128, BV=16, TREE=True, WRITE_OUT=True,
                                            WRITE_STATE=False, BATCH=batch, PDL=False), types) for batch in (False, True)]
    assert scans[0] and scans[0] == scans[1]
