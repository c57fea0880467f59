//! The agreement encoding: how a call's dtypes and shapes travel in the `i64` descriptors
//! that every rank all-gathers before moving data, and the checks that every rank agrees on
//! a dtype or a root (an error naming each rank's value otherwise).

use super::MAX_DIMS;
use super::group::Grp;
use tensorplay_collectives::{self as coll, Part};
use tensorplay_core::DType;

pub(super) fn dtype_code(d: DType) -> i64 {
    i64::from(d.code())
}

pub(super) fn dtype_of(code: i64) -> DType {
    u8::try_from(code)
        .ok()
        .and_then(DType::from_code)
        .unwrap_or(DType::Bool)
}

/// Length of a shape descriptor: `[ndim, d_0 .. d_7]`.
pub(super) const SHAPE_LEN: usize = 1 + MAX_DIMS;

pub(super) fn push_shape(v: &mut Vec<i64>, shape: &[usize]) {
    v.push(shape.len() as i64);
    for i in 0..MAX_DIMS {
        v.push(shape.get(i).map_or(-1, |&d| d as i64));
    }
}

pub(super) fn read_shape(v: &[i64]) -> Vec<usize> {
    let nd = v[0].clamp(0, MAX_DIMS as i64) as usize;
    // dims above i64::MAX (possible next to a zero dim) travel as negative numbers
    v[1..=nd].iter().map(|&d| d as u64 as usize).collect()
}

/// Every rank's dtype code (taken from its descriptor by `code`) must be the same.
pub(super) fn agree_dtype(
    gp: &Grp,
    op: &str,
    all: &[Vec<i64>],
    code: impl Fn(&[i64]) -> i64,
) -> coll::Result<()> {
    let first = code(&all[0]);
    if all.iter().all(|d| code(d) == first) {
        return Ok(());
    }
    let mut detail = coll::Detail::from("dtypes differ (");
    for (k, d) in all.iter().enumerate() {
        let sep = if k == 0 { "rank " } else { ", rank " };
        detail = detail.join(coll::detail!(
            sep,
            Part::Rank(gp.g.ranks()[k]),
            format!(": {}", dtype_of(code(d)))
        ));
    }
    Err(coll::Error::Mismatch {
        op: op.to_string(),
        detail: detail.join(")"),
    })
}

/// Every rank must name the same root.
pub(super) fn agree_root(
    gp: &Grp,
    op: &str,
    arg: &str,
    all: &[Vec<i64>],
    root: impl Fn(&[i64]) -> i64,
) -> coll::Result<()> {
    let first = root(&all[0]);
    if all.iter().all(|d| root(d) == first) {
        return Ok(());
    }
    let mut detail = coll::Detail::from(format!("{arg} differs ("));
    for (k, d) in all.iter().enumerate() {
        let sep = if k == 0 { "rank " } else { ", rank " };
        detail = detail.join(coll::detail!(
            sep,
            Part::Rank(gp.g.ranks()[k]),
            format!(": {arg} {}", root(d))
        ));
    }
    Err(coll::Error::Mismatch {
        op: op.to_string(),
        detail: detail.join(")"),
    })
}
