//! The records of a vectors file: one case on one rank, its tensors, and reading a file.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

use serde::Deserialize;

use crate::Error;

/// A tensor of a record: shape and row-major float64 data.
#[derive(Debug, Clone, Deserialize)]
pub struct TensorData {
    /// Shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f64>,
}

/// One record: one case on one rank.
#[derive(Debug, Clone, Deserialize)]
pub struct Record {
    /// The case's label.
    pub case: String,
    /// The function under test.
    #[serde(rename = "fn")]
    pub func: String,
    /// World size.
    pub world: usize,
    /// Global rank of this record.
    pub rank: usize,
    /// `src`, `dst`, `op`, `input_split_sizes`, `output_split_sizes` (any JSON values; checked
    /// when the case is validated).
    #[serde(default)]
    pub params: BTreeMap<String, serde_json::Value>,
    /// The group's global ranks (the whole world when absent).
    #[serde(default)]
    pub group: Option<Vec<usize>>,
    /// The differentiable inputs.
    pub inputs: Vec<TensorData>,
    /// Expected forward outputs.
    pub outputs: Vec<TensorData>,
    /// Expected input gradients.
    pub grads: Vec<TensorData>,
    /// Whether the outputs are compared.
    #[serde(default = "yes")]
    pub compare_outputs: bool,
}

fn yes() -> bool {
    true
}

/// Reads a vectors file.
///
/// # Errors
/// [`Error::Io`] or [`Error::Parse`].
pub fn load(path: &Path) -> Result<Vec<Record>, Error> {
    let text = fs::read_to_string(path).map_err(|e| Error::Io(path.into(), e))?;
    serde_json::from_str(&text).map_err(|e| Error::Parse(path.into(), e))
}
