"""The fused op on real ranks under faults (issue 43): W = 2 (and W = 4 for two of them)
processes on a gloo group, each calling `torch.ops.arfuse.fused_allreduce_rms_norm`,
which runs arfuse's kernels on the host device over a shared-memory workspace. Each
fault must end in an error on every surviving rank within its bound, never a hang and
never a wrong result, and (but for the killed rank) the workspace is reset on every
rank so that the next call is correct. See faults_worker.py.

- ok: four calls (one-shot and two-shot) equal the contract bit for bit on every rank;
- alloc: rank 1 may allocate 4,096 bytes; every rank's first call names rank 1;
- tokens: rank 1 calls with T = 15 where the others call with 16;
- skip: rank 1 skips call 1 (its next call is another site's);
- late: rank 1 comes 2 s late to call 1, past the 0.7 s polling timeout;
- kill: rank 1 dies while its peers are inside call 1.

The runtime's own test (crates/runtime/tests/real_ranks.rs) runs the same faults at
W = 2 and 4, and kills a rank inside the kernel."""

import json
import os
import socket
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")  # gloo_worker's reference imports it lazily only

import torch.multiprocessing as mp  # noqa: E402

import faults_worker  # noqa: E402

# A run that takes longer hangs somewhere: its processes are killed and the test fails.
BOUND_S = 90


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(scenario: str, world: int, tmp_path) -> list:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=faults_worker.worker, args=(r, world, port, str(tmp_path), scenario))
        for r in range(world)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=max(1.0, BOUND_S - (time.monotonic() - start)))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"{scenario} at W = {world}: ranks {hung} still running after {BOUND_S} s"
    out = []
    for r in range(world):
        path = tmp_path / f"rank_{r}.json"
        out.append(json.loads(path.read_text()) if path.exists() else [])
    print(scenario, world, f"{time.monotonic() - start:.1f} s", json.dumps(out, indent=1))
    return out


def test_calls_on_real_ranks_are_the_contract(tmp_path):
    out = run("ok", 2, tmp_path)
    for lines in out:
        assert lines == [f"call {tag} ok" for _, tag in faults_worker.CALLS]


def test_an_allocation_failure_on_one_rank_fails_every_rank(tmp_path):
    out = run("alloc", 2, tmp_path)
    for lines in out:
        assert "rank 1 failed in allocation" in lines[0], lines
        assert "this rank allows 4096" in lines[0], lines


@pytest.mark.parametrize("scenario,world", [("tokens", 2), ("tokens", 4), ("skip", 2), ("late", 2)])
def test_a_disagreeing_or_late_rank_fails_the_call_everywhere_then_a_call_is_correct(scenario, world, tmp_path):
    out = run(scenario, world, tmp_path)
    for lines in out:
        assert lines[0] == "call 0 ok", lines
        assert lines[1].startswith("call "), lines
        assert " error after " in lines[1] and "reset on every rank" in lines[1], lines
        if scenario != "late":
            assert "ranks disagree on the call" in lines[1], lines
        assert lines[2] == f"after reset: call {faults_worker.AFTER[1]} ok", lines
        assert not any("WRONG" in line for line in lines)


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_killed_mid_call_ends_in_errors_on_the_survivors(world, tmp_path):
    out = run("kill", world, tmp_path)
    assert out[1] == ["call 0 ok"], out[1]
    for r, lines in enumerate(out):
        if r == 1:
            continue
        assert lines[0] == "call 0 ok", lines
        assert lines[1].startswith("call 1 error after "), lines
        assert "timeout" in lines[1] or "aborted" in lines[1], lines
        assert "resetting the workspace failed" in lines[1], lines
