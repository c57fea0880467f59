//! Tolerance checks: `|got - want| <= abs + rel * |want|` element by element, with NaN equal to
//! NaN and infinities equal only to themselves.

use std::fmt;

/// A tolerance: an element passes when `|got - want| <= abs + rel * |want|`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tol {
    /// The absolute part, in the values' units.
    pub abs: f64,
    /// The relative part, a fraction of `|want|`.
    pub rel: f64,
}

impl Tol {
    /// Bit-for-bit up to the sign of zero (`abs = rel = 0`).
    pub const EXACT: Tol = Tol { abs: 0.0, rel: 0.0 };

    /// `abs` only.
    pub const fn abs(abs: f64) -> Tol {
        Tol { abs, rel: 0.0 }
    }

    /// `tol * (1 + |want|)`: the same bound absolute near zero and relative for large values.
    pub const fn scaled(tol: f64) -> Tol {
        Tol { abs: tol, rel: tol }
    }

    /// Whether `got` is within this tolerance of `want`.
    pub fn admits(&self, got: f64, want: f64) -> bool {
        if got.is_nan() || want.is_nan() {
            return got.is_nan() && want.is_nan();
        }
        if got.is_infinite() || want.is_infinite() {
            return got == want;
        }
        (got - want).abs() <= self.abs + self.rel * want.abs()
    }
}

impl fmt::Display for Tol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "abs {:e} + rel {:e}", self.abs, self.rel)
    }
}

/// Checks `got` against `want` element by element; the error names `what`, the first element
/// that differs, both values and the tolerance (or the two lengths when they differ).
///
/// # Errors
/// The lengths differ, or an element is outside `tol`.
pub fn check_close(what: &str, got: &[f64], want: &[f64], tol: Tol) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} values, want {} (got {got:?}, want {want:?})",
            got.len(),
            want.len()
        ));
    }
    match got.iter().zip(want).position(|(&g, &w)| !tol.admits(g, w)) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: element {i}: got {}, want {} (tolerance {tol}; got {got:?}, want {want:?})",
            got[i], want[i]
        )),
    }
}

/// [`check_close`] that panics with its message.
///
/// # Panics
/// Where [`check_close`] returns an error.
#[track_caller]
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: Tol) {
    if let Err(e) = check_close(what, got, want, tol) {
        panic!("{e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Case {
        name: &'static str,
        got: &'static [f64],
        want: &'static [f64],
        tol: Tol,
        ok: bool,
    }

    const CASES: &[Case] = &[
        Case {
            name: "equal",
            got: &[1.0, -2.0],
            want: &[1.0, -2.0],
            tol: Tol::EXACT,
            ok: true,
        },
        Case {
            name: "one ulp off, exact",
            got: &[1.000_000_000_000_000_2],
            want: &[1.0],
            tol: Tol::EXACT,
            ok: false,
        },
        Case {
            name: "within abs",
            got: &[1.05],
            want: &[1.0],
            tol: Tol::abs(0.1),
            ok: true,
        },
        Case {
            name: "outside abs",
            got: &[1.2],
            want: &[1.0],
            tol: Tol::abs(0.1),
            ok: false,
        },
        Case {
            name: "relative for large values",
            got: &[1000.5],
            want: &[1000.0],
            tol: Tol::scaled(1e-3),
            ok: true,
        },
        Case {
            name: "nan equals nan",
            got: &[f64::NAN],
            want: &[f64::NAN],
            tol: Tol::EXACT,
            ok: true,
        },
        Case {
            name: "nan is not a number",
            got: &[f64::NAN],
            want: &[0.0],
            tol: Tol::abs(1e9),
            ok: false,
        },
        Case {
            name: "infinity only itself",
            got: &[f64::INFINITY],
            want: &[1e308],
            tol: Tol::scaled(1.0),
            ok: false,
        },
        Case {
            name: "lengths differ",
            got: &[1.0],
            want: &[1.0, 2.0],
            tol: Tol::abs(1.0),
            ok: false,
        },
    ];

    fn check(c: &Case) {
        let r = check_close(c.name, c.got, c.want, c.tol);
        assert_eq!(r.is_ok(), c.ok, "case {}: {r:?}", c.name);
        if let Err(e) = r {
            assert!(
                e.starts_with(c.name),
                "case {}: the error names the case: {e}",
                c.name
            );
        }
    }

    #[test]
    fn tolerance_cases() {
        CASES.iter().for_each(check);
    }
}
