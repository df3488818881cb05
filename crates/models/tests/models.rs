//! One site-count check per real config: `expected_sites` (the documented rule) and an
//! independent structural count of the built, full-depth graph agree, and match the
//! number worked out by hand here.

mod common;

use arfuse_models::{build, expected_sites, BuildOptions, NormForm};
use common::{config, observe};

/// (config, tp, L, expected sites, all-reduces, sites whose norm feeds a quant op).
const MODELS: &[(&str, u32, u32, u32, u32, u32)] = &[
    // Dense: 2L + 1.
    ("meta-llama__Llama-3.1-8B-Instruct.json", 8, 32, 65, 65, 0),
    (
        "meta-llama__Llama-3.1-70B-Instruct.json",
        8,
        80,
        161,
        161,
        0,
    ),
    ("meta-llama__Meta-Llama-3.1-405B.json", 8, 126, 253, 253, 0),
    ("Qwen__Qwen3-8B.json", 8, 36, 73, 73, 0),
    // MoE: 2L + 1 (the MoE all-reduce replaces down_proj's).
    ("Qwen__Qwen3-30B-A3B.json", 4, 48, 97, 97, 0),
    ("Qwen__Qwen3-235B-A22B.json", 4, 94, 189, 189, 0),
    ("mistralai__Mixtral-8x7B-v0.1.json", 8, 32, 65, 65, 0),
    ("openai__gpt-oss-120b.json", 4, 36, 73, 73, 0),
    // Block-FP8 MoE (MiniMax excludes only the router `gate`): every norm but the
    // final one feeds a quant: 2L.
    ("MiniMaxAI__MiniMax-M2.5.json", 4, 62, 125, 125, 124),
    // NVFP4 with self_attn* ignored: only the post-attention norms quantise (L).
    ("nvidia__MiniMax-M2.5-NVFP4.json", 4, 62, 125, 125, 62),
    ("nvidia__Qwen3-235B-A22B-NVFP4.json", 4, 94, 189, 189, 188),
    // MLA, dense-first MoE: 2L + 1.
    ("deepseek-ai__DeepSeek-V3.json", 8, 61, 123, 123, 122),
    ("deepseek-ai__DeepSeek-R1.json", 8, 61, 123, 123, 122),
    ("moonshotai__Kimi-K2-Instruct.json", 8, 61, 123, 123, 122),
    ("nvidia__DeepSeek-V3.1-NVFP4.json", 8, 61, 123, 123, 61),
    ("zai-org__GLM-5.json", 8, 78, 157, 157, 0),
    ("zai-org__GLM-5-FP8.json", 8, 78, 157, 157, 156),
    // Gemma sandwich norms: Gemma-3 2L + 1, Gemma-2 2L (normaliser after the
    // embedding all-reduce; L + ... all-reduces = 2L + 1).
    ("google__gemma-3-1b-it.json", 4, 26, 53, 53, 0),
    ("google__gemma-2-9b.json", 4, 42, 84, 85, 0),
    ("google__gemma-2-27b.json", 8, 46, 92, 93, 0),
    // Hybrid: L + 1.
    (
        "nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.json",
        4,
        52,
        53,
        53,
        0,
    ),
];

#[test]
fn every_model_has_its_site_count() {
    for &(file, tp, layers, sites, ars, quant) in MODELS {
        let cfg = config(file);
        let opts = BuildOptions::tp(tp);
        let want = expected_sites(&cfg, &opts).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(
            (want.layers, want.sites, want.all_reduces, want.with_quant),
            (layers, sites, ars, quant),
            "{file}: rule {}",
            want.rule
        );
        let g = build(&cfg, &opts).unwrap_or_else(|e| panic!("{file}: {e}"));
        let seen = observe(&g);
        assert_eq!(
            (
                seen.sites,
                seen.all_reduces,
                seen.with_quant,
                seen.without_residual
            ),
            (
                want.sites,
                want.all_reduces,
                want.with_quant,
                want.without_residual
            ),
            "{file}: structural count"
        );
    }
}

#[test]
fn decomposed_and_3d_forms_keep_the_count() {
    for &(file, tp, _, _, _, _) in MODELS {
        let cfg = config(file);
        for (norm_form, three_d) in [
            (NormForm::Decomposed, false),
            (NormForm::Explicit, true),
            (NormForm::Decomposed, true),
        ] {
            let opts = BuildOptions {
                norm_form,
                three_d,
                layers: Some(4),
                ..BuildOptions::tp(tp)
            };
            let want = expected_sites(&cfg, &opts).unwrap();
            let g = build(&cfg, &opts).unwrap_or_else(|e| panic!("{file} {opts:?}: {e}"));
            let seen = observe(&g);
            assert_eq!(
                (
                    seen.sites,
                    seen.all_reduces,
                    seen.with_quant,
                    seen.without_residual
                ),
                (
                    want.sites,
                    want.all_reduces,
                    want.with_quant,
                    want.without_residual
                ),
                "{file} {norm_form:?} three_d={three_d}"
            );
        }
    }
}

#[test]
fn cut_models_keep_their_rule() {
    // 2L + 1 with L = 2 for dense and MoE decoders; DeepSeek's first 2 layers are dense.
    let opts = BuildOptions {
        layers: Some(2),
        ..BuildOptions::tp(8)
    };
    for file in [
        "meta-llama__Llama-3.1-8B-Instruct.json",
        "deepseek-ai__DeepSeek-V3.json",
        "mistralai__Mixtral-8x7B-v0.1.json",
    ] {
        assert_eq!(
            expected_sites(&config(file), &opts).unwrap().sites,
            5,
            "{file}"
        );
    }
    let gemma2 = expected_sites(&config("google__gemma-2-9b.json"), &opts).unwrap();
    assert_eq!((gemma2.sites, gemma2.all_reduces), (4, 5));
    let opts = BuildOptions {
        layers: Some(6),
        ..BuildOptions::tp(4)
    };
    let nemo = expected_sites(
        &config("nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.json"),
        &opts,
    )
    .unwrap();
    assert_eq!((nemo.sites, nemo.all_reduces), (7, 7));
}
