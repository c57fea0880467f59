//! Element types.

use std::fmt;

/// The element type of a tensor.
///
/// Floating types take part in autograd; `I64` holds labels and indices, `Bool` masks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float (`torch.float32`), the default.
    F32,
    /// 64-bit IEEE float (`torch.float64`).
    F64,
    /// 64-bit signed integer (`torch.int64`).
    I64,
    /// Boolean (`torch.bool`).
    Bool,
    /// 16-bit brain float (`torch.bfloat16`): float32's 8 exponent bits and 7 mantissa bits
    /// ([`half::bf16`]). Operations compute in float32 and round once to nearest even.
    BF16,
    /// 16-bit IEEE half float (`torch.float16`): 5 exponent bits and 10 mantissa bits
    /// ([`half::f16`]). Operations compute in float32 and round once to nearest even.
    F16,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        crate::with_dtype!(self, T => size_of::<T>())
    }

    /// Whether this is a floating type (the only types that can require grad).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::BF16 | DType::F16)
    }

    /// Whether this is one of the 16-bit floating types (`bfloat16`, `float16`), which compute
    /// in float32 and round once.
    pub fn is_half(self) -> bool {
        matches!(self, DType::BF16 | DType::F16)
    }

    /// Every dtype, in the order of their [`code`](DType::code)s.
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::F64,
        DType::I64,
        DType::Bool,
        DType::BF16,
        DType::F16,
    ];

    /// The dtype's wire code (0 float32, 1 float64, 2 int64, 3 bool, 4 bfloat16, 5 float16):
    /// the one numbering every
    /// layer that sends a dtype between processes uses (collective descriptors, the cpu
    /// backend's frames, the differentiable collectives' metadata, RPC messages). Stable:
    /// new dtypes get new codes.
    pub fn code(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::F64 => 1,
            DType::I64 => 2,
            DType::Bool => 3,
            DType::BF16 => 4,
            DType::F16 => 5,
        }
    }

    /// The dtype of a wire [`code`](DType::code); `None` for a code no dtype has (a corrupt
    /// or newer peer).
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(usize::from(code)).copied()
    }
}

/// Runs `$body` with the type name `$T` bound to the element type of a [`DType`]: the one
/// place that maps every dtype to its Rust type (`float32` to `f32`, `float64` to `f64`,
/// `int64` to `i64`, `bool` to `bool`). Expands to an exhaustive `match`, so a new dtype is a
/// compile error wherever a dispatch does not handle it.
///
/// ```
/// use tensorplay_core::{DType, Element, with_dtype};
///
/// fn size(d: DType) -> usize {
///     with_dtype!(d, T => size_of::<T>())
/// }
/// assert_eq!(size(DType::F64), 8);
/// assert_eq!(with_dtype!(DType::Bool, T => T::DTYPE), DType::Bool);
/// ```
#[macro_export]
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::Bool => {
                type $T = bool;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::f16;
                $body
            }
        }
    };
}

/// [`with_dtype!`] for the floating dtypes: `$body` with `$T` bound to `f32`, `f64`,
/// [`bf16`](crate::bf16) or [`f16`](crate::f16), and
/// `$else` with `$d` bound to any other dtype (listed by name in the expansion, so a new
/// dtype is a compile error here too).
///
/// ```
/// use tensorplay_core::{DType, with_float_dtype};
///
/// let eps = |d: DType| with_float_dtype!(d, T => Some(f64::from(T::EPSILON)), _d => None);
/// assert_eq!(eps(DType::F32), Some(f64::from(f32::EPSILON)));
/// assert_eq!(eps(DType::I64), None);
/// ```
#[macro_export]
macro_rules! with_float_dtype {
    ($dtype:expr, $T:ident => $body:expr, $d:ident => $else:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::f16;
                $body
            }
            $d @ ($crate::DType::I64 | $crate::DType::Bool) => $else,
        }
    };
}

/// [`with_dtype!`] for the numeric dtypes (`float32`, `float64`, `int64`, `bfloat16`,
/// `float16`: the element types whose every byte pattern is a value,
/// [`bytes::PlainElement`](crate::bytes::PlainElement)): `$body` with `$T` bound to `f32`,
/// `f64`, `i64`, [`bf16`](crate::bf16) or [`f16`](crate::f16), and `$else` with `$d` bound to any other
/// dtype (listed by name in the expansion).
///
/// ```
/// use tensorplay_core::{DType, Element, with_numeric_dtype};
///
/// let max = |d: DType| with_numeric_dtype!(d, T => Some(T::MAX.to_f64()), _d => None);
/// assert_eq!(max(DType::I64), Some(i64::MAX as f64));
/// assert_eq!(max(DType::BF16), Some(3.3895313892515355e38));
/// assert_eq!(max(DType::Bool), None);
/// ```
#[macro_export]
macro_rules! with_numeric_dtype {
    ($dtype:expr, $T:ident => $body:expr, $d:ident => $else:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::DType::BF16 => {
                type $T = $crate::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::f16;
                $body
            }
            $d @ $crate::DType::Bool => $else,
        }
    };
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I64 => "int64",
            DType::Bool => "bool",
            DType::BF16 => "bfloat16",
            DType::F16 => "float16",
        })
    }
}

/// A Rust type that can be stored in a CPU tensor.
pub trait Element: Copy + Send + Sync + PartialOrd + fmt::Debug + Default + 'static {
    /// The matching [`DType`].
    const DTYPE: DType;
    /// Lossy conversion to `f64`.
    fn to_f64(self) -> f64;
    /// Lossy conversion from `f64` (truncating for integers, `!= 0` for bool).
    fn from_f64(v: f64) -> Self;
}

macro_rules! impl_element {
    ($t:ty, $d:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
        }
    };
}
impl_element!(f32, F32);
impl_element!(f64, F64);
impl_element!(i64, I64);

impl Element for bool {
    const DTYPE: DType = DType::Bool;
    fn to_f64(self) -> f64 {
        if self { 1.0 } else { 0.0 }
    }
    fn from_f64(v: f64) -> Self {
        v != 0.0
    }
}

/// `v` as `f32` rounded to odd: truncated toward zero, with the last bit set when anything
/// was cut off. Rounding that to a format of at most 22 significant bits (both 16-bit types)
/// to nearest even gives `v` rounded to nearest even once; rounding `v` to `f32` first and
/// then again could round twice (a value just above a 16-bit tie would land on the tie).
/// NaN stays NaN; beyond `f32`'s range the result is `f32::MAX` (odd), which rounds on to
/// infinity, as `v` does.
fn round_to_odd_f32(v: f64) -> f32 {
    let mut t = v as f32;
    if t.is_nan() || f64::from(t) == v {
        return t;
    }
    if f64::from(t).abs() > v.abs() {
        // rounded away from zero: one step back toward it (same sign, smaller magnitude)
        t = f32::from_bits(t.to_bits() - 1);
    }
    f32::from_bits(t.to_bits() | 1)
}

/// The 16-bit float types: converted to and from `f64` with one rounding to nearest even
/// (NaN and infinities kept), through [`round_to_odd_f32`].
macro_rules! impl_half_element {
    ($t:ty, $d:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            #[inline]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                <$t>::from_f32(round_to_odd_f32(v))
            }
        }
        impl FloatElement for $t {
            fn erf(self) -> Self {
                <$t>::from_f32(libm::erff(self.to_f32()))
            }
        }
    };
}
impl_half_element!(half::bf16, BF16);
impl_half_element!(half::f16, F16);

/// A floating element type (`f32`, `f64`, [`bf16`](crate::bf16) or [`f16`](crate::f16)).
/// Arithmetic through [`num_traits::Float`] on the 16-bit types computes each operation in
/// float32 and rounds once.
pub trait FloatElement: Element + num_traits::Float + std::iter::Sum {
    /// Error function, used by the exact GELU.
    fn erf(self) -> Self;
}
impl FloatElement for f32 {
    fn erf(self) -> Self {
        libm::erff(self)
    }
}
impl FloatElement for f64 {
    fn erf(self) -> Self {
        libm::erf(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One dtype: what the dispatch macros bind its element type to.
    struct Case {
        dtype: DType,
        size: usize,
        float: bool,
        numeric: bool,
    }

    fn check(c: Case) {
        let d = c.dtype;
        assert_eq!(
            with_dtype!(d, T => T::DTYPE),
            d,
            "{d}: with_dtype binds its own type"
        );
        assert_eq!(
            with_dtype!(d, T => size_of::<T>()),
            c.size,
            "{d}: element size"
        );
        assert_eq!(d.size_in_bytes(), c.size, "{d}: size_in_bytes");
        let f = with_float_dtype!(d, T => Some(T::DTYPE), _d => None);
        assert_eq!(f, c.float.then_some(d), "{d}: with_float_dtype");
        let n = with_numeric_dtype!(d, T => Some(T::DTYPE), other => {
            assert_eq!(other, d, "{d}: the fallback gets the dtype");
            None
        });
        assert_eq!(n, c.numeric.then_some(d), "{d}: with_numeric_dtype");
        assert_eq!(DType::from_code(d.code()), Some(d), "{d}: wire code");
    }

    #[test]
    fn every_dtype_dispatches_to_its_element_type() {
        let cases = [
            Case {
                dtype: DType::F32,
                size: 4,
                float: true,
                numeric: true,
            },
            Case {
                dtype: DType::F64,
                size: 8,
                float: true,
                numeric: true,
            },
            Case {
                dtype: DType::I64,
                size: 8,
                float: false,
                numeric: true,
            },
            Case {
                dtype: DType::Bool,
                size: 1,
                float: false,
                numeric: false,
            },
            Case {
                dtype: DType::BF16,
                size: 2,
                float: true,
                numeric: true,
            },
            Case {
                dtype: DType::F16,
                size: 2,
                float: true,
                numeric: true,
            },
        ];
        assert_eq!(cases.len(), DType::ALL.len(), "a case per dtype");
        for c in cases {
            check(c);
        }
    }
}
