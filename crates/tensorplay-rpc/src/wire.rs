//! How arguments and results of remote functions travel: the [`Wire`] trait.
//!
//! Scalars, strings and containers are written into a compact little-endian byte payload that
//! rides inside the message envelope; tensors are not copied into it: the encoder keeps them
//! in a side table, and their bytes travel after the envelope and are received straight into
//! the new tensor's storage. Every encoded value takes at least one byte, so a length prefix
//! can never claim more elements than the bytes that remain (malformed input is an error, never
//! a huge allocation or a panic).

use tensorplay_core::{DType, Tensor};

use crate::{Error, Result, WorkerInfo};

/// A type that can be an argument or result of a remote function.
///
/// Implemented for `()`, `bool`, the integer and float types, `String`, `Vec<T>`,
/// `Option<T>`, `Box<T>`, tuples of up to 8 elements, [`Tensor`], [`WorkerInfo`],
/// `std::time::Duration` and [`RRef<T>`](crate::RRef). Implement it for your own types by
/// encoding their fields in order:
///
/// ```
/// use tensorplay::distributed::rpc::{Decoder, Encoder, Result, Wire};
///
/// struct Batch { ids: Vec<u64>, scale: f64 }
///
/// impl Wire for Batch {
///     fn encode(&self, e: &mut Encoder) -> Result<()> {
///         self.ids.encode(e)?;
///         self.scale.encode(e)
///     }
///     fn decode(d: &mut Decoder) -> Result<Self> {
///         Ok(Batch { ids: Wire::decode(d)?, scale: Wire::decode(d)? })
///     }
/// }
/// ```
pub trait Wire: Sized + Send + 'static {
    /// Appends this value to `e`.
    ///
    /// # Errors
    /// Values that cannot travel (a CUDA tensor, a deleted RRef).
    fn encode(&self, e: &mut Encoder) -> Result<()>;
    /// Reads a value written by [`Wire::encode`].
    ///
    /// # Errors
    /// [`Error::Serialization`] when the bytes are not a value of this type.
    fn decode(d: &mut Decoder) -> Result<Self>;
}

/// The writer side of [`Wire`]: payload bytes and the tensor side table.
#[derive(Default)]
pub struct Encoder {
    pub(crate) bytes: Vec<u8>,
    pub(crate) tensors: Vec<Tensor>,
    /// The rank of the worker the value is sent to (RRefs need it).
    pub(crate) dest: Option<usize>,
    /// RRef forks made while encoding (registered once the message is sent).
    pub(crate) forks: Vec<crate::rref::PendingFork>,
    /// The distributed-autograd header of a response carrying these tensors.
    pub(crate) autograd: Option<crate::proto::message::AutogradHeader>,
}

impl Encoder {
    pub(crate) fn to(dest: usize) -> Encoder {
        Encoder {
            dest: Some(dest),
            ..Encoder::default()
        }
    }

    /// Appends raw bytes.
    pub fn put_bytes(&mut self, b: &[u8]) {
        self.bytes.extend_from_slice(b);
    }

    /// Appends a length (as a little-endian `u64`).
    pub fn put_len(&mut self, n: usize) {
        self.put_bytes(&(n as u64).to_le_bytes());
    }
}

/// The reader side of [`Wire`].
pub struct Decoder<'a> {
    bytes: &'a [u8],
    pos: usize,
    pub(crate) tensors: Vec<Option<Tensor>>,
    /// The rank of the worker that sent the value.
    pub(crate) from: usize,
    /// User RRefs decoded from another user, not yet confirmed by their owner.
    pub(crate) unconfirmed: Vec<std::sync::Arc<crate::rref::Inner>>,
}

impl<'a> Decoder<'a> {
    pub(crate) fn new(bytes: &'a [u8], tensors: Vec<Tensor>, from: usize) -> Decoder<'a> {
        Decoder {
            bytes,
            pos: 0,
            tensors: tensors.into_iter().map(Some).collect(),
            from,
            unconfirmed: Vec::new(),
        }
    }

    /// The rank of the worker that sent the value.
    pub fn sender(&self) -> usize {
        self.from
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// Reads `n` raw bytes.
    ///
    /// # Errors
    /// [`Error::Serialization`] when fewer remain.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(Error::Serialization(format!(
                "truncated value: needed {n} more bytes, {} left",
                self.remaining()
            )));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    /// Reads a length written by [`Encoder::put_len`], checking that at least that many bytes
    /// remain (every value takes at least one byte).
    ///
    /// # Errors
    /// [`Error::Serialization`] when the length is impossible.
    pub fn take_len(&mut self) -> Result<usize> {
        let n = u64::from_le_bytes(self.take(8)?.try_into().unwrap_or_default());
        if n > self.remaining() as u64 {
            return Err(Error::Serialization(format!(
                "length {n} exceeds the {} bytes left",
                self.remaining()
            )));
        }
        Ok(n as usize)
    }

    /// Checks that everything was read.
    pub(crate) fn finish(&self, what: &str) -> Result<()> {
        if self.remaining() != 0 {
            return Err(Error::Serialization(format!(
                "{} unread bytes after {what}: the types on the two sides differ",
                self.remaining()
            )));
        }
        Ok(())
    }
}

macro_rules! wire_num {
    ($($t:ty),*) => {$(
        impl Wire for $t {
            fn encode(&self, e: &mut Encoder) -> Result<()> {
                e.put_bytes(&self.to_le_bytes());
                Ok(())
            }
            fn decode(d: &mut Decoder) -> Result<Self> {
                let b = d.take(std::mem::size_of::<$t>())?;
                Ok(<$t>::from_le_bytes(b.try_into().map_err(|_| Error::Serialization("number".into()))?))
            }
        }
    )*};
}
wire_num!(u8, u16, u32, u64, i8, i16, i32, i64, f32, f64);

impl Wire for usize {
    fn encode(&self, e: &mut Encoder) -> Result<()> {
        (*self as u64).encode(e)
    }
    fn decode(d: &mut Decoder) -> Result<Self> {
        usize::try_from(u64::decode(d)?)
            .map_err(|_| Error::Serialization("usize out of range".into()))
    }
}

impl Wire for bool {
    fn encode(&self, e: &mut Encoder) -> Result<()> {
        u8::from(*self).encode(e)
    }
    fn decode(d: &mut Decoder) -> Result<Self> {
        match u8::decode(d)? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(Error::Serialization(format!("bool byte {b}"))),
        }
    }
}

impl Wire for () {
    fn encode(&self, e: &mut Encoder) -> Result<()> {
        e.put_bytes(&[0]);
        Ok(())
    }
    fn decode(d: &mut Decoder) -> Result<Self> {
        match d.take(1)?[0] {
            0 => Ok(()),
            b => Err(Error::Serialization(format!("unit byte {b}"))),
        }
    }
}

impl Wire for String {
    fn encode(&self, e: &mut Encoder) -> Result<()> {
        e.put_len(self.len());
        e.put_bytes(self.as_bytes());
        Ok(())
    }
    fn decode(d: &mut Decoder) -> Result<Self> {
        let n = d.take_len()?;
        String::from_utf8(d.take(n)?.to_vec())
            .map_err(|_| Error::Serialization("a string that is not UTF-8".into()))
    }
}

impl<T: Wire> Wire for Vec<T> {
    fn encode(&self, e: &mut Encoder) -> Result<()> {
        e.put_len(self.len());
        self.iter().try_for_each(|v| v.encode(e))
    }
    fn decode(d: &mut Decoder) -> Result<Self> {
        let n = d.take_len()?;
        (0..n).map(|_| T::decode(d)).collect()
    }
}

impl<T: Wire> Wire for Option<T> {
    fn encode(&self, e: &mut Encoder) -> Result<()> {
        match self {
            None => 0u8.encode(e),
            Some(v) => {
                1u8.encode(e)?;
                v.encode(e)
            }
        }
    }
    fn decode(d: &mut Decoder) -> Result<Self> {
        match u8::decode(d)? {
            0 => Ok(None),
            1 => Ok(Some(T::decode(d)?)),
            b => Err(Error::Serialization(format!("option tag {b}"))),
        }
    }
}

impl<T: Wire> Wire for Box<T> {
    fn encode(&self, e: &mut Encoder) -> Result<()> {
        (**self).encode(e)
    }
    fn decode(d: &mut Decoder) -> Result<Self> {
        Ok(Box::new(T::decode(d)?))
    }
}

impl Wire for std::time::Duration {
    fn encode(&self, e: &mut Encoder) -> Result<()> {
        self.as_secs().encode(e)?;
        self.subsec_nanos().encode(e)
    }
    fn decode(d: &mut Decoder) -> Result<Self> {
        let (s, n) = (u64::decode(d)?, u32::decode(d)?);
        if n >= 1_000_000_000 {
            return Err(Error::Serialization(format!("duration nanos {n}")));
        }
        Ok(std::time::Duration::new(s, n))
    }
}

macro_rules! wire_tuple {
    ($($n:ident),+) => {
        impl<$($n: Wire),+> Wire for ($($n,)+) {
            #[allow(non_snake_case)]
            fn encode(&self, e: &mut Encoder) -> Result<()> {
                let ($($n,)+) = self;
                $($n.encode(e)?;)+
                Ok(())
            }
            fn decode(d: &mut Decoder) -> Result<Self> {
                Ok(($($n::decode(d)?,)+))
            }
        }
    };
}
wire_tuple!(A);
wire_tuple!(A, B);
wire_tuple!(A, B, C);
wire_tuple!(A, B, C, D);
wire_tuple!(A, B, C, D, E);
wire_tuple!(A, B, C, D, E, F);
wire_tuple!(A, B, C, D, E, F, G);
wire_tuple!(A, B, C, D, E, F, G, H);

impl Wire for WorkerInfo {
    fn encode(&self, e: &mut Encoder) -> Result<()> {
        self.name.encode(e)?;
        self.id.encode(e)
    }
    fn decode(d: &mut Decoder) -> Result<Self> {
        Ok(WorkerInfo {
            name: String::decode(d)?,
            id: usize::decode(d)?,
        })
    }
}

/// Tensors travel beside the payload: the payload holds the index into the side table. The
/// receiver gets a new contiguous CPU tensor with the same shape, dtype and values (views are
/// sent as their logical, row-major values). `requires_grad` is not carried (distributed
/// autograd records the crossing instead).
impl Wire for Tensor {
    fn encode(&self, e: &mut Encoder) -> Result<()> {
        if self.device().is_cuda() {
            return Err(Error::invalid(
                "rpc",
                "tensor",
                "a CPU tensor (move CUDA tensors with .to(\"cpu\") before sending)",
                format!("a tensor on {}", self.device()),
            ));
        }
        let i = u32::try_from(e.tensors.len())
            .map_err(|_| Error::Serialization("more than 2^32 tensors".into()))?;
        e.tensors.push(self.clone());
        i.encode(e)
    }
    fn decode(d: &mut Decoder) -> Result<Self> {
        let i = u32::decode(d)? as usize;
        d.tensors
            .get_mut(i)
            .and_then(Option::take)
            .ok_or_else(|| Error::Serialization(format!("tensor #{i} is missing or used twice")))
    }
}

/// The dtype code on the wire (the core's [`DType::code`]).
pub(crate) fn dtype_code(d: DType) -> u8 {
    d.code()
}

pub(crate) fn dtype_from(code: u8) -> Result<DType> {
    DType::from_code(code).ok_or_else(|| Error::Serialization(format!("unknown dtype code {code}")))
}

/// Encodes `v` for `dest` (payload, tensors, RRef forks). When it fails part-way, the forks
/// of the RRefs encoded before the failure are undone (the message never leaves).
pub(crate) fn encode_value<T: Wire>(v: &T, dest: usize) -> Result<Encoder> {
    let mut e = Encoder::to(dest);
    if let Err(err) = v.encode(&mut e) {
        if !e.forks.is_empty()
            && let Ok(a) = crate::agent::agent("encode")
        {
            crate::rref::after_send(&a, std::mem::take(&mut e.forks), false);
        }
        return Err(err);
    }
    Ok(e)
}

/// Decodes a whole payload as a `T`.
pub(crate) fn decode_value<T: Wire>(
    bytes: &[u8],
    tensors: Vec<Tensor>,
    from: usize,
    what: &str,
) -> Result<T> {
    decode_with(bytes, tensors, from, what).map(|(v, _)| v)
}

/// Decodes the arguments of a function (or method) about to run, on a blocking thread: as in
/// PyTorch, the function runs only once every RRef among them is confirmed by its owner.
pub(crate) fn decode_args<T: Wire>(
    bytes: &[u8],
    tensors: Vec<Tensor>,
    from: usize,
    what: &str,
) -> Result<T> {
    let (v, unconfirmed) = decode_with(bytes, tensors, from, what)?;
    crate::rref::wait_confirmed(&unconfirmed)?;
    Ok(v)
}

fn decode_with<T: Wire>(
    bytes: &[u8],
    tensors: Vec<Tensor>,
    from: usize,
    what: &str,
) -> Result<(T, Vec<std::sync::Arc<crate::rref::Inner>>)> {
    let mut d = Decoder::new(bytes, tensors, from);
    let v = T::decode(&mut d).map_err(|e| match e {
        Error::Serialization(m) => Error::Serialization(format!(
            "{what}: {m} (expected {})",
            std::any::type_name::<T>()
        )),
        other => other,
    })?;
    d.finish(what)?;
    Ok((v, d.unconfirmed))
}
