//! The core's layers built remotely out of the box: `Linear` ([`LinearArgs`]), `Embedding`
//! and `Sequential` of core layers ([`LayerSpec`]).

use tensorplay_core::Result;
use tensorplay_core::nn::{Dropout, Embedding, GELU, Linear, ReLU, Sequential, Sigmoid, Tanh};
use tensorplay_rpc::{self as rpc, Decoder, Encoder, Wire};

use crate::constructible::RemoteConstructible;

// ---------------------------------------------------------------------------------------------
// the core's layers

/// The constructor arguments of [`Linear`] (`nn.Linear(in_features, out_features, bias)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearArgs {
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
    /// Whether the layer has a bias.
    pub bias: bool,
}

impl Wire for LinearArgs {
    fn encode(&self, e: &mut Encoder) -> rpc::Result<()> {
        (self.in_features, self.out_features, self.bias).encode(e)
    }
    fn decode(d: &mut Decoder) -> rpc::Result<Self> {
        let (in_features, out_features, bias) = Wire::decode(d)?;
        Ok(LinearArgs {
            in_features,
            out_features,
            bias,
        })
    }
}

impl RemoteConstructible for Linear {
    type Args = LinearArgs;
    const TYPE_NAME: &'static str = "tensorplay::nn::Linear";
    fn construct(a: &LinearArgs) -> Result<Linear> {
        Linear::new(a.in_features, a.out_features, a.bias)
    }
}

impl RemoteConstructible for Embedding {
    /// `(num_embeddings, embedding_dim)`.
    type Args = (usize, usize);
    const TYPE_NAME: &'static str = "tensorplay::nn::Embedding";
    fn construct(&(n, d): &(usize, usize)) -> Result<Embedding> {
        Embedding::new(n, d)
    }
}

/// One layer of a remotely built [`Sequential`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LayerSpec {
    /// `Linear(in, out, bias)`.
    Linear(LinearArgs),
    /// `ReLU`.
    ReLU,
    /// `Tanh`.
    Tanh,
    /// `Embedding(num, dim)`.
    Embedding(usize, usize),
    /// `Sigmoid`.
    Sigmoid,
    /// `GELU` (the exact, erf form).
    GELU,
    /// `Dropout(p)`: zeroes each element with probability `p` in training mode, scaling the
    /// rest by `1 / (1 - p)`; `p` in `[0, 1)`, checked on the owner.
    Dropout(f64),
}

impl Wire for LayerSpec {
    fn encode(&self, e: &mut Encoder) -> rpc::Result<()> {
        match *self {
            LayerSpec::Linear(a) => {
                0u8.encode(e)?;
                a.encode(e)
            }
            LayerSpec::ReLU => 1u8.encode(e),
            LayerSpec::Tanh => 2u8.encode(e),
            LayerSpec::Embedding(n, d) => {
                3u8.encode(e)?;
                (n, d).encode(e)
            }
            LayerSpec::Sigmoid => 4u8.encode(e),
            LayerSpec::GELU => 5u8.encode(e),
            LayerSpec::Dropout(p) => {
                6u8.encode(e)?;
                p.encode(e)
            }
        }
    }
    fn decode(d: &mut Decoder) -> rpc::Result<Self> {
        Ok(match u8::decode(d)? {
            0 => LayerSpec::Linear(LinearArgs::decode(d)?),
            1 => LayerSpec::ReLU,
            2 => LayerSpec::Tanh,
            3 => {
                let (n, dim) = Wire::decode(d)?;
                LayerSpec::Embedding(n, dim)
            }
            4 => LayerSpec::Sigmoid,
            5 => LayerSpec::GELU,
            6 => LayerSpec::Dropout(f64::decode(d)?),
            k => {
                return Err(rpc::Error::Serialization(format!(
                    "unknown layer kind {k} (expected 0 Linear, 1 ReLU, 2 Tanh, 3 Embedding, 4 Sigmoid, 5 GELU, 6 Dropout)"
                )));
            }
        })
    }
}

impl RemoteConstructible for Sequential {
    /// The layers, in order.
    type Args = Vec<LayerSpec>;
    const TYPE_NAME: &'static str = "tensorplay::nn::Sequential";
    fn construct(layers: &Vec<LayerSpec>) -> Result<Sequential> {
        let mut s = Sequential::new();
        for l in layers {
            s.push(match *l {
                LayerSpec::Linear(a) => Box::new(Linear::construct(&a)?),
                LayerSpec::ReLU => Box::new(ReLU::new()),
                LayerSpec::Tanh => Box::new(Tanh::new()),
                LayerSpec::Embedding(n, d) => Box::new(Embedding::new(n, d)?),
                LayerSpec::Sigmoid => Box::new(Sigmoid::new()),
                LayerSpec::GELU => Box::new(GELU::new()),
                LayerSpec::Dropout(p) => Box::new(Dropout::new(p)?),
            });
        }
        Ok(s)
    }
}
