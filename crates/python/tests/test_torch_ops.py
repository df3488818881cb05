"""arfuse.torch in one process: the custom ops' kernels and the pass's uuid."""

import json
import os
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import arfuse  # noqa: E402
import arfuse.torch as at  # noqa: E402

OP = torch.ops.arfuse.fused_allreduce_rms_norm.default


@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo process group of one rank (this process)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def bits16(t):
    return t.contiguous().view(torch.int16)


def test_uuid_is_stable_and_changes_with_target_options_and_version(monkeypatch):
    x8 = arfuse.Target.preset("h200-sxm-x8")
    a = at.FusionPass(x8).uuid()
    assert a == at.FusionPass(arfuse.Target.from_toml(x8.to_toml())).uuid()
    assert len(a) == 64 and int(a, 16) >= 0
    assert at.FusionPass(arfuse.Target.preset("h200-sxm-x4")).uuid() != a
    assert at.FusionPass(x8, all_reduce_ops=["vllm.all_reduce"]).uuid() != a
    assert at.FusionPass(x8, group="tp").uuid() != a
    monkeypatch.setattr(arfuse._arfuse, "__version__", "0.0.0-other")
    assert at.FusionPass(x8).uuid() != a
    with pytest.raises(TypeError):
        at.FusionPass("h200-sxm-x8")
    with pytest.raises(ValueError):
        at.FusionPass(x8, on_error="ignore")


def test_fake_kernel_gives_the_output_types():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 5, 256, dtype=torch.bfloat16)
        w = torch.empty(256, dtype=torch.bfloat16)
        norm, res, q, s = OP(x, x, w, "0", 1e-6, 0.0, False, False, "fp8_per_token")
        assert norm.shape == res.shape == q.shape == (3, 5, 256)
        assert (norm.dtype, q.dtype, s.dtype) == (torch.bfloat16, torch.float8_e4m3fn, torch.float32)
        assert s.shape == (3, 5, 1)
        _, _, q, s = OP(x, None, w, "0", 1e-6, 0.0, False, False, "none")
        assert q.shape == s.shape == (0,)
        q, s = torch.ops.arfuse.quant_fp8_per_token(x)
        assert q.shape == x.shape and s.shape == (3, 5, 1)
        # Every epilogue's layouts (T = 15 tokens, H = 256: 2 groups, 16 NVFP4 blocks).
        one = torch.empty(1)
        want = {
            "fp8_static": ((3, 5, 256), torch.float8_e4m3fn, (0,), torch.float32, None),
            "fp8_per_token_group:f32_row_major": ((3, 5, 256), torch.float8_e4m3fn, (3, 5, 2), torch.float32, None),
            "fp8_per_token_group:f32_row_major_ue8m0": ((3, 5, 256), torch.float8_e4m3fn, (3, 5, 2), torch.float32, None),
            "fp8_per_token_group:packed_ue8m0": ((3, 5, 256), torch.float8_e4m3fn, (15, 1), torch.int32, (1, 16)),
            "nvfp4:linear": ((3, 5, 128), torch.uint8, (3, 5, 16), torch.float8_e4m3fn, None),
            "nvfp4:swizzled_128x4": ((3, 5, 128), torch.uint8, (128, 16), torch.float8_e4m3fn, None),
        }
        assert set(want) | {"none", "fp8_per_token"} == set(at.OP_QUANTS)
        for quant, (qs, qd, ss, sd, st) in want.items():
            scale_in = one if quant in arfuse._arfuse.SCALE_INPUT_QUANTS else None
            _, _, q, s = OP(x, x, w, "0", 1e-6, 0.0, False, False, quant, 0, scale_in)
            assert (q.shape, q.dtype, s.shape, s.dtype) == (qs, qd, ss, sd), quant
            assert st is None or s.stride() == st, quant


def test_cuda_entry_refuses_tensors_that_are_not_on_cuda():
    # The CUDA entry runs arfuse's kernels through the runtime's CUDA device (no GPU
    # here: what is checked is that it refuses, by name, what it cannot run).
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    with pytest.raises(ValueError, match="input is on cpu; this kernel runs on cuda"):
        OP.redispatch(keys, x, None, x[0], "0", 1e-6, 0.0, False, False, "none", 0)


def test_per_token_quant_equals_the_engines_formula():
    # vLLM's reference (`ref_dynamic_per_token_quant`): s = max(amax / 448, 1 / (448 *
    # 512)) in f32, q = e4m3(clamp(y / s, -448, 448)); torch's e4m3 cast rounds to
    # nearest even like the contract's encoder.
    g = torch.Generator().manual_seed(0)
    y = (torch.randn(37, 256, generator=g) * torch.logspace(-6, 3, 37).unsqueeze(1)).to(torch.bfloat16)
    y[3] = 0
    q, s = torch.ops.arfuse.quant_fp8_per_token(y)
    yf = y.float()
    amax = yf.abs().amax(-1, keepdim=True)
    want_s = torch.maximum(amax / 448.0, torch.tensor(1.0 / (448.0 * 512.0)))
    want_q = (yf / want_s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert float(s[3]) == pytest.approx(1.0 / (448 * 512)) and not q[3].view(torch.uint8).any()


def test_fused_op_on_one_rank_is_the_contract(one_rank_group):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 9, 256, generator=g) * 4).to(torch.bfloat16)
    r = torch.randn(2, 9, 256, generator=g).to(torch.bfloat16)
    w = (1 + 0.25 * torch.randn(256, generator=g)).to(torch.bfloat16)
    norm, res, q, s = OP(x, r, w, one_rank_group, 1e-5, 0.0, True, False, "fp8_per_token")
    # Clauses 1-2 on one rank: h = round(x + r).
    h = (x.float() + r.float()).to(torch.bfloat16)
    assert torch.equal(bits16(res), bits16(h))
    # Clause 3 (twice): a sequential f32 sum of squares and 1 / sqrt.
    hf = h.float()
    ss = torch.zeros(2, 9, 1)
    for i in range(256):
        ss = ss + hf[..., i : i + 1] * hf[..., i : i + 1]
    rr = torch.ones_like(ss) / torch.sqrt(ss / 256 + 1e-5)
    want = ((hf * rr).to(torch.bfloat16).float() * w.float()).to(torch.bfloat16)
    assert torch.equal(bits16(norm), bits16(want))
    q2, s2 = torch.ops.arfuse.quant_fp8_per_token(norm)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    # `once` with an f32 weight and weight_bias 1 (Gemma): one rounding of (h r)(1 + w).
    w32 = torch.randn(256, generator=g) * 0.1
    norm1, _, _, _ = OP(x, None, w32, one_rank_group, 1e-6, 1.0, False, False, "none")
    xf = x.float()
    ss = torch.zeros(2, 9, 1)
    for i in range(256):
        ss = ss + xf[..., i : i + 1] * xf[..., i : i + 1]
    rr = torch.ones_like(ss) / torch.sqrt(ss / 256 + 1e-6)
    want1 = ((xf * rr) * (w32 + 1.0)).to(torch.bfloat16)
    assert torch.equal(bits16(norm1), bits16(want1))


def test_fused_op_refuses_bad_inputs(one_rank_group):
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    w = torch.ones(256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="weight has 128 elements"):
        OP(x, None, w[:128], one_rank_group, 1e-6, 0.0, False, False, "none")
    with pytest.raises(ValueError, match="residual"):
        OP(x, torch.zeros(4, 256), w, one_rank_group, 1e-6, 0.0, False, False, "none")
    with pytest.raises(ValueError, match="float64"):
        OP(x.double(), None, w, one_rank_group, 1e-6, 0.0, False, False, "none")
    with pytest.raises(ValueError, match="'nvfp4' is not one of"):
        OP(x, None, w, one_rank_group, 1e-6, 0.0, False, False, "nvfp4")
    with pytest.raises(ValueError, match="needs scale_in"):
        OP(x, None, w, one_rank_group, 1e-6, 0.0, False, False, "fp8_static")
    with pytest.raises(ValueError, match="takes no scale_in"):
        OP(x, None, w, one_rank_group, 1e-6, 0.0, False, False, "none", 0, torch.ones(1))
    with pytest.raises(ValueError, match="one float32 element"):
        OP(x, None, w, one_rank_group, 1e-6, 0.0, False, False, "fp8_static", 0, torch.ones(2))
    with pytest.raises(ValueError, match="multiple of 128"):
        OP(x[:, :200].contiguous(), None, w[:200], one_rank_group, 1e-6, 0.0, False, False, "fp8_per_token_group:f32_row_major")
    with pytest.raises(ValueError, match="eps"):
        OP(x, None, w, one_rank_group, 0.0, 0.0, False, False, "none")


def test_fx_json_leaves_unread_metadata_out_and_the_graph_unchanged():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(256, eps=1e-6, dtype=torch.bfloat16)

        def forward(self, x):
            y = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", "tp"))
            return self.norm(y)

    gm = torch.export.export(Block(), (torch.zeros(4, 256, dtype=torch.bfloat16),)).graph_module
    before = {n.name: dict(n.meta) for n in gm.graph.nodes}
    assert any("stack_trace" in m for m in before.values())
    from arfuse import fx_json

    data = fx_json.serialize(gm, {}, "post")
    assert b"stack_trace" not in data and b"nn_module_stack" in data
    assert {n.name: dict(n.meta) for n in gm.graph.nodes} == before
    low = arfuse.lower(data, arfuse.Target.preset("h200-sxm-x2"))
    assert low.report["all_reduces_fused"] == 1
    # The all-reduce has no module (the root's forward): the site is named by its node.
    assert low.report["sites"][0]["name"] == "all_reduce -> norm"


def test_pass_fuses_a_static_fp8_quant():
    # In a process of its own: it defines vLLM's `_C.static_scaled_fp8_quant` (a stand-in
    # with vLLM's schema; see static_fp8_worker.py), which an imported vLLM would own.
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run(
        [sys.executable, os.path.join(here, "static_fp8_worker.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["patterns"] == {"allreduce+residual+rms_norm(round_twice)+fp8_static": 1}, seen
    assert seen["h_equal"] and seen["q_equal"] and seen["q_is_contract"], seen
    assert seen["scale_out"] == [0] and seen["saturated"] > 0, seen
