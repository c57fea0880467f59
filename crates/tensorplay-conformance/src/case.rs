//! Cases: the records of one label grouped, their parameters read and checked (unknown `fn`,
//! `op` or parameter, malformed tensors, records that disagree).

use tensorplay_collectives::ReduceOp;

use crate::Record;

/// A case: its label, its records (file order) and whether it can run.
pub(crate) struct Case {
    pub(crate) label: String,
    pub(crate) world: usize,
    pub(crate) members: Vec<usize>,
    pub(crate) records: Vec<Record>,
    pub(crate) invalid: Option<String>,
}

/// The functions a record may test.
const FNS: &[&str] = &[
    "broadcast",
    "reduce",
    "all_reduce",
    "gather",
    "scatter",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
];

pub(crate) fn parse_op(v: Option<&serde_json::Value>) -> Result<ReduceOp, String> {
    match v {
        None => Ok(ReduceOp::Sum),
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "sum" => Ok(ReduceOp::Sum),
            "avg" => Ok(ReduceOp::Avg),
            "max" => Ok(ReduceOp::Max),
            "min" => Ok(ReduceOp::Min),
            "product" => Ok(ReduceOp::Product),
            other => Err(format!("unknown op {other:?}")),
        },
        Some(other) => Err(format!("op must be a string, got {other}")),
    }
}

pub(crate) fn param_rank(r: &Record, key: &str) -> Result<Option<usize>, String> {
    match r.params.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|u| Some(u as usize))
            .ok_or_else(|| format!("{key} must be a non-negative integer, got {v}")),
    }
}

pub(crate) fn param_splits(r: &Record, key: &str) -> Result<Option<Vec<usize>>, String> {
    match r.params.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|u| u as usize)
                    .ok_or_else(|| format!("{key} must hold non-negative integers, got {v}"))
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(v) => Err(format!("{key} must be a list, got {v}")),
    }
}

/// Checks one record's fields; `Err` names what is unknown or malformed.
pub(crate) fn validate(r: &Record) -> Result<(), String> {
    if !FNS.contains(&r.func.as_str()) {
        return Err(format!("unknown fn {:?}", r.func));
    }
    let allowed: &[&str] = match r.func.as_str() {
        "broadcast" | "scatter" => &["src"],
        "gather" => &["dst"],
        "reduce" => &["dst", "op"],
        "all_reduce" | "reduce_scatter" => &["op"],
        "all_to_all_single" => &["input_split_sizes", "output_split_sizes"],
        _ => &[],
    };
    for k in r.params.keys() {
        if !allowed.contains(&k.as_str()) {
            return Err(format!("unknown parameter {k:?} for {}", r.func));
        }
    }
    parse_op(r.params.get("op"))?;
    for key in ["src", "dst"] {
        if allowed.contains(&key) {
            let v = param_rank(r, key)?.ok_or_else(|| format!("missing parameter {key}"))?;
            if v >= r.world {
                return Err(format!("{key} {v} is not a rank of a world of {}", r.world));
            }
        }
    }
    param_splits(r, "input_split_sizes")?;
    param_splits(r, "output_split_sizes")?;
    if r.world == 0 || r.rank >= r.world {
        return Err(format!("rank {} in a world of {}", r.rank, r.world));
    }
    for (what, list) in [
        ("inputs", &r.inputs),
        ("outputs", &r.outputs),
        ("grads", &r.grads),
    ] {
        for (i, t) in list.iter().enumerate() {
            let n: usize = t.shape.iter().product();
            if n != t.data.len() {
                return Err(format!(
                    "{what}[{i}] has shape {:?} but {} values",
                    t.shape,
                    t.data.len()
                ));
            }
        }
    }
    if r.inputs.is_empty() {
        return Err("no inputs".into());
    }
    if r.grads.len() != r.inputs.len() {
        return Err(format!(
            "{} grads for {} inputs",
            r.grads.len(),
            r.inputs.len()
        ));
    }
    Ok(())
}

/// Groups records into cases in the order each label first appears, and validates them.
pub(crate) fn cases(records: &[Record]) -> Vec<Case> {
    let mut out: Vec<Case> = vec![];
    for r in records {
        match out.iter_mut().find(|c| c.label == r.case) {
            Some(c) => c.records.push(r.clone()),
            None => out.push(Case {
                label: r.case.clone(),
                world: r.world,
                members: vec![],
                records: vec![r.clone()],
                invalid: None,
            }),
        }
    }
    for c in &mut out {
        let first = &c.records[0];
        c.members = first
            .group
            .clone()
            .unwrap_or_else(|| (0..first.world).collect());
        let mut problem = c.records.iter().find_map(|r| validate(r).err());
        if problem.is_none() {
            problem = check_case(c);
        }
        c.invalid = problem;
    }
    out
}

/// Cross-record checks: one world, one group, one fn, one record per member.
pub(crate) fn check_case(c: &Case) -> Option<String> {
    let first = &c.records[0];
    let mut members = c.members.clone();
    members.sort_unstable();
    if members.is_empty()
        || members.windows(2).any(|w| w[0] == w[1])
        || members.iter().any(|&m| m >= first.world)
    {
        return Some(format!(
            "group {:?} is not a set of ranks of a world of {}",
            c.members, first.world
        ));
    }
    for r in &c.records {
        if r.world != first.world || r.group != first.group || r.func != first.func {
            return Some("records disagree on world, group or fn".into());
        }
        if !c.members.contains(&r.rank) {
            return Some(format!(
                "rank {} is not in the group {:?}",
                r.rank, c.members
            ));
        }
    }
    for &m in &c.members {
        match c.records.iter().filter(|r| r.rank == m).count() {
            1 => {}
            0 => return Some(format!("no record for group member rank {m}")),
            _ => return Some(format!("several records for rank {m}")),
        }
    }
    None
}
