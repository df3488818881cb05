//! `Graph::validate_nodes` checks exactly the nodes it is given: on those it finds what
//! `Graph::validate` finds, and nothing about the others.

use arfuse_ir::{DType, Dim, Graph, InputKind, Node, Op, ProblemKind, TensorType, Value};

fn t(dims: &[u64]) -> TensorType {
    TensorType::new(
        DType::Bf16,
        dims.iter().map(|&d| Dim::constant(d)).collect(),
    )
}

fn node(g: &mut Graph, id: &str, op: Op, inputs: Vec<Value>, out: TensorType) -> Value {
    let n = g
        .add_node(Node {
            id: id.into(),
            op,
            inputs,
            outputs: vec![out],
            module: None,
        })
        .unwrap();
    Value::new(n, 0)
}

#[test]
fn validate_nodes_finds_what_validate_finds_on_the_nodes_given() {
    let mut g = Graph::new();
    let input = Op::Input {
        kind: InputKind::Activation,
    };
    let a = node(&mut g, "a", input.clone(), vec![], t(&[4, 64]));
    let b = node(&mut g, "b", input, vec![], t(&[4, 64]));
    let good = node(&mut g, "good", Op::Add, vec![a, b], t(&[4, 64]));
    // Declares a shape the add does not produce.
    let bad = node(&mut g, "bad", Op::Add, vec![a, good], t(&[4, 32]));
    g.set_outputs(vec![bad]).unwrap();

    let all = g.validate().unwrap_err();
    assert_eq!(all.list.len(), 1);
    assert_eq!(all.list[0].location, "bad");
    assert_eq!(all.list[0].kind, ProblemKind::Shape);

    let some = g.validate_nodes([bad.node]).unwrap_err();
    assert_eq!(some.to_string(), all.to_string());
    assert!(g.validate_nodes([a.node, b.node, good.node]).is_ok());
    assert!(g.validate_nodes([]).is_ok());
}

#[test]
fn broadcasts_to_agrees_with_broadcast() {
    use arfuse_ir::{broadcast, broadcasts_to, Shape};
    let dims = [
        Dim::constant(1),
        Dim::constant(4),
        Dim::constant(64),
        Dim::symbol("T"),
        Dim::parse("B*S").unwrap(),
    ];
    // Every shape of rank 0 to 2 over those dims.
    let mut shapes = vec![Shape(vec![])];
    for a in &dims {
        shapes.push(Shape(vec![a.clone()]));
        for b in &dims {
            shapes.push(Shape(vec![a.clone(), b.clone()]));
        }
    }
    // Every pair that broadcasts has its result among the shapes (rank at most 2, the
    // same dims): broadcasts_to holds for exactly that one shape of the list.
    let (mut broadcasting, mut held) = (0, 0);
    for a in &shapes {
        for b in &shapes {
            let want = broadcast(a, b);
            broadcasting += usize::from(want.is_some());
            for out in &shapes {
                let holds = broadcasts_to(a, b, out);
                assert_eq!(holds, want.as_ref() == Some(out), "{a} {b} {out}");
                held += usize::from(holds);
            }
        }
    }
    assert_eq!(held, broadcasting);
    assert!(broadcasting > shapes.len(), "{broadcasting}");
}
