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
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::Bool => 1,
        }
    }

    /// Whether this is a floating type (the only types that can require grad).
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64)
    }

    /// Every dtype, in the order of their [`code`](DType::code)s.
    pub const ALL: [DType; 4] = [DType::F32, DType::F64, DType::I64, DType::Bool];

    /// The dtype's wire code (0 float32, 1 float64, 2 int64, 3 bool): the one numbering every
    /// layer that sends a dtype between processes uses (collective descriptors, the cpu
    /// backend's frames, the differentiable collectives' metadata, RPC messages). Stable:
    /// new dtypes get new codes.
    pub fn code(self) -> u8 {
        match self {
            DType::F32 => 0,
            DType::F64 => 1,
            DType::I64 => 2,
            DType::Bool => 3,
        }
    }

    /// The dtype of a wire [`code`](DType::code); `None` for a code no dtype has (a corrupt
    /// or newer peer).
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(usize::from(code)).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::I64 => "int64",
            DType::Bool => "bool",
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

/// A floating element type (`f32` or `f64`).
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
