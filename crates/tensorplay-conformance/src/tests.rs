//! Unit tests of the runner's pure parts: weights, validation, the summary, the comparison.

use std::collections::BTreeMap;

use tensorplay_core::{DType, Tensor};

use crate::case::{cases, validate};
use crate::compare::compare_one;
use crate::summary::{Outcome, summarize};
use crate::{Record, TensorData, tolerance, weight};

fn rec(json: &str) -> Record {
    serde_json::from_str(json).expect("record")
}

#[test]
fn weights_follow_the_format() {
    let w = weight(1, &[2, 4], 2).unwrap().to_vec::<f64>().unwrap();
    assert_eq!(w, vec![2.5, 4.5, 6.5, 8.5, 10.5, 12.5, 14.5, 2.5]);
}

#[test]
fn unknown_fn_op_and_fields_invalidate_the_case() {
    let base = r#"{"case":"c","fn":"FN","world":1,"rank":0,"params":PARAMS,
        "inputs":[{"shape":[1],"data":[1.0]}],"outputs":[{"shape":[1],"data":[1.0]}],
        "grads":[{"shape":[1],"data":[1.0]}]}"#;
    let mk = |f: &str, p: &str| rec(&base.replace("FN", f).replace("PARAMS", p));
    assert!(validate(&mk("all_reduce", r#"{"op":"sum"}"#)).is_ok());
    assert!(
        validate(&mk("all_reduce_v", "{}"))
            .unwrap_err()
            .contains("unknown fn")
    );
    assert!(
        validate(&mk("all_reduce", r#"{"op":"premul_sum"}"#))
            .unwrap_err()
            .contains("unknown op")
    );
    assert!(
        validate(&mk("all_reduce", r#"{"op":"sum","colour":1}"#))
            .unwrap_err()
            .contains("unknown parameter")
    );
    assert!(
        validate(&mk("broadcast", "{}"))
            .unwrap_err()
            .contains("missing parameter src")
    );
    assert!(
        validate(&mk("broadcast", r#"{"src":3}"#))
            .unwrap_err()
            .contains("not a rank")
    );
    let cs = cases(&[mk("nope", "{}")]);
    let s = summarize(&cs, &BTreeMap::new(), &BTreeMap::new());
    assert_eq!((s.passed, s.failed), (0, 1));
    assert!(
        s.lines[0].starts_with("FAIL c rank 0: invalid case: unknown fn"),
        "{}",
        s.lines[0]
    );
}

#[test]
fn one_rank_error_fails_every_record_of_the_case() {
    let r = |rank: usize| {
        rec(&format!(
            r#"{{"case":"c","fn":"all_reduce","world":2,"rank":{rank},"params":{{}},
            "inputs":[{{"shape":[1],"data":[1.0]}}],"outputs":[{{"shape":[1],"data":[2.0]}}],
            "grads":[{{"shape":[1],"data":[3.0]}}]}}"#
        ))
    };
    let cs = cases(&[r(0), r(1)]);
    let mut o = BTreeMap::new();
    o.insert(("c".to_string(), 0), Outcome::Pass);
    o.insert(("c".to_string(), 1), Outcome::Error("boom".into()));
    let s = summarize(&cs, &o, &BTreeMap::new());
    assert_eq!((s.passed, s.failed), (0, 2));
    assert_eq!(s.lines[0], "FAIL c rank 0: rank 1 failed: boom");
    assert_eq!(s.lines[1], "FAIL c rank 1: error: boom");
    // a missing result (crash) fails the case too
    let mut o = BTreeMap::new();
    o.insert(("c".to_string(), 0), Outcome::Pass);
    let s = summarize(&cs, &o, &BTreeMap::new());
    assert_eq!((s.passed, s.failed), (0, 2));
}

#[test]
fn comparison_rule_is_relative_above_one() {
    let want = TensorData {
        shape: vec![3],
        data: vec![0.5, 1e6, -2.0],
    };
    let ok = Tensor::from_vec(vec![0.5 + 5e-10, 1e6 + 5e-4, -2.0], &[3]).unwrap();
    assert_eq!(
        compare_one("outputs[0]", &want, &ok, DType::F64).unwrap(),
        None
    );
    let bad = Tensor::from_vec(vec![0.5, 1e6 + 2e-3, -2.0], &[3]).unwrap();
    assert_eq!(
        compare_one("outputs[0]", &want, &bad, DType::F64)
            .unwrap()
            .unwrap(),
        "outputs[0][1]: expected 1000000 got 1000000.002"
    );
    let nan = Tensor::from_vec(vec![f64::NAN, 1e6, -2.0], &[3]).unwrap();
    assert!(compare_one("x", &want, &nan, DType::F64).unwrap().is_some());
    let shape = Tensor::from_vec(vec![0.5, 1e6, -2.0], &[3, 1]).unwrap();
    assert!(
        compare_one("x", &want, &shape, DType::F64)
            .unwrap()
            .unwrap()
            .contains("shape")
    );
}

#[test]
fn comparison_in_bfloat16_rounds_the_expectation() {
    let want = TensorData {
        shape: vec![2],
        data: vec![1.0 / 3.0, 100.0],
    };
    let t = |v: Vec<f64>| {
        Tensor::from_vec(v, &[2])
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    // the expectations rounded to bfloat16, and values a few steps from them
    let tol = tolerance(DType::BF16);
    assert_eq!(tol, 2.0 * 2f64.powi(-7));
    for (case, got, pass) in [
        ("rounded", vec![1.0 / 3.0, 100.0], true),
        (
            "within the bound",
            vec![1.0 / 3.0 + 0.01, 100.0 - 1.5],
            true,
        ),
        (
            "beyond the bound at 1",
            vec![1.0 / 3.0 + 0.02, 100.0],
            false,
        ),
        ("beyond the bound at 100", vec![1.0 / 3.0, 102.0], false),
    ] {
        let got = compare_one("o", &want, &t(got), DType::BF16).unwrap();
        assert_eq!(got.is_none(), pass, "{case}: {got:?}");
    }
    // a result of another dtype is a difference
    let f32s = Tensor::from_vec(vec![1.0 / 3.0, 100.0], &[2])
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let d = compare_one("o", &want, &f32s, DType::BF16)
        .unwrap()
        .unwrap();
    assert!(d.contains("expected dtype bfloat16 got float32"), "{d}");
}

#[test]
fn a_dtype_that_is_not_floating_is_refused_before_any_run() {
    for dtype in [DType::I64, DType::Bool] {
        let opts = crate::RunOptions {
            dtype,
            ..Default::default()
        };
        let e = crate::run_file(std::path::Path::new("does-not-matter.json"), &opts)
            .err()
            .unwrap_or_else(|| panic!("{dtype} accepted"))
            .to_string();
        assert!(
            e.contains("expected a floating dtype") && e.contains(&dtype.to_string()),
            "{e}"
        );
    }
}
