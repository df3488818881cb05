//! Targets: presets and TOML files, the one a run is given or a graph chooses, and
//! `--list-targets`.

use crate::LowerArgs;
use anyhow::{Context, Result};
use arfuse::advanced::policy::{self, PRESETS};
use arfuse::{Graph, Target};
use std::path::Path;

/// The target preset of a run given neither a graph nor a target, and of a graph with
/// no all-reduce (nothing in it depends on the machine).
pub const DEFAULT_TARGET: &str = "h200-sxm-x8";

/// `--list-targets`: one row per preset with its machine and the backend the policy
/// resolves it to. `driver-multicast` is what the preset says every GPU's driver reports
/// (`multicast_all_ranks`), which the mnnvl backend needs but which does not decide it.
pub fn targets_table() -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    table.set_header("preset GPU SM W nodes interconnect driver-multicast backend".split(' '));
    for p in PRESETS {
        let backend = match policy::resolve_backend(&p.target()) {
            Ok(d) => d
                .backend()
                .map_or("none (no fusion)".into(), |b| b.to_string()),
            Err(e) => format!("error: {e}"),
        };
        let multicast = if p.multicast_all_ranks { "yes" } else { "no" };
        let (sm, w, nodes) = (p.sm, p.world_size, p.group_nodes);
        let cells = [p.name.into(), p.gpu.into(), sm.to_string(), w.to_string()];
        let more = [
            nodes.to_string(),
            p.interconnect.to_string(),
            multicast.into(),
            backend,
        ];
        table.add_row(cells.into_iter().chain(more));
    }
    // Every line starts with one cell's padding; none needs trailing spaces.
    table.lines().map(|l| format!("{}\n", l.trim())).collect()
}

/// True when `spec` names a TOML file rather than a preset: a preset's name is always
/// the preset; another name is a file when it ends in `.toml` or a file of that name is
/// there (else it is an unknown preset).
pub(crate) fn is_target_file(spec: &str) -> bool {
    let p = Path::new(spec);
    let file = p.extension().is_some_and(|x| x == "toml") || p.exists();
    file && !Target::preset_names().contains(&spec)
}

/// The name a target goes by in reports and default output names: the preset's name or
/// the target file's stem.
pub(crate) fn target_name(spec: &str) -> String {
    match Path::new(spec).file_stem() {
        Some(stem) if is_target_file(spec) => stem.to_string_lossy().into_owned(),
        _ => spec.to_string(),
    }
}

/// The target `spec` names, and its name ([`target_name`]).
pub(crate) fn load_target(spec: &str) -> Result<(Target, String)> {
    let target = if is_target_file(spec) {
        let text = crate::inputs::read_small_text(Path::new(spec));
        let target = text.and_then(|t| Ok(Target::from_toml_str(&t)?));
        target.with_context(|| format!("target file {spec}"))?
    } else {
        Target::preset(spec)?
    };
    Ok((target, target_name(spec)))
}

/// Loads `spec` and checks that the policy can decide its backend.
pub(crate) fn check_target(spec: &str) -> Result<()> {
    policy::resolve_backend(&load_target(spec)?.0).context("the target")?;
    Ok(())
}

/// The target every graph of the run is lowered for, when one is given: `--target`,
/// `--world-size`'s preset (said in a note), or with no arguments at all
/// [`DEFAULT_TARGET`]; checked, with `--shared-hidden`, before any graph is read.
/// `None`: each graph's own (its options file, or the TP size it records).
pub(crate) fn given_target(default_graph: bool, args: &LowerArgs) -> Result<Option<String>> {
    for &h in &args.shared_hidden {
        // bf16 has the smallest elements: a size refused at bf16 is refused at any dtype.
        let checked = policy::check_hidden(h, policy::ActDtype::Bf16);
        checked.with_context(|| format!("--shared-hidden {h}"))?;
    }
    let target = match (args.world_size, &args.target) {
        (Some(w), _) => {
            let (name, note) = preset_for(w, &format!("--world-size {w}"))?;
            eprintln!("note: {note}");
            Some(name)
        }
        (None, None) if default_graph => Some(DEFAULT_TARGET.to_string()),
        (None, t) => t.clone(),
    };
    if let Some(t) = &target {
        // The user's --target is named; a preset --world-size or the default chose is not.
        match &args.target {
            Some(_) => check_target(t).with_context(|| format!("--target {t}"))?,
            None => check_target(t)?,
        }
    }
    Ok(target)
}

/// The preset for tensor-parallel size `w` and the note saying which and what else has
/// W ranks; `how` says where W came from (`--world-size 8`, `recorded tp = 8`).
pub(crate) fn preset_for(w: u32, how: &str) -> Result<(String, String)> {
    let p = policy::preset_for_world_size(w).with_context(|| how.to_string())?;
    let (gpu, about) = (p.gpu, p.description);
    let mut note = format!("{how}: planned for {} ({gpu} x{w}, {about})", p.name);
    let others = policy::presets_with_world_size(w).filter(|o| o.name != p.name);
    let others: Vec<&str> = others.map(|o| o.name).collect();
    if !others.is_empty() {
        let others = others.join(", ");
        note += &format!("; other presets with world_size {w}: {others} (pass --target NAME)");
    }
    Ok((p.name.to_string(), note))
}

/// The target of a graph given no target and no options file, and a note when the
/// choice deserves one: the preset of the tensor-parallel size it records, or
/// [`DEFAULT_TARGET`] for a graph without all-reduces. `Err`: the graph has all-reduces
/// and records no size, so its world size would be a guess.
pub(crate) fn target_from_graph(graph: &Graph) -> Result<(String, Option<String>), String> {
    if !has_all_reduce(graph) {
        return Ok((DEFAULT_TARGET.to_string(), None));
    }
    let Some(w) = graph.recorded_world_size() else {
        return Err(format!("{NO_TP}, so its world size would be a guess"));
    };
    let fail = |why: String| format!("the graph records tp = {w}: {why}");
    let w32 = u32::try_from(w).map_err(|_| fail("no machine has that".into()))?;
    let (name, note) = preset_for(w32, &format!("recorded tp = {w}"))
        .map_err(|e| fail(e.root_cause().to_string()))?;
    Ok((name, Some(note)))
}

/// What a graph without a recorded tensor-parallel size is told.
const NO_TP: &str = "the graph records no tensor-parallel size (metadata `tp` or \
                     `world_size`; torch.export output has none)";

/// True when the graph has an all-reduce (plain or already fused: its collectives).
fn has_all_reduce(graph: &Graph) -> bool {
    graph.nodes().any(|(_, n)| n.op.is_collective())
}

/// The note for a graph with all-reduces that records no tensor-parallel size: nothing
/// checks that the target's world size is the one it was exported for.
pub(crate) fn assumed_world_size_note(graph: &Graph, t: &Target, name: &str) -> Option<String> {
    if !has_all_reduce(graph) || graph.recorded_world_size().is_some() {
        return None;
    }
    Some(format!(
        "{NO_TP}: planned for {name}'s world_size {}; if the model was exported for another \
         tensor-parallel size, plan for that size (--world-size N, or a --target with that \
         world_size)",
        t.world_size
    ))
}
