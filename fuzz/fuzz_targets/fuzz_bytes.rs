//! Arbitrary bytes -> load_any -> validate -> lower (two presets) -> verify; the same
//! bytes as a target TOML -> plan -> verify. See `arfuse_fuzz::targets::fuzz_bytes`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    arfuse_fuzz::targets::fuzz_bytes(data);
});
