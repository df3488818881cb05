"""One rank of test_real_rank_faults.py: calls `torch.ops.arfuse.fused_allreduce_rms_norm`
(arfuse's kernels on the host device, across a gloo group's processes) in a scenario
and writes what each call gave to OUT/rank_R.json.

Each call's inputs are made from seeds every rank knows, so every rank computes the
expected outputs itself (the contract: rank-order f32 sum, the residual add, the RMSNorm
in the kernels' order) without a collective that a fault could hang.
"""

import faulthandler
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

HIDDEN = 256
# (T, call tag) of every call, in order: one-shot and two-shot calls.
CALLS = ((3, 0), (16, 1), (1, 2), (24, 3))
# The call every rank makes after a failed one: correct again after the reset.
AFTER = (4, 9)


def inputs(rank: int, tokens: int, tag: int):
    g = torch.Generator().manual_seed(1000 * tag + rank)
    x = (torch.randn(tokens, HIDDEN, generator=g) * 3).to(torch.bfloat16)
    res = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    return x, res


def weight():
    return (1 + 0.25 * torch.randn(HIDDEN, generator=torch.Generator().manual_seed(5))).to(torch.bfloat16)


def expected(world: int, rank: int, tokens: int, tag: int):
    from gloo_worker import contract_rms_norm

    acc = torch.zeros(tokens, HIDDEN, dtype=torch.float32)
    for q in range(world):
        acc = acc + inputs(q, tokens, tag)[0].float()
    a = acc.to(torch.bfloat16)
    h = (a.float() + inputs(rank, tokens, tag)[1].float()).to(torch.bfloat16)
    return contract_rms_norm(h, weight(), 1e-5), h


def one_call(world: int, rank: int, group: str, tokens: int, tag: int) -> str:
    x, res = inputs(rank, tokens, tag)
    started = time.monotonic()
    try:
        norm, h, _, _ = torch.ops.arfuse.fused_allreduce_rms_norm(
            x, res, weight(), group, 1e-5, 0.0, True, False, "none", tag
        )
    except RuntimeError as e:
        return f"call {tag} error after {time.monotonic() - started:.1f} s: {e}"
    want_norm, want_h = expected(world, rank, tokens, tag)
    same = torch.equal(h.view(torch.int16), want_h.view(torch.int16)) and torch.equal(
        norm.view(torch.int16), want_norm.view(torch.int16)
    )
    return f"call {tag} ok" if same else f"call {tag} WRONG OUTPUT"


def worker(rank: int, world: int, port: int, out: str, scenario: str) -> None:
    if scenario == "alloc" and rank == 1:
        os.environ["ARFUSE_HOST_MAX_BYTES"] = "4096"
    os.environ["ARFUSE_HOST_TIMEOUT_MS"] = "700" if scenario == "late" else "3000"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=30),
    )
    import arfuse.torch  # noqa: F401  (registers the ops)

    group = dist.group.WORLD.group_name
    calls = list(CALLS)
    if scenario == "tokens" and rank == 1:
        calls[1] = (15, calls[1][1])
    if scenario == "skip" and rank == 1:
        del calls[1]
    lines = []

    def save() -> None:
        with open(os.path.join(out, f"rank_{rank}.json"), "w") as f:
            json.dump(lines, f)

    for i, (tokens, tag) in enumerate(calls):
        if scenario == "late" and rank == 1 and i == 1:
            time.sleep(2.0)
        if scenario == "kill" and rank == 1 and i == 1:
            # Dies (os._exit from faulthandler's own thread) while its peers are inside
            # call 1, waiting for its data.
            save()
            faulthandler.dump_traceback_later(0.5, exit=True)
            time.sleep(5)
        lines.append(one_call(world, rank, group, tokens, tag))
        save()
        if "error" in lines[-1]:
            if scenario != "kill":
                lines.append("after reset: " + one_call(world, rank, group, *AFTER))
                save()
            break
    if scenario != "kill":
        dist.destroy_process_group()
