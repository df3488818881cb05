//! Bytes -> a well-formed layer stack and a target -> lower + plan + verify, with the
//! pass's invariants asserted. See `arfuse_fuzz::targets::fuzz_structured`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    arfuse_fuzz::targets::fuzz_structured(data);
});
