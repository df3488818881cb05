fn main() {
    let args: Vec<String> = std::env::args().collect();
    let g = arfuse::Graph::from_json_slice(&std::fs::read(&args[1]).unwrap()).unwrap();
    let t = arfuse::Target::preset(&args[2]).unwrap();
    let l = arfuse::lower(&g, &t).unwrap();
    let s = l.sites.iter().find(|s| s.fused_node == args[3]).unwrap();
    println!("{:#?}", s);
    let c = arfuse::reference::cut_site(&g, &l.graph, s).unwrap();
    println!("ORIGINAL\n{}\nLOWERED\n{}", c.original.canonical_text(), c.lowered.canonical_text());
}
