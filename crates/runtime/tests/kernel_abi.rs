//! The kernel sources hold no second copy of the ABI (`arfuse-abi`): every number the
//! ABI owns reaches them as a `-D` define (`arfuse_abi::kernel_defines`), so
//! - no source `#define`s a name the ABI defines;
//! - no source spells, outside comments, a literal with the value of an ABI limit that
//!   is a size (16, 128, 256, 512, 1024, 65536), except in the few places listed below
//!   where the number means something else (bit shifts of a 16-bit half, the warp
//!   shuffle's offsets, the swizzled tile's inner 32-row x 16-byte layout);
//! - the Lamport buffers rotate by the ABI's count (no `% 3`);
//! - every name the sources use from the ABI is one the ABI defines.

use arfuse_abi::kernel_defines;

/// Every kernel source, with its file name (all that NVRTC or the host compiler get).
const SOURCES: [(&str, &str); 6] = [
    (
        "arfuse_common.cuh",
        include_str!("../../../kernels/arfuse_common.cuh"),
    ),
    (
        "allreduce_fused.cu",
        include_str!("../../../kernels/allreduce_fused.cu"),
    ),
    ("unfused.cu", include_str!("../../../kernels/unfused.cu")),
    (
        "virtual_allreduce.cu",
        include_str!("../../../kernels/virtual_allreduce.cu"),
    ),
    (
        "arfuse_host.h",
        include_str!("../../../kernels/arfuse_host.h"),
    ),
    (
        "arfuse_host_probe.cpp",
        include_str!("../../../kernels/arfuse_host_probe.cpp"),
    ),
];

/// Values of the ABI's size limits that a kernel must not spell as a literal.
fn owned_values() -> Vec<u64> {
    let mut v = vec![
        arfuse_abi::VECTOR_BYTES,
        arfuse_abi::NVFP4_BLOCK,
        u64::from(arfuse_abi::MAX_RANKS),
        arfuse_abi::FP8_GROUP_SIZE,
        arfuse_abi::NVFP4_TILE_ROWS,
        arfuse_abi::NVFP4_TILE_ROWS * arfuse_abi::NVFP4_TILE_COLS,
        arfuse_abi::MIN_BLOCK_THREADS,
        arfuse_abi::MAX_BLOCK_THREADS,
        arfuse_abi::MAX_ROW_BYTES,
        arfuse_abi::STATE_BYTES,
        arfuse_abi::BUFFER_ALIGN_BYTES,
    ];
    v.sort_unstable();
    v.dedup();
    v
}

/// Lines (trimmed, comments removed) where such a value means something else, each
/// with the reason.
const ALLOWED: &[(&str, &str)] = &[
    // The high half of a 32-bit word holding two 16-bit values.
    ("<< 16", "bit shift of a packed 16-bit half"),
    (">> 16", "bit shift of a packed 16-bit half"),
    ("o = 16", "butterfly offsets of a 32-lane warp shuffle"),
    (
        "(u64)(t % 32) * 16u",
        "inside a swizzled NVFP4 tile: 32-row groups of 16 bytes (cuBLAS layout)",
    ),
    // The host build's stand-ins for CUDA (arfuse_host.h): CUDA's own numbers.
    ("alignas(16) uint4", "CUDA's uint4 is 16-byte aligned"),
    (
        "n64 > 1024",
        "CUDA's limit of threads per block, which the host launcher keeps",
    ),
    ("char msg[256]", "an error message buffer"),
];

/// The text of a source without `//` and `/* */` comments.
fn code_of(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    while !rest.is_empty() {
        let line_c = rest.find("//");
        let block_c = rest.find("/*");
        match (line_c, block_c) {
            (Some(l), b) if b.map_or(true, |b| l < b) => {
                out.push_str(&rest[..l]);
                rest = &rest[l..];
                let end = rest.find('\n').unwrap_or(rest.len());
                rest = &rest[end..];
            }
            (_, Some(b)) => {
                out.push_str(&rest[..b]);
                rest = &rest[b + 2..];
                let end = rest.find("*/").map_or(rest.len(), |e| e + 2);
                // Keep the line count.
                out.extend(rest[..end].chars().filter(|&c| c == '\n'));
                rest = &rest[end..];
            }
            _ => {
                out.push_str(rest);
                rest = "";
            }
        }
    }
    out
}

/// Decimal integer literals of a line (with their C suffixes), as values; hex literals,
/// floats and digits inside identifiers are not counted.
fn decimal_literals(line: &str) -> Vec<u64> {
    let b = line.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        // String literals (#error messages) hold no code.
        if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            continue;
        }
        let starts = b[i].is_ascii_digit() && (i == 0 || !is_ident(b[i - 1]) && b[i - 1] != b'.');
        if !starts {
            i += 1;
            continue;
        }
        let mut j = i;
        while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'.' || b[j] == b'_') {
            j += 1;
        }
        let tok = &line[i..j];
        let digits = tok.trim_end_matches(['u', 'U', 'l', 'L']);
        if !tok.starts_with("0x") && !tok.starts_with("0X") {
            if let Ok(v) = digits.parse::<u64>() {
                out.push(v);
            }
        }
        i = j;
    }
    out
}

/// Whether a line takes a value modulo a literal 3 (the Lamport buffer count).
fn lamport_modulo(line: &str) -> bool {
    line.match_indices("% 3").any(|(i, m)| {
        !line[i + m.len()..]
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_digit())
    })
}

fn is_ident(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// Every `ARF_*` identifier of a text.
fn arf_names(code: &str) -> Vec<&str> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(k) = code[i..].find("ARF_") {
        let s = i + k;
        if s > 0 && is_ident(b[s - 1]) {
            i = s + 4;
            continue;
        }
        let mut e = s;
        while e < b.len() && is_ident(b[e]) {
            e += 1;
        }
        out.push(&code[s..e]);
        i = e;
    }
    out
}

#[test]
fn the_kernels_define_none_of_the_abis_names() {
    let mut bad = Vec::new();
    for (file, src) in SOURCES {
        let code = code_of(src);
        for line in code.lines() {
            let t = line.trim();
            let Some(rest) = t.strip_prefix("#define ") else {
                continue;
            };
            let name = rest.split_whitespace().next().unwrap_or("");
            let name = name.split('(').next().unwrap_or(name);
            if kernel_defines().iter().any(|d| d.name == name) {
                bad.push(format!("{file}: {t}"));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "kernels define ABI names:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_kernels_spell_no_literal_the_abi_owns() {
    let owned = owned_values();
    let mut bad = Vec::new();
    for (file, src) in SOURCES {
        for (n, line) in code_of(src).lines().enumerate() {
            let t = line.trim();
            let hits: Vec<u64> = decimal_literals(t)
                .into_iter()
                .filter(|v| owned.contains(v))
                .collect();
            if hits.is_empty() {
                continue;
            }
            // Every hit must be explained by an allowed pattern on the line: count the
            // owned literals the allowed patterns account for.
            let explained: usize = ALLOWED.iter().map(|(pat, _)| t.matches(pat).count()).sum();
            if hits.len() > explained {
                bad.push(format!("{file}:{}: {t}", n + 1));
            }
            if lamport_modulo(t) {
                bad.push(format!("{file}:{}: {t} (use ARF_NBUF)", n + 1));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "kernel lines spell an ABI number (use the ABI's define):\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_abi_name_the_kernels_use_is_defined() {
    let defined: Vec<&str> = kernel_defines().iter().map(|d| d.name).collect();
    // Names the sources or the variant selection define themselves.
    let own = [
        "ARF_DTYPE",
        "ARF_RESIDUAL",
        "ARF_NORM",
        "ARF_QUANT",
        "ARF_STRATEGY",
        "ARF_W",
        // Switches of the host build (arfuse_host.h), set by the host compiler's flags.
        "ARF_HOST",
        "ARF_HOST_UCONTEXT",
    ];
    // Every macro the sources define themselves (ARF_EB, ARF_VEC, ARF_NBUF, ...).
    let mut local = Vec::new();
    for (_, src) in SOURCES {
        for l in code_of(src).lines() {
            if let Some(r) = l.trim().strip_prefix("#define ") {
                let name = r.split(|c: char| c == ' ' || c == '(').next().unwrap_or("");
                local.push(name.to_string());
            }
        }
    }
    let mut missing = Vec::new();
    for (file, src) in SOURCES {
        let code = code_of(src);
        for name in arf_names(&code) {
            // Functions, types and constants of the sources (lower-case or CamelCase
            // after the prefix) are C++ names, not macros.
            let macro_name = !name[4..].chars().any(|c| c.is_ascii_lowercase());
            let known =
                defined.contains(&name) || own.contains(&name) || local.iter().any(|l| l == name);
            let entry = format!("{file}: {name}");
            if macro_name && !known && !missing.contains(&entry) {
                missing.push(entry);
            }
        }
    }
    assert!(missing.is_empty(), "ARF_ names nobody defines: {missing:?}");
}

#[test]
fn the_scanner_sees_what_it_must() {
    // The checks above can fail: a literal group size, a literal world size list and
    // a stray define are all found.
    let owned = owned_values();
    let lits = |l: &str| -> Vec<u64> {
        decimal_literals(l)
            .into_iter()
            .filter(|v| owned.contains(v))
            .collect()
    };
    assert_eq!(lits("const int groups = p.H / 128;"), vec![128]);
    assert_eq!(lits("#if ARF_W != 2 && ARF_W != 16"), vec![16]);
    assert_eq!(lits("__launch_bounds__(1024)"), vec![1024]);
    assert!(lits("x = 0x80008000u; y = 1e-10f; ARF_Q16").is_empty());
    assert_eq!(code_of("a // 128\nb /* 16 */ c"), "a \nb  c");
    assert_eq!(
        arf_names("x ARF_MAX_RANKS + ARF_NBUF;"),
        ["ARF_MAX_RANKS", "ARF_NBUF"]
    );
}
