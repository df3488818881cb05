//! Registers, spills and SASS instruction counts of every kernel variant, as NVRTC
//! (with ptxas) builds them for sm_90a and sm_100a: one CSV line per variant and
//! architecture, to compare kernel changes before and after. Needs NVRTC (the
//! `nvidia-cuda-nvrtc-cu12` wheel `cargo xtask test` installs); no GPU.
//!
//! Run: `cargo run --release -p arfuse-runtime --example kernel_stats [FILTER] > stats.csv`
//! (FILTER: only the variants whose name contains it, e.g. `oneshot_w8_bf16`).
//!
//! The instruction count is the size of the kernel's `.text.<entry>` section of the
//! cubin divided by 16 (every SASS instruction is 16 bytes on SM 70 and later).

use arfuse_runtime::nvrtc::PtxasStats;
use arfuse_runtime::variants;

/// Bytes of the `.text.*` section of an ELF64 little-endian cubin, or `None`.
fn text_bytes(elf: &[u8]) -> Option<u64> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?));
    if elf.get(..4)? != b"\x7fELF" || *elf.get(4)? != 2 {
        return None;
    }
    let shoff = u64_at(0x28)? as usize;
    let shentsize = u16_at(0x3a)? as usize;
    let shnum = u16_at(0x3c)? as usize;
    let shstrndx = u16_at(0x3e)? as usize;
    let section = |i: usize| shoff + i * shentsize;
    let strtab = u64_at(section(shstrndx) + 0x18)? as usize;
    let mut total = 0u64;
    for i in 0..shnum {
        let s = section(i);
        let name_off = u32_at(s)? as usize;
        let name = elf.get(strtab + name_off..)?;
        let end = name.iter().position(|&b| b == 0)?;
        if name[..end].starts_with(b".text.") {
            total += u64_at(s + 0x20)?;
        }
    }
    Some(total)
}

fn main() {
    println!("variant,arch,registers,spill_stores,spill_loads,stack_frame,sass_instructions");
    let filter = std::env::args().nth(1).unwrap_or_default();
    let mut failed = 0;
    for v in variants::all()
        .into_iter()
        .filter(|v| v.to_string().contains(&filter))
    {
        for arch in v.archs() {
            match variants::compile(&v, arch, true) {
                Ok(c) => {
                    let s = PtxasStats::parse(&c.log).unwrap_or_default();
                    let n = text_bytes(&c.cubin).map_or(0, |b| b / 16);
                    println!(
                        "{v},{},{},{},{},{},{n}",
                        arch.name(),
                        s.registers,
                        s.spill_stores,
                        s.spill_loads,
                        s.stack_frame
                    );
                }
                Err(e) => {
                    eprintln!("{v} {}: {e}", arch.name());
                    failed += 1;
                }
            }
        }
    }
    if failed > 0 {
        std::process::exit(1);
    }
}
