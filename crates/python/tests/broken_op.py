"""A deliberately wrong fused op, for test_vllm.py: the test's assertions must fail on
it. Importing this module (vLLM's workers do, when they unpickle `BrokenPass`) makes the
CPU path of `torch.ops.arfuse.fused_allreduce_rms_norm` (arfuse's kernels on the host
device across the group, and the contract's computation for other group sizes)
normalise with its RMSNorm epsilon multiplied by `FACTOR`: every norm output of every fused site moves a little (the
mean square of this model's activations is about 1, so an eps of 1e-5 * FACTOR = 0.01
moves the normalised values by about half a percent), the residual output not at all."""

import arfuse.torch as _at
import arfuse.vllm

FACTOR = 1000.0

_original = _at._arfuse._fused_allreduce_rms_norm_cpu


def _broken(dtype, ranks, world, numel, hidden, residual, weight, weight_dtype, eps, *rest):
    return _original(dtype, ranks, world, numel, hidden, residual, weight, weight_dtype, eps * FACTOR, *rest)


_at._arfuse._fused_allreduce_rms_norm_cpu = _broken

_original_ranks = _at._host_ranks


class _BrokenRanks:
    """A host-device workspace whose calls get the epsilon times `FACTOR`."""

    def __init__(self, ws):
        self.ws = ws

    def run(self, x, residual, weight, weight_dtype, numel, eps, *rest):
        return self.ws.run(x, residual, weight, weight_dtype, numel, eps * FACTOR, *rest)


def _broken_ranks(*args):
    return _BrokenRanks(_original_ranks(*args))


_at._host_ranks = _broken_ranks


class BrokenPass(arfuse.vllm.FusionPass):
    """arfuse.vllm's pass, whose class lives here, so that the workers import this module."""


def compilation_config(**kw):
    cc = arfuse.vllm.compilation_config(**kw)
    old = cc["inductor_compile_config"]["post_grad_custom_post_pass"]
    cc["inductor_compile_config"]["post_grad_custom_post_pass"] = BrokenPass(
        on_error=old.on_error, report_dir=old.report_dir
    )
    return cc
