//! Per-architecture checks with real shapes and values from the corpus configs.

mod common;

use arfuse_ir::Op;
use arfuse_models::{
    build, build_eagle3_draft, expected_sites, BuildError, BuildOptions, NormForm,
};
use common::{config, count_op, input_ids, node, observe, shape, user_ids};

fn cut(tp: u32, layers: u32) -> BuildOptions {
    BuildOptions {
        layers: Some(layers),
        ..BuildOptions::tp(tp)
    }
}

fn opaque_attrs(g: &arfuse_ir::Graph, id: &str) -> (String, serde_json::Value) {
    match &node(g, id).op {
        Op::Opaque { target, attrs } => (target.clone(), attrs.clone()),
        op => panic!("{id} is {}", op.name()),
    }
}

#[test]
fn llama_8b_tp8_per_rank_shapes() {
    let g = build(
        &config("meta-llama__Llama-3.1-8B-Instruct.json"),
        &cut(8, 2),
    )
    .unwrap();
    // 128256 rows padded to 64 and split over 8 ranks.
    assert_eq!(shape(&g, "embed_tokens.weight"), "bf16[16032,4096]");
    assert_eq!(shape(&g, "embed_tokens.all_reduce"), "bf16[T,4096]");
    // 32 heads / 8 = 4 q heads, 8 kv heads / 8 = 1, head_dim 128: (4 + 2) * 128.
    assert_eq!(
        shape(&g, "layers.0.self_attn.qkv_proj.weight"),
        "bf16[768,4096]"
    );
    assert_eq!(shape(&g, "layers.0.self_attn.attn"), "bf16[T,512]");
    assert_eq!(
        shape(&g, "layers.0.self_attn.o_proj.weight"),
        "bf16[4096,512]"
    );
    // 14336 / 8 = 1792.
    assert_eq!(
        shape(&g, "layers.0.mlp.gate_up_proj.weight"),
        "bf16[3584,4096]"
    );
    assert_eq!(
        shape(&g, "layers.0.mlp.down_proj.weight"),
        "bf16[4096,1792]"
    );
    assert_eq!(
        node(&g, "layers.0.mlp.down_proj").module.as_deref(),
        Some("model.layers.0.mlp.down_proj")
    );
    match node(&g, "layers.1.input_layernorm").op {
        Op::FusedAddRmsNorm {
            eps, weight_bias, ..
        } => assert_eq!((eps, weight_bias), (1e-5, 0.0)),
        ref op => panic!("{}", op.name()),
    }
    // First layer: no residual; the embedding all-reduce is also layer 0's residual.
    assert_eq!(node(&g, "layers.0.input_layernorm").op.name(), "rms_norm");
    assert_eq!(
        user_ids(&g, "embed_tokens.all_reduce"),
        [
            "layers.0.input_layernorm",
            "layers.0.post_attention_layernorm"
        ]
    );
    assert_eq!(count_op(&g, "all_reduce"), 5);
    assert_eq!(count_op(&g, "fused_add_rms_norm"), 4);
    assert_eq!(g.symbols()["T"].max, 8192);
    // The final norm's residual output is dead; only the normed value is a graph output.
    assert_eq!(g.outputs().len(), 1);
    assert_eq!(g.value_ref(g.outputs()[0]), "norm");
}

#[test]
fn mla_shapes_deepseek_v3() {
    let g = build(&config("deepseek-ai__DeepSeek-V3.json"), &cut(8, 4)).unwrap();
    assert_eq!(
        shape(&g, "layers.0.self_attn.q_a_proj.weight"),
        "fp8_e4m3[1536,7168]"
    );
    assert_eq!(
        shape(&g, "layers.0.self_attn.q_a_proj.weight_scale_inv"),
        "f32[12,56]"
    );
    assert_eq!(
        shape(&g, "layers.0.self_attn.q_a_layernorm"),
        "bf16[T,1536]"
    );
    // 128 heads / 8 = 16, (128 nope + 64 rope) = 192 per head.
    assert_eq!(
        shape(&g, "layers.0.self_attn.q_b_proj.weight"),
        "fp8_e4m3[3072,1536]"
    );
    // kv_lora 512 + rope 64, replicated.
    assert_eq!(
        shape(&g, "layers.0.self_attn.kv_a_proj_with_mqa.weight"),
        "fp8_e4m3[576,7168]"
    );
    // 16 heads * v_head_dim 128.
    assert_eq!(shape(&g, "layers.0.self_attn.attn"), "bf16[T,2048]");
    assert_eq!(
        shape(&g, "layers.0.self_attn.o_proj.weight"),
        "fp8_e4m3[7168,2048]"
    );
    let (target, attrs) = opaque_attrs(&g, "layers.0.self_attn.attn");
    assert_eq!(target, "mla_attention");
    assert_eq!(attrs["heads_per_rank"], 16);
    assert_eq!(attrs["kv_lora_rank"], 512);
    assert_eq!(
        input_ids(&g, "layers.0.self_attn.attn"),
        [
            "layers.0.self_attn.q_b_proj",
            "layers.0.self_attn.kv_a_proj_with_mqa"
        ]
    );
    // q_a_layernorm is an RMSNorm with no all-reduce before it: not a site.
    assert_eq!(observe(&g).sites, 9);
}

#[test]
fn dense_first_layers() {
    let g = build(&config("deepseek-ai__DeepSeek-V3.json"), &cut(8, 5)).unwrap();
    for i in 0..3 {
        // 18432 / 8 = 2304.
        assert_eq!(
            shape(&g, &format!("layers.{i}.mlp.gate_up_proj.weight")),
            "fp8_e4m3[4608,7168]"
        );
        assert!(g.find(&format!("layers.{i}.mlp.experts")).is_none());
    }
    for i in 3..5 {
        assert!(g.find(&format!("layers.{i}.mlp.gate_up_proj")).is_none());
        let (target, attrs) = opaque_attrs(&g, &format!("layers.{i}.mlp.experts"));
        assert_eq!(target, "moe");
        assert_eq!(
            (
                attrs["experts"].as_u64(),
                attrs["top_k"].as_u64(),
                attrs["moe_intermediate_size_per_rank"].as_u64()
            ),
            (Some(256), Some(8), Some(256))
        );
        assert_eq!(attrs["shared_experts"], 1);
        assert_eq!(
            shape(&g, &format!("layers.{i}.mlp.experts")),
            "bf16[T,7168]"
        );
        assert_eq!(
            input_ids(&g, &format!("layers.{i}.mlp.all_reduce")),
            [format!("layers.{i}.mlp.experts")]
        );
    }
    // Kimi-K2: first_k_dense_replace = 1.
    let k = build(&config("moonshotai__Kimi-K2-Instruct.json"), &cut(8, 2)).unwrap();
    assert!(k.find("layers.0.mlp.gate_up_proj").is_some());
    assert_eq!(opaque_attrs(&k, "layers.1.mlp.experts").1["experts"], 384);
}

#[test]
fn gemma3_sandwich_norms() {
    let cfg = config("google__gemma-3-1b-it.json");
    let g = build(&cfg, &cut(4, 2)).unwrap();
    // The scale sits inside the embedding module: before the all-reduce.
    assert_eq!(
        input_ids(&g, "embed_tokens.all_reduce"),
        ["embed_tokens.embed_scale"]
    );
    match &node(&g, "embed_tokens.embed_scale.value").op {
        Op::Constant { value } => assert_eq!(*value, 1152f64.sqrt()),
        op => panic!("{}", op.name()),
    }
    // The o_proj all-reduce feeds post_attention_layernorm directly and nothing else.
    assert_eq!(
        user_ids(&g, "layers.0.self_attn.o_proj.all_reduce"),
        ["layers.0.post_attention_layernorm"]
    );
    match node(&g, "layers.0.post_attention_layernorm").op {
        Op::RmsNorm {
            eps, weight_bias, ..
        } => assert_eq!((eps, weight_bias), (1e-6, 1.0)),
        ref op => panic!("{}", op.name()),
    }
    // Weight parameter bf16, read as f32 (HF: 1 + w.float()).
    assert_eq!(
        shape(&g, "layers.0.post_attention_layernorm.weight"),
        "bf16[1152]"
    );
    assert_eq!(
        input_ids(&g, "layers.0.post_attention_layernorm"),
        [
            "layers.0.self_attn.o_proj.all_reduce",
            "layers.0.post_attention_layernorm.weight_f32"
        ]
    );
    assert_eq!(
        shape(&g, "layers.0.post_attention_layernorm.weight_f32"),
        "f32[1152]"
    );
    // The residual add comes after the post-attention norm, fused into pre_feedforward.
    assert_eq!(
        input_ids(&g, "layers.0.pre_feedforward_layernorm"),
        [
            "layers.0.post_attention_layernorm",
            "embed_tokens.all_reduce",
            "layers.0.pre_feedforward_layernorm.weight_f32"
        ]
    );
    assert_eq!(
        user_ids(&g, "layers.0.mlp.all_reduce"),
        ["layers.0.post_feedforward_layernorm"]
    );
    assert_eq!(
        input_ids(&g, "layers.1.input_layernorm"),
        [
            "layers.0.post_feedforward_layernorm",
            "layers.0.pre_feedforward_layernorm:1",
            "layers.1.input_layernorm.weight_f32"
        ]
    );
    // 4 heads / 4, 1 kv head replicated, head_dim 256; ffn 6912 / 4.
    assert_eq!(
        shape(&g, "layers.0.self_attn.qkv_proj.weight"),
        "bf16[768,1152]"
    );
    assert_eq!(
        shape(&g, "layers.0.mlp.down_proj.weight"),
        "bf16[1152,1728]"
    );
    assert_eq!(
        opaque_attrs(&g, "layers.0.mlp.act_fn").0,
        "gelu_pytorch_tanh_and_mul"
    );
    assert_eq!(
        opaque_attrs(&g, "layers.0.self_attn.attn").1["sliding_window"],
        512
    );
    let seen = observe(&g);
    assert_eq!((seen.sites, seen.without_residual), (5, 5));
    assert_eq!(expected_sites(&cfg, &cut(4, 2)).unwrap().sites, 5);
}

#[test]
fn gemma2_normaliser_blocks_the_embedding_site() {
    let g = build(&config("google__gemma-2-9b.json"), &cut(4, 2)).unwrap();
    assert_eq!(user_ids(&g, "embed_tokens.all_reduce"), ["normalizer"]);
    assert_eq!(
        input_ids(&g, "layers.0.input_layernorm"),
        ["normalizer", "layers.0.input_layernorm.weight_f32"]
    );
    let seen = observe(&g);
    assert_eq!((seen.all_reduces, seen.sites), (5, 4));
    assert!(!seen
        .site_ids
        .contains(&"embed_tokens.all_reduce".to_string()));
    // Even layers slide (window 4096).
    assert_eq!(
        opaque_attrs(&g, "layers.0.self_attn.attn").1["sliding_window"],
        4096
    );
    assert!(opaque_attrs(&g, "layers.1.self_attn.attn")
        .1
        .get("sliding_window")
        .is_none());
}

#[test]
fn gemma_decomposed_norm_is_hf_form() {
    let opts = BuildOptions {
        norm_form: NormForm::Decomposed,
        ..cut(4, 1)
    };
    let g = build(&config("google__gemma-3-1b-it.json"), &opts).unwrap();
    let n = "layers.0.post_attention_layernorm";
    assert_eq!(
        input_ids(&g, &format!("{n}.to_f32")),
        ["layers.0.self_attn.o_proj.all_reduce"]
    );
    assert_eq!(
        input_ids(&g, &format!("{n}.mul_rsqrt")),
        [format!("{n}.to_f32"), format!("{n}.rsqrt")]
    );
    assert_eq!(
        input_ids(&g, &format!("{n}.weight_plus_one")),
        [format!("{n}.weight_f32"), format!("{n}.one")]
    );
    assert_eq!(
        input_ids(&g, &format!("{n}.mul_weight")),
        [format!("{n}.mul_rsqrt"), format!("{n}.weight_plus_one")]
    );
    assert_eq!(
        node(&g, n).op,
        Op::ToDtype {
            dtype: arfuse_ir::DType::Bf16
        }
    );
    assert_eq!(shape(&g, &format!("{n}.mean")), "f32[T,1]");
    assert_eq!(
        node(&g, &format!("{n}.eps")).op,
        Op::Constant { value: 1e-6 }
    );
    // Residual add of HF: residual + post_attention_layernorm(x).
    assert_eq!(
        input_ids(&g, "layers.0.attn_residual_add"),
        [
            "embed_tokens.all_reduce",
            "layers.0.post_attention_layernorm"
        ]
    );
    assert_eq!(
        count_op(&g, "rms_norm") + count_op(&g, "fused_add_rms_norm"),
        0
    );
}

#[test]
fn llama_decomposed_3d() {
    let opts = BuildOptions {
        norm_form: NormForm::Decomposed,
        three_d: true,
        ..cut(8, 1)
    };
    let g = build(&config("meta-llama__Llama-3.1-8B-Instruct.json"), &opts).unwrap();
    assert_eq!(shape(&g, "input_ids"), "i64[B,S]");
    assert_eq!(shape(&g, "embed_tokens"), "bf16[B,S,4096]");
    assert_eq!(
        shape(&g, "layers.0.self_attn.o_proj.all_reduce"),
        "bf16[B*S,4096]"
    );
    assert_eq!(
        input_ids(&g, "layers.0.self_attn.o_proj.all_reduce"),
        ["layers.0.self_attn.o_proj.all_reduce.flatten"]
    );
    assert_eq!(
        input_ids(&g, "layers.0.attn_residual_add"),
        [
            "embed_tokens.all_reduce.unflatten",
            "layers.0.self_attn.o_proj.all_reduce.unflatten"
        ]
    );
    let n = "layers.0.post_attention_layernorm";
    assert_eq!(shape(&g, &format!("{n}.mean")), "f32[B,S,1]");
    // Llama: weight * x.to(bf16).
    assert_eq!(
        input_ids(&g, n),
        [format!("{n}.weight"), format!("{n}.to_act")]
    );
    assert_eq!((g.symbols()["B"].max, g.symbols()["S"].max), (8, 1024));
    assert_eq!(observe(&g).sites, 3);
}

#[test]
fn block_fp8_quant_insertion() {
    let g = build(&config("deepseek-ai__DeepSeek-V3.json"), &cut(8, 4)).unwrap();
    // Dense layer: the input norm's only consumer is its quant (q_a and kv_a are FP8).
    assert_eq!(
        user_ids(&g, "layers.0.input_layernorm"),
        ["layers.0.input_layernorm.quant"]
    );
    let q = node(&g, "layers.0.input_layernorm.quant");
    assert_eq!(
        q.op,
        Op::QuantFp8PerTokenGroup {
            group_size: 128,
            scale_layout: arfuse_ir::GroupScaleLayout::PackedUe8m0
        }
    );
    // 7168 / 128 = 56 groups, 4 ue8m0 exponents per i32.
    assert_eq!(q.outputs[1].to_string(), "i32[T,14]");
    assert_eq!(
        user_ids(&g, "layers.0.input_layernorm.quant"),
        [
            "layers.0.self_attn.kv_a_proj_with_mqa",
            "layers.0.self_attn.q_a_proj"
        ]
    );
    // MoE layer: the router reads the bf16 norm output, the experts the quantised one.
    assert_eq!(
        user_ids(&g, "layers.3.post_attention_layernorm"),
        [
            "layers.3.mlp.experts",
            "layers.3.post_attention_layernorm.quant"
        ]
    );
    assert_eq!(
        input_ids(&g, "layers.3.mlp.experts"),
        [
            "layers.3.post_attention_layernorm",
            "layers.3.mlp.gate.weight",
            "layers.3.post_attention_layernorm.quant",
            "layers.3.post_attention_layernorm.quant:1"
        ]
    );
    // The final norm feeds lm_head (bf16): no quant.
    assert!(g.find("norm.quant").is_none());
    assert_eq!(observe(&g).with_quant, 8);
}

#[test]
fn modules_to_not_convert_keeps_bf16_consumers() {
    // GLM-5-FP8 lists self_attn.indexers_proj: the input norm keeps a live bf16 output.
    let g = build(&config("zai-org__GLM-5-FP8.json"), &cut(8, 4)).unwrap();
    assert_eq!(
        user_ids(&g, "layers.3.input_layernorm"),
        [
            "layers.3.input_layernorm.quant",
            "layers.3.self_attn.indexers_proj"
        ]
    );
    assert_eq!(
        node(&g, "layers.3.self_attn.indexers_proj").op.name(),
        "matmul"
    );
    assert_eq!(
        shape(&g, "layers.3.self_attn.indexers_proj.weight"),
        "bf16[32,6144]"
    );
    assert_eq!(
        shape(&g, "layers.3.self_attn.indexer.wk.weight"),
        "fp8_e4m3[128,6144]"
    );
    // 64 heads / 8 * v_head_dim 256.
    assert_eq!(
        shape(&g, "layers.3.self_attn.o_proj.weight"),
        "fp8_e4m3[6144,2048]"
    );

    // Excluding the attention modules of a block-FP8 config removes the input-norm quant.
    let mut cfg = config("deepseek-ai__DeepSeek-V3.json");
    cfg["quantization_config"]["modules_to_not_convert"] =
        serde_json::json!(["model.layers.*.self_attn"]);
    let g = build(&cfg, &cut(8, 1)).unwrap();
    assert!(g.find("layers.0.input_layernorm.quant").is_none());
    assert_eq!(node(&g, "layers.0.self_attn.q_a_proj").op.name(), "matmul");
    assert!(g.find("layers.0.post_attention_layernorm.quant").is_some());
    assert_eq!(expected_sites(&cfg, &cut(8, 1)).unwrap().with_quant, 1);

    // Excluding one shard of a fused GEMM is refused, naming the field.
    let mut cfg = config("MiniMaxAI__MiniMax-M2.5.json");
    cfg["quantization_config"]["modules_to_not_convert"] =
        serde_json::json!(["model.layers.0.self_attn.k_proj"]);
    let err = build(&cfg, &cut(4, 1)).unwrap_err();
    assert!(
        err.to_string()
            .contains("quantization_config.modules_to_not_convert"),
        "{err}"
    );
}

#[test]
fn nvfp4_quant_insertion() {
    let g = build(&config("nvidia__DeepSeek-V3.1-NVFP4.json"), &cut(8, 4)).unwrap();
    // MLA projections are excluded: bf16 GEMMs read the input norm, no quant.
    assert_eq!(
        user_ids(&g, "layers.0.input_layernorm"),
        [
            "layers.0.self_attn.kv_a_proj_with_mqa",
            "layers.0.self_attn.q_a_proj"
        ]
    );
    assert_eq!(
        shape(&g, "layers.0.self_attn.q_a_proj.weight"),
        "bf16[1536,7168]"
    );
    // o_proj is not excluded: NVFP4.
    assert_eq!(
        opaque_attrs(&g, "layers.0.self_attn.o_proj").0,
        "nvfp4_gemm"
    );
    let q = node(&g, "layers.3.post_attention_layernorm.quant");
    assert_eq!(
        q.op,
        Op::QuantNvfp4 {
            scale_layout: arfuse_ir::Nvfp4ScaleLayout::Swizzled128x4
        }
    );
    assert_eq!(q.outputs[0].to_string(), "fp4_e2m1x2[T,3584]");
    assert_eq!(q.outputs[1].to_string(), "fp8_e4m3[T,448]");
    assert_eq!(
        shape(&g, "layers.3.post_attention_layernorm.quant.global_scale"),
        "f32[1]"
    );
    assert_eq!(
        shape(&g, "layers.0.mlp.gate_up_proj.weight"),
        "fp4_e2m1x2[4608,3584]"
    );
    assert_eq!(
        shape(&g, "layers.0.mlp.gate_up_proj.weight_scale"),
        "fp8_e4m3[4608,448]"
    );
    // NVFP4 in quantization_config (MiniMax): self_attn* ignored, MoE quantised.
    let m = build(&config("nvidia__MiniMax-M2.5-NVFP4.json"), &cut(4, 1)).unwrap();
    assert!(m.find("layers.0.input_layernorm.quant").is_none());
    assert!(m.find("layers.0.post_attention_layernorm.quant").is_some());
    assert_eq!(
        node(&m, "layers.0.block_sparse_moe.experts")
            .module
            .as_deref(),
        Some("model.layers.0.block_sparse_moe")
    );
}

#[test]
fn mxfp4_and_bf16_configs_have_no_quant_ops() {
    let g = build(&config("openai__gpt-oss-120b.json"), &cut(4, 2)).unwrap();
    for op in [
        "quant_fp8_per_token_group",
        "quant_nvfp4",
        "quant_fp8_per_token",
        "quant_fp8_static",
    ] {
        assert_eq!(count_op(&g, op), 0, "{op}");
    }
    assert_eq!(
        opaque_attrs(&g, "layers.0.mlp.experts").1["weights"],
        "mxfp4"
    );
    assert_eq!(shape(&g, "layers.0.mlp.router.weight"), "bf16[128,2880]");
    // 64 heads / 4 = 16, 8 kv / 4 = 2, head_dim 64; biases on qkv and o_proj.
    assert_eq!(
        shape(&g, "layers.0.self_attn.qkv_proj.weight"),
        "bf16[1280,2880]"
    );
    assert_eq!(
        input_ids(&g, "layers.0.self_attn.o_proj.all_reduce"),
        ["layers.0.self_attn.o_proj.bias_add"]
    );
    assert_eq!(
        opaque_attrs(&g, "layers.0.self_attn.attn").1["sliding_window"],
        128
    );
    assert!(opaque_attrs(&g, "layers.1.self_attn.attn")
        .1
        .get("sliding_window")
        .is_none());
}

#[test]
fn nemotron_h_hybrid_blocks() {
    let cfg = config("nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.json");
    // Pattern starts "MEMEM*E".
    let g = build(&cfg, &cut(4, 7)).unwrap();
    // Mamba2: 64 heads / 4 = 16, head_dim 64 -> inner 1024; 8 groups / 4 = 2, state 128:
    // in_proj 2*1024 + 2*2*128 + 16 = 2576.
    assert_eq!(
        shape(&g, "layers.0.mixer.in_proj.weight"),
        "bf16[2576,2688]"
    );
    assert_eq!(
        shape(&g, "layers.0.mixer.out_proj.weight"),
        "bf16[2688,1024]"
    );
    assert_eq!(
        input_ids(&g, "layers.0.mixer.all_reduce"),
        ["layers.0.mixer.out_proj"]
    );
    assert_eq!(
        opaque_attrs(&g, "layers.1.mixer.experts").1["shared_intermediate_size"],
        3712
    );
    assert_eq!(
        opaque_attrs(&g, "layers.1.mixer.experts").1["activation"],
        "relu2"
    );
    // Attention block: 32 heads / 4 = 8, 2 kv heads replicated to 1, head_dim 128.
    assert_eq!(
        shape(&g, "layers.5.mixer.qkv_proj.weight"),
        "bf16[1280,2688]"
    );
    assert_eq!(
        node(&g, "norm_f").module.as_deref(),
        Some("backbone.norm_f")
    );
    match node(&g, "layers.1.norm").op {
        Op::FusedAddRmsNorm { eps, .. } => assert_eq!(eps, 1e-5),
        ref op => panic!("{}", op.name()),
    }
    assert_eq!(user_ids(&g, "layers.0.mixer.all_reduce"), ["layers.1.norm"]);
    let seen = observe(&g);
    assert_eq!((seen.all_reduces, seen.sites), (8, 8));
}

#[test]
fn eagle3_draft_shares_the_target_width() {
    let cfg = config("meta-llama__Llama-3.1-8B-Instruct.json");
    let g = build_eagle3_draft(&cfg, &BuildOptions::tp(8)).unwrap();
    assert_eq!(shape(&g, "fc.weight"), "bf16[4096,12288]");
    assert_eq!(shape(&g, "layers.0.self_attn.cat"), "bf16[T,8192]");
    assert_eq!(
        shape(&g, "layers.0.self_attn.qkv_proj.weight"),
        "bf16[768,8192]"
    );
    // Every all-reduce has the target's [T, 4096].
    for (_, n) in g.nodes().filter(|(_, n)| n.op.name() == "all_reduce") {
        assert_eq!(n.outputs[0].to_string(), "bf16[T,4096]");
    }
    assert_eq!(
        user_ids(&g, "embed_tokens.all_reduce"),
        ["layers.0.input_layernorm"]
    );
    assert_eq!(g.outputs().len(), 2);
    assert_eq!(g.value_ref(g.outputs()[1]), "norm:1");
    let seen = observe(&g);
    assert_eq!(
        (seen.sites, seen.all_reduces, seen.without_residual),
        (3, 3, 1)
    );
    assert!(build_eagle3_draft(
        &config("deepseek-ai__DeepSeek-V3.json"),
        &BuildOptions::tp(8)
    )
    .is_err());
}

#[test]
fn bad_configs_name_the_field() {
    let base = config("meta-llama__Llama-3.1-8B-Instruct.json");
    let with = |key: &str, v: serde_json::Value| {
        let mut c = base.clone();
        if v.is_null() {
            c.as_object_mut().unwrap().remove(key);
        } else {
            c[key] = v;
        }
        c
    };
    let cases: Vec<(serde_json::Value, BuildOptions, &str)> = vec![
        (
            with("hidden_size", serde_json::Value::Null),
            cut(8, 1),
            "`hidden_size` is missing",
        ),
        (
            with("hidden_size", serde_json::json!("big")),
            cut(8, 1),
            "`hidden_size` is invalid",
        ),
        (
            with("model_type", serde_json::json!("bert")),
            cut(8, 1),
            "`model_type`",
        ),
        (
            with("rms_norm_eps", serde_json::json!(-1.0)),
            cut(8, 1),
            "`rms_norm_eps` is invalid",
        ),
        (
            base.clone(),
            cut(3, 1),
            "`num_attention_heads` = 32 cannot be split over tp = 3",
        ),
        (base.clone(), cut(8, 33), "`layers`"),
        (
            base.clone(),
            BuildOptions {
                tp: 0,
                ..BuildOptions::default()
            },
            "`tp`",
        ),
        (
            with(
                "quantization_config",
                serde_json::json!({"quant_method": "awq"}),
            ),
            cut(8, 1),
            "quantization_config.quant_method",
        ),
        (serde_json::json!([1, 2]), cut(8, 1), "JSON object"),
    ];
    for (cfg, opts, want) in cases {
        let err = build(&cfg, &opts).unwrap_err();
        assert!(err.to_string().contains(want), "{err} (wanted {want})");
        assert!(expected_sites(&cfg, &opts).is_err());
    }
    let mut nemo = config("nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.json");
    nemo["hybrid_override_pattern"] = serde_json::json!("MEM");
    let err = build(&nemo, &BuildOptions::tp(4)).unwrap_err();
    assert!(
        matches!(&err, BuildError::BadField { field, .. } if field == "hybrid_override_pattern"),
        "{err}"
    );
}
