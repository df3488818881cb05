//! Compiles one variant (by name substring) for one arch and prints ptxas stats.
//! Usage: cargo run -p arfuse-runtime --example compile_one -- <name> <sm_90a|sm_100a>
use arfuse_runtime::variants::{self, Arch};
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let pat = args.get(1).cloned().unwrap_or_default();
    let arch = if args.get(2).map(String::as_str) == Some("sm_100a") {
        Arch::Sm100a
    } else {
        Arch::Sm90a
    };
    for v in variants::all() {
        if !v.name().contains(&pat) || !v.archs().contains(&arch) {
            continue;
        }
        let t = std::time::Instant::now();
        match variants::compile(&v, arch, true) {
            Ok(c) => println!(
                "{} {}: ok {:.2}s ptx {} B cubin {} B {:?}",
                v,
                arch.name(),
                t.elapsed().as_secs_f64(),
                c.ptx.len(),
                c.cubin.len(),
                arfuse_runtime::nvrtc::PtxasStats::parse(&c.log)
            ),
            Err(e) => {
                println!("{v}: {e}");
            }
        }
    }
}
