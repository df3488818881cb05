//! The `.pt2` zip archive that `torch.export.save` writes.
//!
//! Since torch 2.6 the archive follows the "PT2 archive" layout: every member sits
//! under one root folder named after the archive (`<root>/models/model.json` holds the
//! ExportedProgram JSON of the model named `model`; weights, constants and sample
//! inputs live under `<root>/data/`). Earlier releases (2.1 to 2.5) wrote
//! `serialized_exported_program.json` at the top (or under a root folder). This module
//! picks the program member, reads only that one, and bounds what it reads.

use crate::{ImportError, MAX_FILE_BYTES};
use std::io::{Cursor, Read};

/// Most members an archive may list (a `.pt2` of one model has about ten, plus one
/// per weight file when weights are stored one a file).
pub const MAX_ARCHIVE_MEMBERS: usize = 100_000;

/// Which member holds the program: a name ending in `models/<name>.json` (the PT2
/// archive layout; `model.json` preferred when there are several) or, for the older
/// layout, in `serialized_exported_program.json`.
pub fn program_member(names: &[String]) -> Result<String, ImportError> {
    let is_model = |n: &str| {
        let Some(rest) = n.strip_suffix(".json") else {
            return false;
        };
        match rest.rsplit_once('/') {
            Some((dir, file)) => !file.is_empty() && (dir == "models" || dir.ends_with("/models")),
            None => false,
        }
    };
    let models: Vec<&String> = names.iter().filter(|n| is_model(n)).collect();
    let chosen = match models.as_slice() {
        [one] => Some((*one).clone()),
        [] => None,
        many => match many
            .iter()
            .find(|n| n.ends_with("/models/model.json") || n.as_str() == "models/model.json")
        {
            Some(n) => Some((*n).clone()),
            None => {
                return Err(ImportError::Archive {
                    message: format!(
                        "the archive holds {} programs ({}); arfuse imports one model, named \"model\" \
                         (torch.export.save's default)",
                        many.len(),
                        many.iter()
                            .take(5)
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                })
            }
        },
    };
    if let Some(c) = chosen {
        return Ok(c);
    }
    let legacy: Vec<&String> = names
        .iter()
        .filter(|n| {
            n.as_str() == "serialized_exported_program.json"
                || n.ends_with("/serialized_exported_program.json")
        })
        .collect();
    if let [one] = legacy.as_slice() {
        return Ok((*one).clone());
    }
    let shown: Vec<&str> = names.iter().take(10).map(|s| s.as_str()).collect();
    Err(ImportError::Archive {
        message: format!(
            "no program JSON found (looked for <root>/models/<name>.json and serialized_exported_program.json); \
             the archive lists {} member(s): {}{}",
            names.len(),
            shown.join(", "),
            if names.len() > 10 { ", ..." } else { "" }
        ),
    })
}

/// Reads the program JSON out of a `.pt2` archive.
pub fn read_program(bytes: &[u8]) -> Result<Vec<u8>, ImportError> {
    let arch = |e: zip::result::ZipError| ImportError::Archive {
        message: format!("not a readable zip archive: {e}"),
    };
    let mut zip = zip::ZipArchive::new(Cursor::new(bytes)).map_err(arch)?;
    if zip.len() > MAX_ARCHIVE_MEMBERS {
        return Err(ImportError::Limit {
            what: format!(".pt2 archive with {} members", zip.len()),
            limit: MAX_ARCHIVE_MEMBERS,
        });
    }
    let names: Vec<String> = zip.file_names().map(str::to_string).collect();
    let member = program_member(&names)?;
    let what = format!("archive member {member}");
    let file = zip.by_name(&member).map_err(|e| ImportError::Archive {
        message: format!("cannot open {member}: {e}"),
    })?;
    if file.size() > MAX_FILE_BYTES as u64 {
        return Err(ImportError::TooLarge {
            what,
            size: file.size(),
            limit: MAX_FILE_BYTES as u64,
        });
    }
    // The declared size may lie: read at most one byte past the limit.
    let mut out = Vec::with_capacity(file.size().min(MAX_FILE_BYTES as u64) as usize);
    let mut limited = file.take(MAX_FILE_BYTES as u64 + 1);
    limited
        .read_to_end(&mut out)
        .map_err(|e| ImportError::Archive {
            message: format!("cannot read {member}: {e}"),
        })?;
    if out.len() > MAX_FILE_BYTES {
        return Err(ImportError::TooLarge {
            what,
            size: out.len() as u64,
            limit: MAX_FILE_BYTES as u64,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::program_member;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn picks_the_program_member() {
        let n = names(&[
            "llama/archive_format",
            "llama/models/model.json",
            "llama/data/weights/model_weights_config.json",
        ]);
        assert_eq!(program_member(&n).unwrap(), "llama/models/model.json");
        let n = names(&["models/model.json"]);
        assert_eq!(program_member(&n).unwrap(), "models/model.json");
        let n = names(&["x/models/a.json", "x/models/model.json"]);
        assert_eq!(program_member(&n).unwrap(), "x/models/model.json");
        let n = names(&["serialized_exported_program.json", "version"]);
        assert_eq!(
            program_member(&n).unwrap(),
            "serialized_exported_program.json"
        );
        assert!(program_member(&names(&["x/models/a.json", "x/models/b.json"])).is_err());
        let e = program_member(&names(&["a.txt"])).unwrap_err().to_string();
        assert!(e.contains("no program JSON"), "{e}");
    }
}
