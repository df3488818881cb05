//! Bad input named precisely (issue 20 item 5): unknown attribute keys with the
//! expected ones, eps in (0, 1), a symbol bound above the IR's limit refused once,
//! identical problems grouped, number-type errors naming the field; a residual's type
//! mismatch labelled by what differs.

use arfuse_ir::{Graph, LoadError, MAX_SYMBOL_VALUE};

/// A graph with `symbols` and one input node `x : bf16[T, 64]` followed by `nodes`.
fn graph(symbols: &str, nodes: &str) -> String {
    format!(
        r#"{{"format": "arfuse-graph", "version": 1, "symbols": {symbols},
            "nodes": [{{"id": "x", "op": "input", "outputs": [{{"dtype": "bf16", "shape": ["T", 64]}}]}}{nodes}],
            "outputs": ["x"]}}"#
    )
}

fn error(text: &str) -> String {
    match Graph::from_json_str(text) {
        Err(e @ LoadError::Invalid(_)) => e.to_string(),
        other => panic!("expected invalid graph, got {other:?}"),
    }
}

const T: &str = r#"{"T": {"min": 1, "max": 8192}}"#;

fn rms_norm(id: &str, attrs: &str) -> String {
    format!(
        r#", {{"id": "{id}", "op": "rms_norm", "attrs": {attrs}, "inputs": ["x", "w"],
             "outputs": [{{"dtype": "bf16", "shape": ["T", 64]}}]}}"#
    )
}

const WEIGHT: &str = r#", {"id": "w", "op": "input", "attrs": {"kind": "parameter"}, "outputs": [{"dtype": "bf16", "shape": [64]}]}"#;

#[test]
fn a_misspelt_attribute_is_named_with_the_expected_ones() {
    let e = error(&graph(
        T,
        &format!("{WEIGHT}{}", rms_norm("n", r#"{"epss": 1e-6}"#)),
    ));
    assert!(
        e.contains(
            "n [attribute]: unknown attribute \"epss\" for op \"rms_norm\"; its attributes are \
             eps, weight_bias"
        ),
        "{e}"
    );
    assert!(!e.contains("missing"), "{e}");
}

#[test]
fn eps_must_be_in_zero_one() {
    // 1e-300 is 0 as an f32.
    for eps in ["1e308", "1.0", "2", "1e-300", "0", "-1e-5"] {
        let e = error(&graph(
            T,
            &format!("{WEIGHT}{}", rms_norm("n", &format!(r#"{{"eps": {eps}}}"#))),
        ));
        assert!(
            e.contains(
                "n [attribute]: eps must be finite and in (0, 1), non-zero in f32 (models use \
                 1e-5 or 1e-6), got "
            ),
            "{eps}: {e}"
        );
    }
    Graph::from_json_str(&graph(
        T,
        &format!("{WEIGHT}{}", rms_norm("n", r#"{"eps": 0.999}"#)),
    ))
    .unwrap();
    // The smallest positive f32 (a subnormal) is still an eps.
    Graph::from_json_str(&graph(
        T,
        &format!("{WEIGHT}{}", rms_norm("n", r#"{"eps": 1.5e-45}"#)),
    ))
    .unwrap();
}

#[test]
fn a_symbol_bound_above_the_limit_is_refused_once() {
    let nodes: String = (0..50)
        .map(|i| {
            format!(
                r#", {{"id": "r{i}", "op": "rsqrt", "inputs": ["x"], "outputs": [{{"dtype": "bf16", "shape": ["T", 64]}}]}}"#
            )
        })
        .collect();
    let e = error(&graph(
        &format!(r#"{{"T": {{"min": 1, "max": {}}}}}"#, u64::MAX),
        &nodes,
    ));
    assert!(e.starts_with("1 problem(s) in the graph:"), "{e}");
    assert!(
        e.contains(&format!(
            "symbols.T [limit]: max 18446744073709551615 is above the limit of {MAX_SYMBOL_VALUE} \
             (MAX_SYMBOL_VALUE, 2^31 - 1)"
        )),
        "{e}"
    );
    // At the limit: loads.
    Graph::from_json_str(&graph(
        &format!(r#"{{"T": {{"min": 1, "max": {MAX_SYMBOL_VALUE}}}}}"#),
        &nodes,
    ))
    .unwrap();
}

#[test]
fn identical_problems_are_one_line_with_a_count_and_the_first_ids() {
    let nodes: String = (0..65)
        .map(|i| {
            format!(
                r#", {{"id": "f{i}", "op": "frobnicate", "inputs": ["x"], "outputs": [{{"dtype": "bf16", "shape": ["T", 64]}}]}}"#
            )
        })
        .collect();
    let e = error(&graph(T, &nodes));
    assert_eq!(e.lines().count(), 2, "{e}");
    assert_eq!(
        e,
        "65 problem(s) in the graph:\n  - 65 times [attribute]: unknown op \"frobnicate\"; use \
         \"opaque\" with a \"target\" for ops arfuse does not model (at f0, f1, f2, f3, f4 and 60 \
         more)"
    );
}

#[test]
fn a_number_of_the_wrong_type_names_its_field() {
    let e = error(&graph(r#"{"T": {"min": 1, "max": 1e30}}"#, ""));
    assert!(
        e.contains(
            "symbols.T [symbol]: field \"max\" is 1e+30, not a non-negative 64-bit integer (symbol bounds \
             are integers from 0 to 2147483647)"
        ),
        "{e}"
    );
    let e = error(&graph(
        T,
        r#", {"id": "q", "op": "quant_fp8_per_token_group", "attrs": {"group_size": 1.5, "scale_layout": "f32_row_major"}, "inputs": ["x"], "outputs": []}"#,
    ));
    assert!(
        e.contains(
            "q [attribute]: attribute \"group_size\" of op \"quant_fp8_per_token_group\": invalid \
             type: floating point `1.5`, expected u64"
        ),
        "{e}"
    );
}

/// The graph of [`graph`] with `metadata`.
fn with_metadata(metadata: &str) -> String {
    format!(
        r#"{{"format": "arfuse-graph", "version": 1, "symbols": {T},
            "nodes": [{{"id": "x", "op": "input", "outputs": [{{"dtype": "bf16", "shape": ["T", 64]}}]}}],
            "outputs": ["x"], "metadata": {metadata}}}"#
    )
}

#[test]
fn a_recorded_tensor_parallel_size_must_be_a_world_size() {
    for (metadata, problem) in [
        (r#"{"tp": 0}"#, "metadata.tp [attribute]: is 0; "),
        (r#"{"tp": -1}"#, "metadata.tp [attribute]: is -1; "),
        (r#"{"tp": 8.5}"#, "metadata.tp [attribute]: is 8.5; "),
        (
            r#"{"tp": "eight"}"#,
            "metadata.tp [attribute]: is \"eight\"; ",
        ),
        (r#"{"tp": [8]}"#, "metadata.tp [attribute]: is an array; "),
        (
            r#"{"world_size": 4294967296}"#,
            "metadata.world_size [attribute]: is 4294967296; ",
        ),
    ] {
        let e = error(&with_metadata(metadata));
        assert!(e.contains(problem), "{metadata}: {e}");
        assert!(
            e.contains(
                "it records the tensor-parallel size the graph was built for, an integer \
                 from 1 to 4294967295 (remove the key if the graph has none)"
            ),
            "{metadata}: {e}"
        );
    }
    let long = format!(r#"{{"tp": "{}"}}"#, "x".repeat(10_000));
    let e = error(&with_metadata(&long));
    assert!(
        e.contains(&format!("is \"{}\"... (a string); ", "x".repeat(32))),
        "{e}"
    );
    assert!(
        e.len() < 1_000,
        "the message stays short: {} bytes",
        e.len()
    );
}

#[test]
fn the_two_tensor_parallel_keys_must_agree() {
    let e = error(&with_metadata(r#"{"world_size": 4, "tp": 8}"#));
    assert!(
        e.contains(
            "metadata [attribute]: world_size = 4 and tp = 8 disagree: a graph has one \
             tensor-parallel size"
        ),
        "{e}"
    );
    for (ok, recorded) in [
        (r#"{"world_size": 8, "tp": 8}"#, Some(8)),
        (r#"{"tp": 1}"#, Some(1)),
        (r#"{"model": "x", "tp_note": 0}"#, None),
        (r#""free-form text""#, None),
    ] {
        let g = Graph::from_json_str(&with_metadata(ok)).expect(ok);
        assert_eq!(g.recorded_world_size(), recorded, "{ok}");
    }
}

/// A `fused_add_rms_norm` of `x : bf16[T, 64]` with residual `r` of type `r_type`.
fn fused_add_with_residual(r_type: &str) -> String {
    graph(
        T,
        &format!(
            r#"{WEIGHT}, {{"id": "r", "op": "input", "outputs": [{r_type}]}},
               {{"id": "n", "op": "fused_add_rms_norm", "attrs": {{"eps": 1e-6}},
                 "inputs": ["x", "r", "w"],
                 "outputs": [{{"dtype": "bf16", "shape": ["T", 64]}}, {{"dtype": "bf16", "shape": ["T", 64]}}]}}"#
        ),
    )
}

#[test]
fn a_residual_of_another_dtype_is_a_dtype_problem_and_of_another_shape_a_shape_one() {
    let e = error(&fused_add_with_residual(
        r#"{"dtype": "f16", "shape": ["T", 64]}"#,
    ));
    assert!(
        e.contains("n [dtype]: residual f16[T,64] differs from the input bf16[T,64]"),
        "{e}"
    );
    let e = error(&fused_add_with_residual(
        r#"{"dtype": "bf16", "shape": ["T", 32]}"#,
    ));
    assert!(
        e.contains("n [shape]: residual bf16[T,32] differs from the input bf16[T,64]"),
        "{e}"
    );
}
