"""The package's API without torch.compile: targets, plans, lowering, errors."""

import json
import os
import pathlib

import pytest

import arfuse

REPO = pathlib.Path(__file__).resolve().parents[3]
FIXTURES = REPO / "ir-fixtures"
LLAMA_TP8 = FIXTURES / "models" / "llama31_8b_tp8.json"


def test_presets_toml_and_keywords_describe_the_same_target():
    names = arfuse.Target.preset_names()
    assert "h200-sxm-x8" in names and "b200-x2" in names
    t = arfuse.Target.preset("h200-sxm-x8")
    assert (t.sm, t.world_size, t.gpus_per_node, t.interconnect) == (90, 8, 8, "nvswitch")
    assert t.dtype == "bf16" and t.kernels == "arfuse" and t.requested_backend == "auto"
    assert arfuse.Target.from_toml(t.to_toml()) == t
    kw = arfuse.Target(
        sm=t.sm,
        world_size=t.world_size,
        gpus_per_node=t.gpus_per_node,
        interconnect=t.interconnect,
        max_batched_tokens=t.max_batched_tokens,
        multicast_all_ranks=t.multicast_all_ranks,
        capture_sizes=t.capture_sizes,
    )
    assert kw == t and hash(kw) == hash(t)
    assert kw != arfuse.Target.preset("h200-sxm-x4")
    minimal = arfuse.Target.from_toml(
        'sm = 100\nworld_size = 4\ngpus_per_node = 8\ninterconnect = "nvswitch"\nmax_batched_tokens = 4096\n'
    )
    assert minimal.group_nodes == 1 and minimal.capture_sizes == [] and minimal.max_bytes_override is None


def test_keyword_defaults_are_the_toml_defaults():
    # Issue 44: a keyword left out gets the TOML default from the same code (Rust's
    # Target::from_toml_table), so multicast follows the interconnect as in a file.
    base = "sm = {sm}\nworld_size = {w}\ngpus_per_node = {g}\ninterconnect = \"{i}\"\nmax_batched_tokens = 2048\n"
    for sm, w, g, i in [(90, 8, 8, "nvswitch"), (100, 32, 4, "nvlink-fabric"), (90, 2, 2, "pcie"),
                        (90, 2, 2, "bridged-nvlink")]:
        kw = arfuse.Target(sm=sm, world_size=w, gpus_per_node=g, interconnect=i, max_batched_tokens=2048,
                           group_nodes=w // g)
        toml = arfuse.Target.from_toml(base.format(sm=sm, w=w, g=g, i=i) + f"group_nodes = {w // g}\n")
        assert kw == toml, i
        assert kw.multicast_all_ranks == (i in ("nvswitch", "nvlink-fabric")), i
    t = arfuse.Target(sm=90, world_size=8, gpus_per_node=8, interconnect="nvswitch", max_batched_tokens=64)
    assert (t.group_nodes, t.dtype, t.kernels, t.requested_backend, t.unfused_all_reduce) == (
        1, "bf16", "arfuse", "auto", "arfuse")
    assert t.capture_sizes == [] and t.max_bytes_override is None and not t.deterministic
    # Given explicitly, a keyword wins over the default.
    off = arfuse.Target(sm=90, world_size=8, gpus_per_node=8, interconnect="nvswitch", max_batched_tokens=64,
                        multicast_all_ranks=False)
    assert not off.multicast_all_ranks
    # The same machine plans the same backend from Python and from TOML (it did not:
    # trtllm from keywords, mnnvl from TOML).
    toml = arfuse.Target.from_toml(base.format(sm=100, w=8, g=8, i="nvswitch"))
    kw = arfuse.Target(sm=100, world_size=8, gpus_per_node=8, interconnect="nvswitch", max_batched_tokens=2048)
    assert arfuse.plan(kw, [4096]).backend == arfuse.plan(toml, [4096]).backend


def test_target_errors_name_the_field():
    with pytest.raises(arfuse.TargetError) as e:
        arfuse.Target(sm=90, world_size=0, gpus_per_node=8, interconnect="nvswitch", max_batched_tokens=8)
    assert (e.value.kind, e.value.field, e.value.value) == ("invalid_field", "world_size", "0")
    assert "at least one rank" in e.value.reason
    with pytest.raises(arfuse.TargetError) as e:
        arfuse.Target(sm=90, world_size=2, gpus_per_node=8, interconnect="nvlnk", max_batched_tokens=8)
    assert (e.value.field, e.value.value) == ("interconnect", "nvlnk")
    assert "bridged-nvlink" in str(e.value)
    with pytest.raises(arfuse.TargetError) as e:
        arfuse.Target.preset("h900-x8")
    assert e.value.kind == "unknown_preset" and e.value.value == "h900-x8"
    assert "h200-sxm-x8" in e.value.reason
    with pytest.raises(arfuse.TargetError) as e:
        arfuse.Target.from_toml("sm = 90\nworld_size = 8\nspeed = 3\n")
    assert e.value.kind == "toml" and "speed" in str(e.value)
    assert isinstance(e.value, arfuse.ArfuseError)


def test_plan_gives_backend_workspace_and_dispatch():
    # The seed failure's machine: 8x H200, H = 6144 (GLM-5), bf16 (arfuse_policy's
    # documented example): M = 42, one 1,179,648-byte Lamport buffer.
    p = arfuse.plan(arfuse.Target.preset("h200-sxm-x8"), [6144])
    assert p.backend == "mnnvl" and "multicast" in p.reason
    assert p.max_token_num == 42
    assert p.lamport_buffer_bytes == 1_179_648
    assert p.workspace_bytes == 256 + 3 * 1_179_648
    assert p.flashinfer_workspace_bytes == 3 * 1_179_648 + 2048
    got = [(r.lo, r.hi, r.strategy) for r in p.dispatch]
    assert got == [(1, 10, "one-shot"), (11, 42, "two-shot"), (43, 8192, "unfused")]
    assert p.dispatch[0].required_bytes <= p.dispatch[0].available_bytes == 1_179_648
    assert [(r.lo, r.hi) for r in p.dispatch_for(6144)] == [(1, 10), (11, 42), (43, 8192)]
    assert p.hidden_sizes == [6144]
    assert json.loads(p.to_json())["max_token_num"] == 42
    assert str(p).startswith("arfuse plan: SM 90, W=8, bf16")
    off = arfuse.Target.from_toml(
        arfuse.Target.preset("h200-sxm-x8").to_toml().replace('requested_backend = "auto"', 'requested_backend = "off"')
    )
    q = arfuse.plan(off, [4096])
    assert q.backend is None and q.workspace_bytes is None and q.max_token_num == 0
    with pytest.raises(arfuse.TargetError) as e:
        arfuse.plan(arfuse.Target.preset("h200-sxm-x8"), [10**9])
    assert (e.value.kind, e.value.field, e.value.value) == ("invalid_hidden", "hidden_sizes", str(10**9))


def test_lower_reads_paths_bytes_and_text_alike():
    target = arfuse.Target.preset("h200-sxm-x8")
    by_path = arfuse.lower(LLAMA_TP8, target)
    assert isinstance(by_path.report, dict) and isinstance(by_path.report, arfuse.Report)
    assert by_path.report["all_reduces_seen"] == by_path.report["all_reduces_fused"] == 65
    assert str(by_path.report).startswith("arfuse lower: group `tp`")
    assert "fused 65 / 65" in str(by_path.report)
    assert len(by_path.report.site_names) == 65
    assert by_path.graph_dict()["format"] == "arfuse-graph"
    fused = [n for n in by_path.graph_dict()["nodes"] if n["op"] == "fused_allreduce_norm"]
    assert len(fused) == 65
    text = LLAMA_TP8.read_text()
    for form in (str(LLAMA_TP8), text, text.encode()):
        assert arfuse.lower(form, target).graph == by_path.graph
    # Lowering the lowered graph changes nothing.
    again = arfuse.lower(by_path.graph, target)
    assert again.graph == by_path.graph and again.report["already_fused"] == 65


def test_lower_reads_torch_export_json_with_its_options():
    path = FIXTURES / "exported" / "gemma3_1b_L2_tp2.exported_program.json"
    low = arfuse.lower(path, arfuse.Target.preset("h200-sxm-x2"), group="0")
    assert low.report["group"] == "0"
    assert low.report["all_reduces_fused"] == low.report["all_reduces_seen"] > 0
    assert any("dropped" in n or "forwarded" in n for n in low.notes)
    with pytest.raises(arfuse.LowerError) as e:
        arfuse.lower(path, arfuse.Target.preset("h200-sxm-x2"), all_reduce_ops=["notanop"])
    assert e.value.kind == "all_reduce_ops"


def test_load_errors_keep_the_position_node_and_tensor():
    target = arfuse.Target.preset("h200-sxm-x8")
    with pytest.raises(arfuse.LoadError) as e:
        arfuse.lower(FIXTURES / "malformed" / "syntax_error.json", target)
    assert e.value.kind == "json" and e.value.location.startswith("line ")
    with pytest.raises(arfuse.LoadError) as e:
        arfuse.lower(FIXTURES / "malformed" / "dtype_mismatch.json", target)
    assert e.value.kind == "invalid_graph"
    assert e.value.node is not None and e.value.node == e.value.problems[0][0]
    assert e.value.node in str(e.value)
    program = json.loads((FIXTURES / "exported" / "gemma3_1b_L2_tp2.exported_program.json").read_text())
    nodes = program["graph_module"]["graph"]["nodes"]
    victim = next(n for n in nodes if n["target"] == "torch.ops.aten.embedding.default")
    victim["inputs"][0]["arg"]["as_tensor"]["name"] = "nowhere"
    with pytest.raises(arfuse.LoadError) as e:
        arfuse.lower(json.dumps(program), arfuse.Target.preset("h200-sxm-x2"))
    assert e.value.kind == "missing_tensor" and e.value.tensor == "nowhere"
    assert e.value.node is not None
    with pytest.raises(arfuse.LoadError) as e:
        arfuse.lower(b"\x00\x01binary", target)
    assert e.value.kind == "unknown_format"
    with pytest.raises(TypeError):
        arfuse.lower(42, target)


def test_lower_errors_name_what_is_wrong():
    # The corpus graph records TP 8; a TP 2 target is refused, not silently re-planned.
    with pytest.raises(arfuse.LowerError) as e:
        arfuse.lower(LLAMA_TP8, arfuse.Target.preset("h200-sxm-x2"))
    assert e.value.kind == "world_size_mismatch" and "world_size = 8" in str(e.value)
    assert e.value.node is None and e.value.problems == []


def test_lower_takes_an_exported_program():
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.RMSNorm(256, eps=1e-6, dtype=torch.bfloat16)

        def forward(self, x, residual):
            y = torch.ops._c10d_functional.all_reduce(x, "sum", "tp")
            y = torch.ops._c10d_functional.wait_tensor(y)
            h = y + residual
            return self.norm(h), h

    x = torch.zeros(8, 256, dtype=torch.bfloat16)
    ep = torch.export.export(Block(), (x, x))
    low = arfuse.lower(ep, arfuse.Target.preset("h200-sxm-x2"))
    assert low.report["all_reduces_fused"] == 1
    site = low.report["sites"][0]
    assert site["fused"] and site["pattern"].startswith("allreduce+residual+rms_norm")
    assert sorted(site["outputs"]) == ["norm", "residual"]


def test_unfused_all_reduce_decides_batch_invariance():
    # h200-sxm-x8 at H = 4096 fuses up to 64 tokens and leaves the rest unfused: with
    # arfuse's own unfused path every T reduces in one order; with the engine's it does
    # not, and a deterministic target is then refused, naming the field to change.
    t = arfuse.Target.preset("h200-sxm-x8")
    assert t.unfused_all_reduce == "arfuse"
    p = arfuse.plan(t, [4096])
    assert p.backend is not None and p.batch_invariant
    assert [(r.lo, r.hi, r.strategy) for r in p.dispatch][-1] == (65, 8192, "unfused")
    fields = dict(
        sm=t.sm,
        world_size=t.world_size,
        gpus_per_node=t.gpus_per_node,
        interconnect=t.interconnect,
        max_batched_tokens=t.max_batched_tokens,
        multicast_all_ranks=t.multicast_all_ranks,
        capture_sizes=t.capture_sizes,
    )
    engine = arfuse.Target(unfused_all_reduce="engine", **fields)
    assert engine.unfused_all_reduce == "engine" and engine != t
    assert 'unfused_all_reduce = "engine"' in engine.to_toml()
    q = arfuse.plan(engine, [4096])
    assert q.backend is not None and not q.batch_invariant
    assert any(n.startswith("not batch-invariant") for n in q.notes)
    refused = arfuse.plan(arfuse.Target(unfused_all_reduce="engine", deterministic=True, **fields), [4096])
    assert refused.backend is None
    assert "unfused through the engine's all-reduce" in refused.reason
    assert 'unfused_all_reduce = "arfuse"' in refused.reason
    with pytest.raises(arfuse.TargetError) as e:
        arfuse.Target(unfused_all_reduce="nccl", **fields)
    assert (e.value.field, e.value.value) == ("unfused_all_reduce", "nccl")
