//! What travels between stages: a header per message (what it is — activation or gradient,
//! the sending stage, the micro-batch and the step — and each tensor's dtype and shape),
//! then the tensors. The receiver checks the header against what its schedule expects, so
//! ranks that run different schedules get an error naming both sides, never wrong data, and
//! shapes may change from step to step.

use tensorplay_collectives::{self as dist, P2POp, ProcessGroup, Work};
use tensorplay_core::{DType, Result, Tensor};

/// Header length in int64 elements.
pub(crate) const HEADER: usize = 64;
const MAGIC: i64 = 0x7470_7069_7065; // "tppipe"
const FIXED: usize = 6;

/// Activations (forward) or gradients (backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Activation,
    Gradient,
}

impl Kind {
    pub(crate) fn word(self) -> &'static str {
        match self {
            Kind::Activation => "activation",
            Kind::Gradient => "gradient",
        }
    }
}

/// What a message says it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Header {
    pub(crate) kind: Kind,
    /// The stage that sent it.
    pub(crate) stage: usize,
    pub(crate) microbatch: usize,
    pub(crate) step: u64,
    /// Each tensor's dtype and shape.
    pub(crate) tensors: Vec<(DType, Vec<usize>)>,
}

impl Header {
    pub(crate) fn encode(&self) -> std::result::Result<Tensor, String> {
        let mut h = vec![0i64; HEADER];
        h[0] = MAGIC;
        h[1] = i64::from(self.kind == Kind::Gradient);
        h[2] = self.stage as i64;
        h[3] = self.microbatch as i64;
        h[4] = self.step as i64;
        h[5] = self.tensors.len() as i64;
        let mut at = FIXED;
        for (dt, shape) in &self.tensors {
            if at + 2 + shape.len() > HEADER {
                return Err(format!(
                    "at most {} int64 words of dtypes and shapes per message (each tensor takes \
                     2 + its dims); these {} tensors need more",
                    HEADER - FIXED,
                    self.tensors.len()
                ));
            }
            h[at] = i64::from(dt.code());
            h[at + 1] = shape.len() as i64;
            for (i, &d) in shape.iter().enumerate() {
                h[at + 2 + i] = d as i64;
            }
            at += 2 + shape.len();
        }
        Tensor::from_vec(h, &[HEADER]).map_err(|e| e.to_string())
    }

    pub(crate) fn decode(t: &Tensor) -> std::result::Result<Header, String> {
        let h = t.to_vec::<i64>().map_err(|e| e.to_string())?;
        let bad =
            || "a message that is not a pipeline header (another program's send?)".to_string();
        if h.len() != HEADER || h[0] != MAGIC {
            return Err(bad());
        }
        let n = usize::try_from(h[5]).map_err(|_| bad())?;
        let mut tensors = Vec::with_capacity(n);
        let mut at = FIXED;
        for _ in 0..n {
            let code = u8::try_from(*h.get(at).ok_or_else(bad)?).map_err(|_| bad())?;
            let dt = DType::from_code(code).ok_or_else(bad)?;
            let nd = usize::try_from(*h.get(at + 1).ok_or_else(bad)?).map_err(|_| bad())?;
            let dims = h.get(at + 2..at + 2 + nd).ok_or_else(bad)?;
            let shape = dims
                .iter()
                .map(|&d| usize::try_from(d).map_err(|_| bad()))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            tensors.push((dt, shape));
            at += 2 + nd;
        }
        Ok(Header {
            kind: if h[1] == 1 {
                Kind::Gradient
            } else {
                Kind::Activation
            },
            stage: usize::try_from(h[2]).map_err(|_| bad())?,
            microbatch: usize::try_from(h[3]).map_err(|_| bad())?,
            step: u64::try_from(h[4]).map_err(|_| bad())?,
            tensors,
        })
    }

    /// `"stage 0's micro-batch 3 activation (step 2)"`.
    pub(crate) fn describe(&self) -> String {
        format!(
            "stage {}'s micro-batch {} {} (step {})",
            self.stage,
            self.microbatch,
            self.kind.word(),
            self.step
        )
    }
}

/// Posts the header and the tensors to global rank `peer` (non-blocking); the returned works
/// hold the tensors until sent.
pub(crate) fn post_send(
    group: &ProcessGroup,
    peer: usize,
    header: &Header,
    tensors: &[Tensor],
) -> std::result::Result<Vec<Work>, String> {
    let label = header.describe();
    let h = header.encode()?;
    let mut ops =
        vec![P2POp::isend(&h, peer, Some(group), 0).with_label(format!("{label}, header"))];
    for (i, t) in tensors.iter().enumerate() {
        ops.push(P2POp::isend(t, peer, Some(group), 0).with_label(format!("{label}, tensor {i}")));
    }
    dist::batch_isend_irecv(ops).map_err(|e| e.to_string())
}

/// Posts the receive of a header from global rank `peer`.
pub(crate) fn post_header(
    group: &ProcessGroup,
    peer: usize,
    label: String,
) -> Result<(Tensor, Work)> {
    let h = Tensor::zeros(&[HEADER], DType::I64)?;
    let w = dist::batch_isend_irecv(vec![
        P2POp::irecv(&h, peer, Some(group), 0).with_label(label),
    ])?
    .remove(0);
    Ok((h, w))
}

/// Posts the receives of the tensors `header` announces.
pub(crate) fn post_tensors(
    group: &ProcessGroup,
    peer: usize,
    header: &Header,
) -> Result<(Vec<Tensor>, Vec<Work>)> {
    let label = header.describe();
    let mut ts = Vec::with_capacity(header.tensors.len());
    let mut ops = Vec::with_capacity(header.tensors.len());
    for (i, (dt, shape)) in header.tensors.iter().enumerate() {
        let t = Tensor::empty(shape, *dt)?;
        ops.push(P2POp::irecv(&t, peer, Some(group), 0).with_label(format!("{label}, tensor {i}")));
        ts.push(t);
    }
    let works = if ops.is_empty() {
        vec![]
    } else {
        dist::batch_isend_irecv(ops)?
    };
    Ok((ts, works))
}
