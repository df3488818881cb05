"""The pass's FX front end (the Rust walk of crates/python/src/walk.rs) on graphs with what real engines put in them,
and the guarantee of `on_error="skip"`: whatever fails, the graph is left as it was and
nothing reaches the compiler."""

import json
import operator
import warnings

import pytest

torch = pytest.importorskip("torch")

import arfuse  # noqa: E402
import arfuse.torch as at  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))

    def forward(self, x, res):
        y = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", "tp"))
        h = y + res
        hf = h.to(torch.float32)
        n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * n.to(torch.bfloat16), h


class ScriptObjectStandIn:
    """What a FakeScriptObject is to the walk: a graph input that is no tensor."""


def script_op(handle, x):
    """An op arfuse does not know: a script object and a tensor in, a tuple out."""
    return None, x


def side_effect(x):
    """An op with no output."""
    return None


def engine_graph():
    """The Block's graph with an engine's extras around the chain: a script-object input,
    an unknown op returning (None, tensor) read through getitem, an op with no output,
    and a symbolic size read by an op (torch.export's graph has a symbolic token dim)."""
    t = torch.export.Dim("t", min=2, max=64)
    ep = torch.export.export(
        Block(),
        (torch.zeros(4, 256, dtype=torch.bfloat16), torch.zeros(4, 256, dtype=torch.bfloat16)),
        dynamic_shapes=({0: t}, {0: t}),
    )
    gm = ep.graph_module
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    x = placeholders[1]  # after the weight parameter
    with g.inserting_after(placeholders[-1]):
        obj = g.placeholder("handle")
    obj.meta["val"] = ScriptObjectStandIn()
    with g.inserting_after(obj):
        call = g.call_function(script_op, (obj, x))
        call.meta["val"] = (None, x.meta["val"])
    with g.inserting_after(call):
        item = g.call_function(operator.getitem, (call, 1))
        item.meta["val"] = x.meta["val"]
    with g.inserting_after(item):
        nothing = g.call_function(side_effect, (item,))
        nothing.meta["val"] = None
    out = g.output_node()
    out.args = (tuple(out.args[0]) + (item,),)
    return gm


def test_engine_extras_are_opaque_and_the_chain_still_fuses():
    gm = engine_graph()
    walked = json.loads(at._arfuse._fx_graph_json(gm.graph))
    nodes = {n["name"]: n for n in walked["nodes"]}
    call = nodes["script_op"]
    assert call["target"] == "test_fx_front_end.script_op"
    # The script object is no tensor input (a Python function has no schema: its
    # arguments are arg0, arg1, ...); the tuple's tensor is named by its getitem,
    # which is not a node of its own.
    assert call["args"][0] == ["arg0", {"kind": "other", "value": "ScriptObjectStandIn"}]
    assert call["args"][1] == ["arg1", {"kind": "tensor", "value": "x"}]
    assert [o["name"] for o in call["outputs"]] == ["getitem"] and call["other_outputs"] == 1
    assert "getitem" not in nodes and nodes["side_effect"]["outputs"] == []
    assert nodes["side_effect"]["args"] == [["arg0", {"kind": "tensor", "value": "getitem"}]]
    assert [i["name"] for i in walked["inputs"]] == ["p_weight", "x", "res"]
    # The token dim is symbolic, with the range the export gave it.
    t, h = walked["inputs"][1]["sizes"]
    assert h == 256 and {"name": t, "min": 2, "max": 64} in walked["symbols"]
    p = at.FusionPass(arfuse.Target.preset("h200-sxm-x2"), group="tp", on_error="raise")
    p(gm.graph)
    gm.graph.lint()
    code = gm.graph.python_code("self").src
    assert code.count("torch.ops.arfuse.fused_allreduce_rms_norm.default(") == 1
    assert "all_reduce" not in code.replace("fused_allreduce", "")
    assert p.reports[0]["all_reduces_fused"] == 1 and not p.errors


@pytest.mark.parametrize("where", ["lower", "splice"])
def test_skip_leaves_the_graph_unchanged_and_raises_nothing(where, monkeypatch):
    gm = engine_graph()
    before = gm.graph.python_code("self").src

    def boom(*a, **k):
        raise AssertionError(f"injected failure in {where}")

    target = {"lower": (at._arfuse, "_fx_lower_graph"), "splice": (at, "_plan_site")}[where]
    monkeypatch.setattr(*target, boom)
    p = at.FusionPass(arfuse.Target.preset("h200-sxm-x2"), group="tp", on_error="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p(gm.graph)
        p(gm.graph)
    # Recorded, warned about once, the graph as it was (a failure while walking or
    # lowering raises from `_fx_lower_graph`; one while planning the
    # splice comes before the graph is touched).
    assert [type(e) for e in p.errors] == [AssertionError, AssertionError] and not p.reports
    assert len([w for w in caught if "arfuse" in str(w.message)]) == 1
    assert gm.graph.python_code("self").src == before
    with pytest.raises(AssertionError):
        at.FusionPass(arfuse.Target.preset("h200-sxm-x2"), group="tp")(gm.graph)


def test_the_pass_pickles_and_keeps_its_uuid():
    import pickle

    p = at.FusionPass(arfuse.Target.preset("b200-x4"), group="tp", all_reduce_ops=["vllm.all_reduce"])
    q = pickle.loads(pickle.dumps(p))
    assert q.uuid() == p.uuid() and q.target.to_toml() == p.target.to_toml()
    assert at.FusionPass(arfuse.Target.preset("b200-x2"), group="tp").uuid() != p.uuid()


def test_vllm_compilation_config_refuses_a_competing_fusion():
    vllm_adapter = pytest.importorskip("arfuse.vllm")
    cc = vllm_adapter.compilation_config(pass_config={"enable_noop": True}, mode=3)
    assert cc["pass_config"] == {"enable_noop": True, "fuse_allreduce_rms": False}
    assert cc["mode"] == 3
    assert isinstance(cc["inductor_compile_config"]["post_grad_custom_post_pass"], vllm_adapter.FusionPass)
    with pytest.raises(ValueError, match="fuse_allreduce_rms"):
        vllm_adapter.compilation_config(pass_config={"fuse_allreduce_rms": True})
    with pytest.raises(ValueError, match="post_grad_custom_post_pass"):
        vllm_adapter.compilation_config(inductor_compile_config={"post_grad_custom_post_pass": object()})
