//! What an import may be told about the graph that the file itself does not say.

use std::fmt;
use std::str::FromStr;

/// Options of [`crate::load_any_with`] and [`crate::torch_export::import_with`].
///
/// The default reads every file as the format documents: only the collective spellings
/// the importer knows become `all_reduce` (`docs/torch-export.md`).
///
/// Non-exhaustive: start from [`ImportOptions::default`] and use the `with_*` methods.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportOptions {
    /// A framework's own all-reduce ops (for example vLLM's `vllm.all_reduce`), imported
    /// as a sum all-reduce over their group. Opt-in by name: arfuse cannot know what a
    /// custom op computes, so naming it here asserts that it sums its first tensor
    /// argument over the group's ranks and returns the result.
    pub all_reduce_ops: Vec<CustomAllReduce>,
    /// Ops to keep opaque whatever the importer knows of them, each with the reason the
    /// notes give: `(target, reason)`, the target matched as in
    /// [`CustomAllReduce::matches`] (vLLM's CPU `_C.fused_add_rms_norm`, whose kernel
    /// computes neither of the fused norm forms, for instance).
    pub opaque_ops: Vec<(String, String)>,
}

impl ImportOptions {
    /// With one more custom all-reduce op.
    pub fn with_all_reduce_op(mut self, op: CustomAllReduce) -> Self {
        self.all_reduce_ops.push(op);
        self
    }

    /// With one more op kept opaque, for `reason`.
    pub fn with_opaque_op(mut self, target: impl Into<String>, reason: impl Into<String>) -> Self {
        self.opaque_ops.push((target.into(), reason.into()));
        self
    }

    /// Why `target` (without `torch.ops.`) is to be kept opaque, if the options say so.
    pub fn opaque_reason(&self, target: &str) -> Option<&str> {
        self.opaque_ops
            .iter()
            .find(|(t, _)| CustomAllReduce::new(t.as_str()).matches(target))
            .map(|(_, why)| why.as_str())
    }

    /// The custom all-reduce a target (without `torch.ops.`) names, if any.
    pub fn custom_all_reduce(&self, target: &str) -> Option<&CustomAllReduce> {
        self.all_reduce_ops.iter().find(|c| c.matches(target))
    }
}

/// One framework all-reduce op named in [`ImportOptions::all_reduce_ops`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CustomAllReduce {
    /// The op without `torch.ops.`: `namespace.name` (every overload) or
    /// `namespace.name.overload` (that one), e.g. `vllm.all_reduce`.
    pub target: String,
    /// The process group its all-reduces use. `None`: the op's own string argument
    /// `group_name` (vLLM's `all_reduce(Tensor tensor, str group_name)`) or `group`; a
    /// node with neither stays opaque, with a note.
    pub group: Option<String>,
}

impl CustomAllReduce {
    /// An op whose group comes from its `group_name` argument.
    pub fn new(target: impl Into<String>) -> CustomAllReduce {
        CustomAllReduce {
            target: target.into(),
            group: None,
        }
    }

    /// With the group given.
    pub fn with_group(mut self, group: impl Into<String>) -> CustomAllReduce {
        self.group = Some(group.into());
        self
    }

    /// Whether `target` (without `torch.ops.`) is this op: equal, or this op with an
    /// overload suffix (`vllm.all_reduce` matches `vllm.all_reduce.default`).
    pub fn matches(&self, target: &str) -> bool {
        let want = self
            .target
            .strip_prefix("torch.ops.")
            .unwrap_or(&self.target);
        target == want
            || target
                .strip_prefix(want)
                .and_then(|rest| rest.strip_prefix('.'))
                .is_some_and(|overload| !overload.is_empty() && !overload.contains('.'))
    }
}

impl fmt::Display for CustomAllReduce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.group {
            Some(g) => write!(f, "{}={g}", self.target),
            None => f.write_str(&self.target),
        }
    }
}

/// Why a `NAME[=GROUP]` spelling of a custom all-reduce was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("custom all-reduce op {spec:?}: {message}")]
pub struct CustomAllReduceParseError {
    /// What was given.
    pub spec: String,
    /// What is wrong with it.
    pub message: String,
}

impl FromStr for CustomAllReduce {
    type Err = CustomAllReduceParseError;

    /// `NAME` or `NAME=GROUP` (`vllm.all_reduce`, `vllm.all_reduce=tp`); NAME has a
    /// namespace and an op name (`ns.op`, optionally `.overload`), made of ASCII
    /// letters, digits and `_`, optionally prefixed with `torch.ops.`; GROUP is not
    /// empty.
    fn from_str(spec: &str) -> Result<CustomAllReduce, CustomAllReduceParseError> {
        let err = |message: &str| CustomAllReduceParseError {
            spec: spec.to_string(),
            message: message.to_string(),
        };
        let (name, group) = match spec.split_once('=') {
            Some((n, g)) => (n.trim(), Some(g.trim())),
            None => (spec.trim(), None),
        };
        let name = name.strip_prefix("torch.ops.").unwrap_or(name);
        let parts: Vec<&str> = name.split('.').collect();
        let ok_part =
            |p: &str| !p.is_empty() && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !(2..=3).contains(&parts.len()) || !parts.iter().all(|p| ok_part(p)) {
            return Err(err(
                "expected NAMESPACE.OP or NAMESPACE.OP.OVERLOAD (e.g. vllm.all_reduce), \
                 optionally followed by =GROUP",
            ));
        }
        if matches!(parts[0], "aten" | "prims") {
            return Err(err(
                "aten and prims ops are never collectives; name the framework's own op",
            ));
        }
        match group {
            Some("") => Err(err("the group after `=` is empty")),
            Some(g) => Ok(CustomAllReduce::new(name).with_group(g)),
            None => Ok(CustomAllReduce::new(name)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_names_and_groups() {
        let c: CustomAllReduce = "vllm.all_reduce".parse().unwrap();
        assert_eq!(c, CustomAllReduce::new("vllm.all_reduce"));
        let c: CustomAllReduce = "torch.ops.vllm.all_reduce=tp".parse().unwrap();
        assert_eq!(c.target, "vllm.all_reduce");
        assert_eq!(c.group.as_deref(), Some("tp"));
        assert_eq!(c.to_string(), "vllm.all_reduce=tp");
        for bad in [
            "all_reduce",
            "vllm.",
            "a.b.c.d",
            "vllm.all reduce",
            "x.y=",
            "aten.add",
        ] {
            assert!(bad.parse::<CustomAllReduce>().is_err(), "{bad}");
        }
    }

    #[test]
    fn matches_overloads_of_the_named_op_only() {
        let c = CustomAllReduce::new("vllm.all_reduce");
        assert!(c.matches("vllm.all_reduce"));
        assert!(c.matches("vllm.all_reduce.default"));
        assert!(!c.matches("vllm.all_reduce_out.default"));
        assert!(!c.matches("vllm.all_reduce.default.x"));
        assert!(!c.matches("vllm.all_gather.default"));
        let exact = CustomAllReduce::new("vllm.all_reduce.default");
        assert!(exact.matches("vllm.all_reduce.default"));
        assert!(!exact.matches("vllm.all_reduce.out"));
    }
}
