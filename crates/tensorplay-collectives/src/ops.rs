//! The public collectives on tensors (`torch.distributed.*`): argument validation, the
//! cross-rank metadata check, strided views, rank translation, then dispatch to the backend.
//!
//! Conventions (PyTorch's): `src`/`dst` are global ranks; `group: None` is the default group;
//! operations are in place on the tensors PyTorch writes to. Tensors may be strided views:
//! results are computed in logical (row-major) order and only the view's elements are
//! written. Every rank checks, before moving data, that all ranks passed agreeing dtypes,
//! shapes, roots and ops (set `TENSORPLAY_COLLECTIVE_CHECK=0` to skip the pure checks for
//! speed); a disagreement is an [`Error::Mismatch`] on every rank naming the ranks and values.

use std::time::Duration;

use tensorplay_core::{DType, Device, StorageElement, Tensor};

use crate::backend::{Backend, BufMut, BufRef};
use crate::group::{BackendImpl, ProcessGroup, default_group};
use crate::work::Work;
use crate::{Error, ReduceOp, Result};

/// Element types the collectives move.
pub(crate) trait CommElem: StorageElement {
    fn buf_mut(s: &mut [Self]) -> BufMut<'_>;
    fn buf_ref(s: &[Self]) -> BufRef<'_>;
}
macro_rules! comm_elem {
    ($t:ty, $v:ident) => {
        impl CommElem for $t {
            fn buf_mut(s: &mut [Self]) -> BufMut<'_> {
                BufMut::$v(s)
            }
            fn buf_ref(s: &[Self]) -> BufRef<'_> {
                BufRef::$v(s)
            }
        }
    };
}
comm_elem!(f32, F32);
comm_elem!(f64, F64);
comm_elem!(i64, I64);

macro_rules! dispatch {
    ($dt:expr, $op:expr, $rank:expr, $T:ident => $body:expr) => {
        match $dt {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            d => {
                return Err(Error::invalid(
                    $op,
                    $rank,
                    "tensor",
                    "a float32, float64 or int64 tensor",
                    d,
                ))
            }
        }
    };
}

fn checks_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("TENSORPLAY_COLLECTIVE_CHECK").map_or(true, |v| v != "0" && v != "false")
    })
}

/// The resolved group of one call: the group, this rank in it, and its backend.
struct Call<'a> {
    op: &'static str,
    g: &'a ProcessGroup,
    rank: usize,
    size: usize,
    grank: i64,
}

impl Call<'_> {
    fn err(&self, arg: &str, expected: impl Into<String>, got: impl std::fmt::Display) -> Error {
        Error::invalid(self.op, self.grank, arg, expected, got)
    }

    fn cpu(&self) -> Result<Global<'_>> {
        match &self.g.inner.backend {
            Some(BackendImpl::Cpu(b)) => Ok(self.global(b.as_ref())),
            Some(BackendImpl::Nccl(_)) => Err(self.err(
                "tensor",
                "a CUDA tensor for the nccl backend (use a group with the \"cpu\" backend for host tensors)",
                "a CPU tensor",
            )),
            None => Err(self.not_member()),
        }
    }

    fn not_member(&self) -> Error {
        Error::invalid(
            self.op,
            self.grank,
            "group",
            format!(
                "a group this rank belongs to (members: {:?})",
                self.g.ranks()
            ),
            format!("group {:?} without rank {}", self.g.ranks(), self.grank),
        )
    }

    fn timeout(&self) -> Duration {
        self.g.timeout()
    }

    /// Translates a global root rank into a group rank.
    fn root(&self, arg: &str, global: usize) -> Result<usize> {
        self.g
            .inner
            .ranks
            .iter()
            .position(|&r| r == global)
            .ok_or_else(|| {
                self.err(
                    arg,
                    format!("a global rank in the group {:?}", self.g.ranks()),
                    global,
                )
            })
    }

    /// Checks a host tensor for the cpu backend.
    fn host(&self, arg: &str, t: &Tensor) -> Result<()> {
        if t.device() != Device::Cpu {
            return Err(self.err(
                arg,
                "a CPU tensor for the cpu backend (use the \"nccl\" backend for CUDA tensors)",
                format!("a tensor on {}", t.device()),
            ));
        }
        if !matches!(t.dtype(), DType::F32 | DType::F64 | DType::I64) {
            return Err(self.err(arg, "a float32, float64 or int64 tensor", t.dtype()));
        }
        self.not_differentiable(arg, t)
    }

    /// The blocking collectives are not differentiable: a tensor that requires grad while
    /// gradients are recorded is refused (PyTorch silently acts as the identity in backward,
    /// losing the other ranks' contributions, pytorch/pytorch#121587). Point-to-point calls
    /// (`send`, `recv`) are exempt.
    fn not_differentiable(&self, arg: &str, t: &Tensor) -> Result<()> {
        if matches!(self.op, "send" | "recv" | "isend" | "irecv")
            || !t.requires_grad()
            || !tensorplay_core::autograd::is_grad_enabled()
        {
            return Ok(());
        }
        Err(self.err(
            arg,
            format!(
                "a tensor that does not require grad: the blocking collectives are not differentiable; \
                 use tensorplay::distributed::nn::functional::{} for a collective with a backward, \
                 or call this one on `tensor.detach()` or under `no_grad()`",
                functional_name(self.op)
            ),
            "a tensor that requires grad",
        ))
    }

    /// All ranks' descriptors (one all-gather of `desc`, which has the same length on every rank).
    /// The collective's name travels with it: ranks that called different collectives get an
    /// [`Error::Mismatch`] naming them instead of pairing unrelated descriptors.
    fn exchange(&self, desc: &[i64]) -> Result<Vec<Vec<i64>>> {
        self.exchange_local(desc, Ok(()))
    }

    /// Like [`Call::exchange`], for a rank whose own argument checks gave `local`: it still
    /// takes part (with a flag), so that when one rank alone passes bad arguments every rank
    /// fails this call together — that rank with its own error, the others with an
    /// [`Error::Mismatch`] naming it — and the ranks stay in step for the next call.
    fn exchange_local(&self, desc: &[i64], local: Result<()>) -> Result<Vec<Vec<i64>>> {
        if self.size == 1 {
            local?;
            return Ok(vec![desc.to_vec()]);
        }
        let mut d = vec![
            op_id(self.op),
            phase_id(current_phase()),
            i64::from(local.is_err()),
        ];
        d.extend_from_slice(desc);
        let n = d.len();
        let desc = &d[..];
        let mut out = vec![0i64; n * self.size];
        let counts = vec![n; self.size];
        self.cpu_or_meta()?
            .all_gather(
                BufRef::I64(desc),
                BufMut::I64(&mut out),
                &counts,
                self.timeout(),
            )
            .map_err(|e| match e {
                // name the collective the user called, not the check's internal all_gather
                Error::PeerFailed {
                    rank, peer, detail, ..
                } => Error::PeerFailed {
                    rank,
                    peer,
                    op: format!("{} (while checking arguments across ranks)", self.op),
                    detail: format!("{detail} (did rank {peer} exit or fail?)"),
                },
                Error::Timeout {
                    rank,
                    timeout,
                    detail,
                    ..
                } => Error::Timeout {
                    op: format!("{} (while checking arguments across ranks)", self.op),
                    rank,
                    timeout,
                    detail: format!(
                        "{detail} (did that rank skip this call, for example a backward pass the other ranks run?)"
                    ),
                },
                // the backend's own check: the descriptors differ in length, so the ranks called
                // different collectives
                Error::Mismatch { detail, .. } => Error::Mismatch {
                    op: format!("{} (while checking arguments across ranks)", self.op),
                    detail: format!(
                        "{detail}: the ranks' argument descriptors differ in length (did they \
                         call different collectives?), and this group can no longer be used"
                    ),
                },
                other => other,
            })?;
        let all: Vec<Vec<i64>> = out.chunks(n).map(|c| c.to_vec()).collect();
        agree(self, &all, 0..2, "the collective called", |v| {
            format!("{}{}", op_name(v[0]), phase_name(v[1]))
        })?;
        local?;
        let bad: Vec<usize> = (0..self.size)
            .filter(|&r| all[r][2] != 0)
            .map(|r| self.g.ranks()[r])
            .collect();
        if !bad.is_empty() {
            return Err(Error::Mismatch {
                op: self.op.to_string(),
                detail: format!(
                    "rank(s) {bad:?} rejected their own arguments (their errors say why)"
                ),
            });
        }
        Ok(all.into_iter().map(|mut v| v.split_off(3)).collect())
    }

    fn cpu_or_meta(&self) -> Result<Global<'_>> {
        match &self.g.inner.backend {
            Some(BackendImpl::Cpu(b)) => Ok(self.global(b.as_ref())),
            Some(BackendImpl::Nccl(n)) => Ok(self.global(n.meta())),
            None => Err(self.not_member()),
        }
    }

    fn global<'b>(&'b self, b: &'b dyn Backend) -> Global<'b> {
        Global {
            b,
            ranks: self.g.ranks(),
        }
    }
}

/// A backend whose errors name global ranks: the backends number the ranks of a group
/// `0..size`, which in a subgroup are not the ranks the user knows (`new_group(&[0, 2])`: the
/// backend's rank 1 is global rank 2).
#[derive(Clone, Copy)]
struct Global<'a> {
    b: &'a dyn Backend,
    /// Global rank of each group rank.
    ranks: &'a [usize],
}

impl Global<'_> {
    fn rank(&self, r: usize) -> usize {
        self.ranks.get(r).copied().unwrap_or(r)
    }

    /// `text` with every "rank N" (a group rank) renamed to the global rank.
    fn text(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        while let Some(i) = rest.find("rank ") {
            let (head, tail) = rest.split_at(i + "rank ".len());
            out.push_str(head);
            let n = tail.bytes().take_while(u8::is_ascii_digit).count();
            match tail[..n].parse::<usize>() {
                Ok(r) => out.push_str(&self.rank(r).to_string()),
                Err(_) => out.push_str(&tail[..n]),
            }
            rest = &tail[n..];
        }
        out.push_str(rest);
        out
    }

    fn err(&self, e: Error) -> Error {
        match e {
            Error::Timeout {
                op,
                rank,
                timeout,
                detail,
            } => Error::Timeout {
                op,
                rank: usize::try_from(rank).map_or(rank, |r| self.rank(r) as i64),
                timeout,
                detail: self.text(&detail),
            },
            Error::PeerFailed {
                rank,
                peer,
                op,
                detail,
            } => Error::PeerFailed {
                rank: self.rank(rank),
                peer: self.rank(peer),
                op,
                detail: self.text(&detail),
            },
            Error::Mismatch { op, detail } => Error::Mismatch {
                op,
                detail: self.text(&detail),
            },
            Error::Backend { backend, detail } => Error::Backend {
                backend,
                detail: self.text(&detail),
            },
            Error::InvalidArgument {
                op,
                rank,
                arg,
                expected,
                got,
            } => Error::InvalidArgument {
                op,
                rank: usize::try_from(rank).map_or(rank, |r| self.rank(r) as i64),
                arg,
                expected,
                got,
            },
            other => other,
        }
    }
}

impl Backend for Global<'_> {
    fn name(&self) -> &'static str {
        self.b.name()
    }
    fn rank(&self) -> usize {
        self.b.rank()
    }
    fn size(&self) -> usize {
        self.b.size()
    }
    fn all_reduce(&self, data: BufMut<'_>, op: ReduceOp, timeout: Duration) -> Result<()> {
        self.b
            .all_reduce(data, op, timeout)
            .map_err(|e| self.err(e))
    }
    fn broadcast(&self, data: BufMut<'_>, root: usize, timeout: Duration) -> Result<()> {
        self.b
            .broadcast(data, root, timeout)
            .map_err(|e| self.err(e))
    }
    fn reduce(&self, data: BufMut<'_>, op: ReduceOp, root: usize, timeout: Duration) -> Result<()> {
        self.b
            .reduce(data, op, root, timeout)
            .map_err(|e| self.err(e))
    }
    fn all_gather(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        counts: &[usize],
        timeout: Duration,
    ) -> Result<()> {
        self.b
            .all_gather(input, output, counts, timeout)
            .map_err(|e| self.err(e))
    }
    fn reduce_scatter(
        &self,
        input: BufRef<'_>,
        output: BufMut<'_>,
        op: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        self.b
            .reduce_scatter(input, output, op, timeout)
            .map_err(|e| self.err(e))
    }
    fn gather(
        &self,
        input: BufRef<'_>,
        output: Option<BufMut<'_>>,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()> {
        self.b
            .gather(input, output, counts, root, timeout)
            .map_err(|e| self.err(e))
    }
    fn scatter(
        &self,
        input: Option<BufRef<'_>>,
        output: BufMut<'_>,
        counts: &[usize],
        root: usize,
        timeout: Duration,
    ) -> Result<()> {
        self.b
            .scatter(input, output, counts, root, timeout)
            .map_err(|e| self.err(e))
    }
    fn all_to_all(
        &self,
        input: BufRef<'_>,
        send_counts: &[usize],
        output: BufMut<'_>,
        recv_counts: &[usize],
        timeout: Duration,
    ) -> Result<()> {
        self.b
            .all_to_all(input, send_counts, output, recv_counts, timeout)
            .map_err(|e| self.err(e))
    }
    fn send(&self, data: BufRef<'_>, dst: usize, tag: u64, timeout: Duration) -> Result<()> {
        self.b
            .send(data, dst, tag, timeout)
            .map_err(|e| self.err(e))
    }
    fn recv(&self, data: BufMut<'_>, src: usize, tag: u64, timeout: Duration) -> Result<()> {
        self.b
            .recv(data, src, tag, timeout)
            .map_err(|e| self.err(e))
    }
    fn barrier(&self, timeout: Duration) -> Result<()> {
        self.b.barrier(timeout).map_err(|e| self.err(e))
    }
    fn bytes_sent(&self) -> u64 {
        self.b.bytes_sent()
    }
}

thread_local! {
    static PHASE: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the collectives it issues on this thread marked as belonging to `phase` (for
/// example `"backward"`; up to 8 ASCII bytes are compared and shown): the cross-rank check then
/// also compares phases, so that a rank in a backward pass never pairs its collective with
/// another rank's forward collective of the same shape (which would silently mix their data).
/// The innermost phase wins; the layers above use this, users rarely need to.
pub fn with_phase<R>(phase: &'static str, f: impl FnOnce() -> R) -> R {
    let prev = PHASE.with(|p| p.replace(Some(phase)));
    let r = f();
    PHASE.with(|p| p.set(prev));
    r
}

fn current_phase() -> Option<&'static str> {
    PHASE.with(std::cell::Cell::get)
}

/// A phase as carried in the descriptor: its first 8 bytes, packed (0 for none), so that
/// every process can name it.
fn phase_id(phase: Option<&'static str>) -> i64 {
    let Some(p) = phase else { return 0 };
    let mut b = [0u8; 8];
    for (d, s) in b.iter_mut().zip(p.bytes()) {
        *d = s;
    }
    i64::from_le_bytes(b)
}

fn phase_name(id: i64) -> String {
    if id == 0 {
        return String::new();
    }
    let b = id.to_le_bytes();
    let n = b.iter().position(|&c| c == 0).unwrap_or(8);
    format!(" (in {})", String::from_utf8_lossy(&b[..n]))
}

/// The name of the differentiable counterpart of a blocking collective.
fn functional_name(op: &str) -> &str {
    match op {
        "all_gather_into_tensor" => "all_gather",
        "reduce_scatter_tensor" => "reduce_scatter",
        o => o,
    }
}

/// The collectives that exchange descriptors, by id.
const OP_NAMES: &[&str] = &[
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
];
fn op_id(op: &str) -> i64 {
    // the list form of reduce_scatter runs reduce_scatter_tensor's exchange
    let op = if op == "reduce_scatter" {
        "reduce_scatter_tensor"
    } else {
        op
    };
    match OP_NAMES.iter().position(|&o| o == op) {
        Some(i) => i as i64,
        None => {
            // other callers of the exchange (`all_gather_metadata`): a stable hash of the name,
            // remembered so that a mismatch can be reported by name
            let h = op.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
            let id = 1000 + (h % 1_000_000_000) as i64;
            let mut names = EXTRA_OPS.lock().unwrap_or_else(|e| e.into_inner());
            if !names.iter().any(|(i, _)| *i == id) {
                names.push((id, op.to_string()));
            }
            id
        }
    }
}

static EXTRA_OPS: std::sync::Mutex<Vec<(i64, String)>> = std::sync::Mutex::new(Vec::new());

/// The name of an exchange id (see [`op_id`]).
fn op_name(id: i64) -> String {
    if let Some(n) = usize::try_from(id).ok().and_then(|i| OP_NAMES.get(i)) {
        return (*n).to_string();
    }
    let names = EXTRA_OPS.lock().unwrap_or_else(|e| e.into_inner());
    names
        .iter()
        .find(|(i, _)| *i == id)
        .map_or_else(|| format!("another collective (#{id})"), |(_, n)| n.clone())
}

/// All-gathers a short `i64` vector (metadata: shapes, split sizes, flags) from every rank of
/// `group` (the default group for `None`); returns one vector per group rank, in group-rank
/// order. Every rank must pass a vector of the same length.
///
/// `op` names the caller's operation; ranks calling different operations fail with
/// [`Error::Mismatch`] — and the group stays usable — when their descriptors have the same
/// length; descriptors of different lengths also fail the call on every rank with an
/// [`Error::Mismatch`], but the backend then shuts the group down. A rank whose own argument checks failed passes them as `local`: it
/// still takes part, so that every rank fails together — that rank with its own error, the
/// others with an [`Error::Mismatch`] naming it — and the ranks stay in step. This is how the
/// layers above (the differentiable collectives) agree on shapes before moving data; it runs in
/// the group's collective order and honours the group's timeout (an [`Error::Timeout`] naming
/// the rank that did not arrive). With one rank it returns `[desc]` without communicating.
///
/// # Errors
/// [`Error::NotInitialized`] without a default group, [`Error::InvalidArgument`] when this rank
/// is not in `group`, `local`'s error, [`Error::Mismatch`], [`Error::Timeout`],
/// [`Error::PeerFailed`].
pub fn all_gather_metadata(
    op: &'static str,
    desc: &[i64],
    local: Result<()>,
    group: Option<&ProcessGroup>,
) -> Result<Vec<Vec<i64>>> {
    let g = resolve(group, op)?;
    g.inner.seq.clone().run_blocking(g.timeout(), op, || {
        call(&g, op)?.exchange_local(desc, local)
    })
}

fn resolve(group: Option<&ProcessGroup>, op: &'static str) -> Result<ProcessGroup> {
    match group {
        Some(g) => Ok(g.clone()),
        None => default_group(op),
    }
}

fn call<'a>(g: &'a ProcessGroup, op: &'static str) -> Result<Call<'a>> {
    let grank = g.my_global_rank() as i64;
    let rank = g.inner.group_rank.ok_or_else(|| {
        Error::invalid(
            op,
            grank,
            "group",
            format!("a group this rank belongs to (members: {:?})", g.ranks()),
            format!("group {:?} without rank {grank}", g.ranks()),
        )
    })?;
    Ok(Call {
        op,
        g,
        rank,
        size: g.size(),
        grank,
    })
}

fn dtype_code(d: DType) -> i64 {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::I64 => 2,
        DType::Bool => 3,
    }
}
fn dtype_name(c: i64) -> &'static str {
    match c {
        0 => "float32",
        1 => "float64",
        2 => "int64",
        _ => "bool",
    }
}
fn op_code(op: ReduceOp) -> i64 {
    op as i64
}
/// The name of an [`op_code`], for errors.
fn op_label(code: i64) -> String {
    const OPS: [ReduceOp; 8] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::BAnd,
        ReduceOp::BOr,
        ReduceOp::BXor,
    ];
    OPS.iter()
        .find(|&&op| op_code(op) == code)
        .map_or_else(|| format!("#{code}"), |op| format!("{op:?}"))
}

const MAX_DIMS: usize = 8;

/// Length of a [`shape_desc`].
const DESC: usize = 3 + MAX_DIMS;

/// `[dtype, ndim, dims (padded with -1), tail]`. A tensor of more than `MAX_DIMS` dims has
/// the product of its dims from `MAX_DIMS - 1` on in the last dim slot (so the element count
/// stays right) and a hash of those dims in `tail` (0 otherwise), so that shapes still compare
/// exactly.
fn shape_desc(t: &Tensor) -> Vec<i64> {
    let mut v = vec![dtype_code(t.dtype()), t.ndim() as i64];
    for i in 0..MAX_DIMS {
        v.push(t.shape().get(i).map_or(-1, |&d| d as i64));
    }
    let mut tail = 0;
    if t.ndim() > MAX_DIMS {
        let folded = &t.shape()[MAX_DIMS - 1..];
        v[1 + MAX_DIMS] = folded.iter().product::<usize>() as i64;
        let h = folded.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &d| {
            (h ^ d as u64).wrapping_mul(0x0100_0000_01b3)
        });
        tail = (h >> 1) as i64;
    }
    v.push(tail);
    v
}
fn fmt_shape(d: &[i64]) -> String {
    let nd = d[1].max(0) as usize;
    let dims: Vec<String> = d[2..2 + nd.min(MAX_DIMS)]
        .iter()
        .map(|&x| (x as u64).to_string())
        .collect();
    let folded = if nd > MAX_DIMS {
        format!(
            " ({nd} dims: the last is the product of dims {}.., shape hash {:x})",
            MAX_DIMS - 1,
            d[DESC - 1]
        )
    } else {
        String::new()
    };
    format!("{} [{}]{folded}", dtype_name(d[0]), dims.join(", "))
}

/// Errors on every rank when field `range` of the descriptors differs across ranks.
fn agree(
    c: &Call<'_>,
    all: &[Vec<i64>],
    range: std::ops::Range<usize>,
    what: &str,
    fmt: impl Fn(&[i64]) -> String,
) -> Result<()> {
    let first = &all[0][range.clone()];
    if all.iter().all(|d| &d[range.clone()] == first) {
        return Ok(());
    }
    let per: Vec<String> = all
        .iter()
        .enumerate()
        .map(|(r, d)| format!("rank {} passed {}", c.g.ranks()[r], fmt(&d[range.clone()])))
        .collect();
    Err(Error::Mismatch {
        op: c.op.to_string(),
        detail: format!("{what} must agree across ranks: {}", per.join("; ")),
    })
}

// ---------------------------------------------------------------------------------------------
// host buffers for tensors (contiguous fast path, strided views through a copy)

fn read_host<T: CommElem, R>(t: &Tensor, f: impl FnOnce(BufRef<'_>) -> Result<R>) -> Result<R> {
    if let Some(r) = t.layout().contiguous_range() {
        return t.with_cpu_data(|s: &[T], _| f(T::buf_ref(&s[r])))?;
    }
    let v: Vec<T> = t.with_cpu_data(|s: &[T], l| {
        let mut v = Vec::with_capacity(l.numel());
        l.for_each_offset(|o| v.push(s[o]));
        v
    })?;
    f(T::buf_ref(&v))
}

fn check_writable(c: &Call<'_>, arg: &str, t: &Tensor) -> Result<()> {
    let l = t.layout();
    if l.shape()
        .iter()
        .zip(l.strides())
        .any(|(&n, &s)| n > 1 && s == 0)
    {
        return Err(c.err(
            arg,
            "a tensor whose elements do not overlap in memory (not an expanded view); call contiguous() first",
            format!("shape {:?} with strides {:?}", l.shape(), l.strides()),
        ));
    }
    Ok(())
}

fn write_host<T: CommElem, R>(t: &Tensor, f: impl FnOnce(BufMut<'_>) -> Result<R>) -> Result<R> {
    if let Some(r) = t.layout().contiguous_range() {
        return t.with_cpu_data_mut(|s: &mut [T], _| f(T::buf_mut(&mut s[r])))?;
    }
    // strided: work on a row-major copy, then write back only the view's elements
    let mut v: Vec<T> = t.with_cpu_data(|s: &[T], l| {
        let mut v = Vec::with_capacity(l.numel());
        l.for_each_offset(|o| v.push(s[o]));
        v
    })?;
    let r = f(T::buf_mut(&mut v))?;
    t.with_cpu_data_mut(|s: &mut [T], l| {
        let mut it = v.iter();
        l.for_each_offset(|o| {
            if let Some(x) = it.next() {
                s[o] = *x;
            }
        });
    })?;
    Ok(r)
}

/// A row-major copy of `t`'s elements.
fn host_vec<T: CommElem>(t: &Tensor) -> Result<Vec<T>> {
    Ok(t.to_vec::<T>()?)
}

/// Divides by the group size (for `ReduceOp::Avg`, reduced as a sum).
fn finish_avg<T: CommElem>(b: &mut BufMut<'_>, size: usize) {
    match b {
        BufMut::F32(s) => s.iter_mut().for_each(|x| *x /= size as f32),
        BufMut::F64(s) => s.iter_mut().for_each(|x| *x /= size as f64),
        BufMut::I64(_) => {}
    }
    let _ = std::marker::PhantomData::<T>;
}

fn check_op(c: &Call<'_>, op: ReduceOp, dt: DType) -> Result<()> {
    let ok = match op {
        ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor => dt == DType::I64,
        ReduceOp::Avg => dt.is_float(),
        _ => true,
    };
    if !ok {
        return Err(c.err(
            "op",
            if dt.is_float() {
                "Sum, Product, Min, Max or Avg for floating tensors"
            } else {
                "Sum, Product, Min, Max, BAnd, BOr or BXor for int64 tensors"
            },
            format!("{op:?} on {dt}"),
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// the collectives

/// The job of an `_async` collective, run on the group's worker thread under the grad mode and
/// the phase of the thread that called it (both are per thread): the refusal of tensors that
/// require grad must see the caller's `no_grad()`, and the cross-rank check the caller's
/// [`with_phase`].
fn callers_grad_mode(
    f: impl FnOnce() -> Result<()> + Send + 'static,
) -> Box<dyn FnOnce() -> Result<()> + Send> {
    let enabled = tensorplay_core::autograd::is_grad_enabled();
    let phase = current_phase();
    Box::new(move || {
        let _mode = tensorplay_core::autograd::set_grad_enabled(enabled);
        match phase {
            Some(p) => with_phase(p, f),
            None => f(),
        }
    })
}

/// In-place all-reduce (`dist.all_reduce(tensor, op, group)`): every rank's `tensor` becomes the
/// reduction over ranks. Avg is for floating dtypes, bitwise ops for int64.
pub fn all_reduce(tensor: &Tensor, op: ReduceOp, group: Option<&ProcessGroup>) -> Result<()> {
    let g = resolve(group, "all_reduce")?;
    let t = tensor.clone();
    g.inner
        .seq
        .clone()
        .run_blocking(g.timeout(), "all_reduce", || all_reduce_impl(&g, &t, op))
}

/// [`all_reduce`] with `async_op=True`: returns a [`Work`] to wait on.
pub fn all_reduce_async(
    tensor: &Tensor,
    op: ReduceOp,
    group: Option<&ProcessGroup>,
) -> Result<Work> {
    let g = resolve(group, "all_reduce")?;
    let t = tensor.clone();
    let g2 = g.clone();
    g.inner.seq.submit(
        g.timeout(),
        "all_reduce",
        callers_grad_mode(move || all_reduce_impl(&g2, &t, op)),
    )
}

fn all_reduce_impl(g: &ProcessGroup, t: &Tensor, op: ReduceOp) -> Result<()> {
    let c = call(g, "all_reduce")?;
    if let Some(BackendImpl::Nccl(n)) = &g.inner.backend {
        return n.all_reduce(&c.grank, t, op, c.timeout());
    }
    let local = c
        .host("tensor", t)
        .and_then(|_| check_writable(&c, "tensor", t))
        .and_then(|_| check_op(&c, op, t.dtype()));
    if !checks_enabled() {
        local?;
    } else {
        let mut d = shape_desc(t);
        d.push(op_code(op));
        let all = c.exchange_local(&d, local)?;
        agree(&c, &all, 0..DESC, "dtype and shape", fmt_shape)?;
        agree(&c, &all, DESC..DESC + 1, "the reduce op", |v| {
            format!("op {}", op_label(v[0]))
        })?;
    }
    let b = c.cpu()?;
    dispatch!(t.dtype(), "all_reduce", c.grank, T => write_host::<T, ()>(t, |mut buf| {
        b.all_reduce(buf.slice_mut(0..buf.len()), op, c.timeout())?;
        if op == ReduceOp::Avg {
            finish_avg::<T>(&mut buf, c.size);
        }
        Ok(())
    }))
}

/// In-place broadcast from global rank `src` (`dist.broadcast`).
pub fn broadcast(tensor: &Tensor, src: usize, group: Option<&ProcessGroup>) -> Result<()> {
    let g = resolve(group, "broadcast")?;
    g.inner
        .seq
        .clone()
        .run_blocking(g.timeout(), "broadcast", || broadcast_impl(&g, tensor, src))
}

/// [`broadcast`] with `async_op=True`.
pub fn broadcast_async(tensor: &Tensor, src: usize, group: Option<&ProcessGroup>) -> Result<Work> {
    let g = resolve(group, "broadcast")?;
    let (t, g2) = (tensor.clone(), g.clone());
    g.inner.seq.submit(
        g.timeout(),
        "broadcast",
        callers_grad_mode(move || broadcast_impl(&g2, &t, src)),
    )
}

fn broadcast_impl(g: &ProcessGroup, t: &Tensor, src: usize) -> Result<()> {
    let c = call(g, "broadcast")?;
    let root = c.root("src", src);
    if let Some(BackendImpl::Nccl(n)) = &g.inner.backend {
        return n.broadcast(&c.grank, t, root?, c.timeout());
    }
    let local = root
        .as_ref()
        .map(|_| ())
        .map_err(Clone::clone)
        .and_then(|_| c.host("tensor", t))
        .and_then(|_| check_writable(&c, "tensor", t));
    if !checks_enabled() {
        local?;
    } else {
        let mut d = shape_desc(t);
        d.push(src as i64);
        let all = c.exchange_local(&d, local)?;
        agree(&c, &all, 0..DESC, "dtype and shape", fmt_shape)?;
        agree(&c, &all, DESC..DESC + 1, "src", |v| format!("src {}", v[0]))?;
    }
    let root = root?;
    let b = c.cpu()?;
    dispatch!(t.dtype(), "broadcast", c.grank, T => write_host::<T, ()>(t, |buf| b.broadcast(buf, root, c.timeout())))
}

/// Reduces every rank's `tensor` into global rank `dst`'s `tensor` (`dist.reduce`); the other
/// ranks' tensors are left unchanged (PyTorch leaves partial results there).
pub fn reduce(
    tensor: &Tensor,
    dst: usize,
    op: ReduceOp,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let g = resolve(group, "reduce")?;
    g.inner.seq.clone().run_blocking(g.timeout(), "reduce", || {
        let c = call(&g, "reduce")?;
        let root = c.root("dst", dst);
        if let Some(BackendImpl::Nccl(n)) = &g.inner.backend {
            return n.reduce(&c.grank, tensor, op, root?, c.timeout());
        }
        let local = root
            .as_ref()
            .map(|_| ())
            .map_err(Clone::clone)
            .and_then(|_| c.host("tensor", tensor))
            .and_then(|_| check_writable(&c, "tensor", tensor))
            .and_then(|_| check_op(&c, op, tensor.dtype()));
        if !checks_enabled() {
            local?;
        } else {
            let mut d = shape_desc(tensor);
            d.extend([dst as i64, op_code(op)]);
            let all = c.exchange_local(&d, local)?;
            agree(&c, &all, 0..DESC, "dtype and shape", fmt_shape)?;
            agree(&c, &all, DESC..DESC + 2, "dst and op", |v| {
                format!("dst {} op {}", v[0], op_label(v[1]))
            })?;
        }
        let root = root?;
        let b = c.cpu()?;
        dispatch!(tensor.dtype(), "reduce", c.grank, T => write_host::<T, ()>(tensor, |mut buf| {
            b.reduce(buf.slice_mut(0..buf.len()), op, root, c.timeout())?;
            if op == ReduceOp::Avg && c.rank == root {
                finish_avg::<T>(&mut buf, c.size);
            }
            Ok(())
        }))
    })
}

/// Every rank's `tensor` is written into `tensor_list[r]` on every rank (`dist.all_gather`).
/// `tensor_list` has one tensor per rank of the group; rank `r`'s input may have its own
/// shape, and `tensor_list[r]` must have that shape.
pub fn all_gather(
    tensor_list: &[Tensor],
    tensor: &Tensor,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let g = resolve(group, "all_gather")?;
    g.inner.seq.clone().run_blocking(g.timeout(), "all_gather", || {
        let c = call(&g, "all_gather")?;
        c.host("tensor", tensor)?;
        if tensor_list.len() != c.size {
            return Err(c.err("tensor_list", format!("{} tensors (one per rank)", c.size), tensor_list.len()));
        }
        for (r, o) in tensor_list.iter().enumerate() {
            c.host(&format!("tensor_list[{r}]"), o)?;
            check_writable(&c, &format!("tensor_list[{r}]"), o)?;
        }
        let all = c.exchange(&shape_desc(tensor))?;
        agree(&c, &all, 0..1, "dtype", |v| dtype_name(v[0]).to_string())?;
        for (r, o) in tensor_list.iter().enumerate() {
            if shape_desc(o) != all[r] {
                return Err(c.err(
                    &format!("tensor_list[{r}]"),
                    format!("the shape rank {} passed: {}", c.g.ranks()[r], fmt_shape(&all[r])),
                    fmt_shape(&shape_desc(o)),
                ));
            }
        }
        let counts: Vec<usize> = tensor_list.iter().map(|o| o.numel()).collect();
        let b = c.cpu()?;
        dispatch!(tensor.dtype(), "all_gather", c.grank, T => {
            let total: usize = counts.iter().sum();
            let mut out = vec![T::default(); total];
            read_host::<T, ()>(tensor, |inp| b.all_gather(inp, T::buf_mut(&mut out), &counts, c.timeout()))?;
            let mut off = 0;
            for (o, &n) in tensor_list.iter().zip(&counts) {
                let block = &out[off..off + n];
                write_host::<T, ()>(o, |mut dst| {
                    copy_into::<T>(&mut dst, block);
                    Ok(())
                })?;
                off += n;
            }
            Ok(())
        })
    })
}

fn copy_into<T: CommElem>(dst: &mut BufMut<'_>, src: &[T]) {
    let bytes = T::buf_ref(src).as_bytes();
    dst.as_bytes_mut().copy_from_slice(bytes);
}

/// Gathers every rank's `input` into `output`, concatenated along the first dimension in rank
/// order (`dist.all_gather_into_tensor`); `output` has `size * input.numel()` elements
/// (shape `[size * d0, ...]` or `[size, d0, ...]`). `input` may be a view into `output`.
pub fn all_gather_into_tensor(
    output: &Tensor,
    input: &Tensor,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let g = resolve(group, "all_gather_into_tensor")?;
    g.inner
        .seq
        .clone()
        .run_blocking(g.timeout(), "all_gather_into_tensor", || {
            agit_impl(&g, output, input)
        })
}

/// [`all_gather_into_tensor`] with `async_op=True`.
pub fn all_gather_into_tensor_async(
    output: &Tensor,
    input: &Tensor,
    group: Option<&ProcessGroup>,
) -> Result<Work> {
    let g = resolve(group, "all_gather_into_tensor")?;
    let (o, i, g2) = (output.clone(), input.clone(), g.clone());
    g.inner.seq.submit(
        g.timeout(),
        "all_gather_into_tensor",
        callers_grad_mode(move || agit_impl(&g2, &o, &i)),
    )
}

fn agit_impl(g: &ProcessGroup, output: &Tensor, input: &Tensor) -> Result<()> {
    let c = call(g, "all_gather_into_tensor")?;
    if let Some(BackendImpl::Nccl(n)) = &g.inner.backend {
        return n.all_gather_into_tensor(&c.grank, output, input, c.timeout());
    }
    let local = c
        .host("input", input)
        .and_then(|_| c.host("output", output))
        .and_then(|_| check_writable(&c, "output", output))
        .and_then(|_| agit_sizes(&c, output, input));
    if !checks_enabled() {
        local?;
    } else {
        let all = c.exchange_local(&shape_desc(input), local)?;
        agree(&c, &all, 0..DESC, "input dtype and shape", fmt_shape)?;
    }
    agit_run(&c, output, input)
}

fn agit_sizes(c: &Call<'_>, output: &Tensor, input: &Tensor) -> Result<()> {
    if output.dtype() != input.dtype() || output.numel() != input.numel() * c.size {
        return Err(c.err(
            "output",
            format!(
                "{} with {} elements (world {} x input {})",
                input.dtype(),
                input.numel() * c.size,
                c.size,
                input.numel()
            ),
            format!("{} with {} elements", output.dtype(), output.numel()),
        ));
    }
    Ok(())
}

fn agit_run(c: &Call<'_>, output: &Tensor, input: &Tensor) -> Result<()> {
    let counts = vec![input.numel(); c.size];
    let b = c.cpu()?;
    dispatch!(input.dtype(), "all_gather_into_tensor", c.grank, T => {
        if input.shares_storage_with(output) {
            let v = host_vec::<T>(input)?;
            write_host::<T, ()>(output, |out| b.all_gather(T::buf_ref(&v), out, &counts, c.timeout()))
        } else {
            write_host::<T, ()>(output, |out| read_host::<T, ()>(input, |inp| b.all_gather(inp, out, &counts, c.timeout())))
        }
    })
}

/// Reduces `input_list[r]` over ranks into rank `r`'s `output` (`dist.reduce_scatter`); all
/// tensors have `output`'s shape.
pub fn reduce_scatter(
    output: &Tensor,
    input_list: &[Tensor],
    op: ReduceOp,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let g = resolve(group, "reduce_scatter")?;
    g.inner
        .seq
        .clone()
        .run_blocking(g.timeout(), "reduce_scatter", || {
            let c = call(&g, "reduce_scatter")?;
            let pre = (|| {
                if input_list.len() != c.size {
                    return Err(c.err(
                        "input_list",
                        format!("{} tensors (one per rank)", c.size),
                        input_list.len(),
                    ));
                }
                for (r, t) in input_list.iter().enumerate() {
                    if t.shape() != output.shape() || t.dtype() != output.dtype() {
                        return Err(c.err(
                            &format!("input_list[{r}]"),
                            format!("output's {} {:?}", output.dtype(), output.shape()),
                            format!("{} {:?}", t.dtype(), t.shape()),
                        ));
                    }
                }
                Ok(())
            })();
            if let Err(e) = pre {
                // still join the cross-rank check, so that every rank fails this call
                return rs_impl(&c, output, output, op, Err(e));
            }
            let parts = input_list
                .iter()
                .map(|t| t.reshape(&[t.numel()]))
                .collect::<std::result::Result<Vec<_>, _>>()?;
            let flat = Tensor::cat(&parts, 0)?;
            rs_impl(&c, output, &flat, op, Ok(()))
        })
}

/// Reduces `input` (`size * output.numel()` elements, blocks in rank order) over ranks and
/// leaves block `rank` in `output` (`dist.reduce_scatter_tensor`).
pub fn reduce_scatter_tensor(
    output: &Tensor,
    input: &Tensor,
    op: ReduceOp,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let g = resolve(group, "reduce_scatter_tensor")?;
    g.inner
        .seq
        .clone()
        .run_blocking(g.timeout(), "reduce_scatter_tensor", || {
            let c = call(&g, "reduce_scatter_tensor")?;
            if let Some(BackendImpl::Nccl(n)) = &g.inner.backend {
                return n.reduce_scatter_tensor(&c.grank, output, input, op, c.timeout());
            }
            rs_impl(&c, output, input, op, Ok(()))
        })
}

/// [`reduce_scatter_tensor`] with `async_op=True`.
pub fn reduce_scatter_tensor_async(
    output: &Tensor,
    input: &Tensor,
    op: ReduceOp,
    group: Option<&ProcessGroup>,
) -> Result<Work> {
    let g = resolve(group, "reduce_scatter_tensor")?;
    let (o, i, g2) = (output.clone(), input.clone(), g.clone());
    g.inner.seq.submit(
        g.timeout(),
        "reduce_scatter_tensor",
        callers_grad_mode(move || {
            let c = call(&g2, "reduce_scatter_tensor")?;
            if let Some(BackendImpl::Nccl(n)) = &g2.inner.backend {
                return n.reduce_scatter_tensor(&c.grank, &o, &i, op, c.timeout());
            }
            rs_impl(&c, &o, &i, op, Ok(()))
        }),
    )
}

fn rs_impl(
    c: &Call<'_>,
    output: &Tensor,
    input: &Tensor,
    op: ReduceOp,
    pre: Result<()>,
) -> Result<()> {
    let local = pre
        .and_then(|_| c.host("input", input))
        .and_then(|_| c.host("output", output))
        .and_then(|_| check_writable(c, "output", output))
        .and_then(|_| check_op(c, op, input.dtype()))
        .and_then(|_| rs_sizes(c, output, input));
    if !checks_enabled() {
        local?;
    } else {
        let mut d = shape_desc(output);
        d.push(op_code(op));
        let all = c.exchange_local(&d, local)?;
        agree(c, &all, 0..DESC, "output dtype and shape", fmt_shape)?;
        agree(c, &all, DESC..DESC + 1, "the reduce op", |v| {
            format!("op {}", op_label(v[0]))
        })?;
    }
    rs_run(c, output, input, op)
}

fn rs_sizes(c: &Call<'_>, output: &Tensor, input: &Tensor) -> Result<()> {
    if output.dtype() != input.dtype() || input.numel() != output.numel() * c.size {
        return Err(c.err(
            "input",
            format!(
                "{} with {} elements (world {} x output {})",
                output.dtype(),
                output.numel() * c.size,
                c.size,
                output.numel()
            ),
            format!("{} with {} elements", input.dtype(), input.numel()),
        ));
    }
    Ok(())
}

fn rs_run(c: &Call<'_>, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<()> {
    let b = c.cpu()?;
    dispatch!(input.dtype(), c.op, c.grank, T => {
        let run = |inp: BufRef<'_>| {
            write_host::<T, ()>(output, |mut out| {
                b.reduce_scatter(inp, out.slice_mut(0..out.len()), op, c.timeout())?;
                if op == ReduceOp::Avg {
                    finish_avg::<T>(&mut out, c.size);
                }
                Ok(())
            })
        };
        if input.shares_storage_with(output) {
            // the output is a view of the input: copy the input so the two locks never nest
            let inp = host_vec::<T>(input)?;
            run(T::buf_ref(&inp))
        } else {
            read_host::<T, ()>(input, run)
        }
    })
}

/// Gathers every rank's `tensor` into `gather_list` on global rank `dst` (`dist.gather`).
/// `gather_list` is required on `dst` (one tensor per rank, each of that rank's input shape)
/// and ignored elsewhere.
pub fn gather(
    tensor: &Tensor,
    gather_list: Option<&[Tensor]>,
    dst: usize,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let g = resolve(group, "gather")?;
    g.inner.seq.clone().run_blocking(g.timeout(), "gather", || {
        let c = call(&g, "gather")?;
        let root = c.root("dst", dst)?;
        c.host("tensor", tensor)?;
        // descriptor: own input shape, dst, whether the list on dst is usable, and (on dst) the
        // list's shapes, so that a bad gather_list is an error on every rank, not only on dst
        let w = DESC;
        let mut d = shape_desc(tensor);
        d.push(dst as i64);
        let mut local_err = None;
        if c.rank == root {
            let checked = (|| -> Result<&[Tensor]> {
                let list = gather_list.ok_or_else(|| c.err("gather_list", format!("{} tensors on the destination rank", c.size), "None"))?;
                if list.len() != c.size {
                    return Err(c.err("gather_list", format!("{} tensors (one per rank)", c.size), list.len()));
                }
                for (r, o) in list.iter().enumerate() {
                    c.host(&format!("gather_list[{r}]"), o)?;
                    check_writable(&c, &format!("gather_list[{r}]"), o)?;
                }
                Ok(list)
            })();
            match checked {
                Ok(list) => {
                    d.push(1);
                    list.iter().for_each(|o| d.extend_from_slice(&shape_desc(o)[..w]));
                }
                Err(e) => {
                    d.push(0);
                    d.extend(std::iter::repeat_n(0, c.size * w));
                    local_err = Some(e);
                }
            }
        } else {
            d.push(1);
            d.extend(std::iter::repeat_n(0, c.size * w));
        }
        let all = c.exchange(&d)?;
        agree(&c, &all, 0..1, "dtype", |v| dtype_name(v[0]).to_string())?;
        agree(&c, &all, w..w + 1, "dst", |v| format!("dst {}", v[0]))?;
        let rd = &all[root];
        if rd[w + 1] == 0 {
            return Err(local_err.unwrap_or_else(|| Error::Mismatch {
                op: "gather".into(),
                detail: format!("the destination rank {dst} passed no usable gather_list of {} tensors", c.size),
            }));
        }
        for r in 0..c.size {
            let listed = &rd[w + 2 + r * w..w + 2 + (r + 1) * w];
            if listed != &all[r][..w] {
                return Err(Error::Mismatch {
                    op: "gather".into(),
                    detail: format!(
                        "gather_list[{r}] on the destination rank {dst} is {} but rank {} passed {}",
                        fmt_shape(listed), c.g.ranks()[r], fmt_shape(&all[r])
                    ),
                });
            }
        }
        let counts: Vec<usize> = all.iter().map(|d| numel_of(d)).collect();
        let b = c.cpu()?;
        if c.rank == root {
            let list = gather_list.unwrap_or(&[]);
            dispatch!(tensor.dtype(), "gather", c.grank, T => {
                let mut out = vec![T::default(); counts.iter().sum()];
                read_host::<T, ()>(tensor, |inp| b.gather(inp, Some(T::buf_mut(&mut out)), &counts, root, c.timeout()))?;
                let mut off = 0;
                for (o, &n) in list.iter().zip(&counts) {
                    let block = &out[off..off + n];
                    write_host::<T, ()>(o, |mut dst| { copy_into::<T>(&mut dst, block); Ok(()) })?;
                    off += n;
                }
                Ok(())
            })
        } else {
            dispatch!(tensor.dtype(), "gather", c.grank, T => read_host::<T, ()>(tensor, |inp| b.gather(inp, None, &counts, root, c.timeout())))
        }
    })
}

/// Sends `scatter_list[r]` of global rank `src` to rank `r`'s `tensor` (`dist.scatter`).
/// `scatter_list` is required on `src` (one tensor per rank, of that rank's `tensor` shape);
/// other ranks pass `None`.
pub fn scatter(
    tensor: &Tensor,
    scatter_list: Option<&[Tensor]>,
    src: usize,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let g = resolve(group, "scatter")?;
    g.inner.seq.clone().run_blocking(g.timeout(), "scatter", || {
        let c = call(&g, "scatter")?;
        let root = c.root("src", src)?;
        c.host("tensor", tensor)?;
        check_writable(&c, "tensor", tensor)?;
        // descriptor: own output shape, src, and (on src) the list's element counts
        let mut d = shape_desc(tensor);
        d.push(src as i64);
        let mut local_err = None;
        let list_ok = if c.rank == root {
            let checked = match scatter_list {
                Some(l) if l.len() == c.size => l
                    .iter()
                    .enumerate()
                    .try_for_each(|(r, t)| {
                        c.host(&format!("scatter_list[{r}]"), t)?;
                        if t.dtype() != tensor.dtype() {
                            return Err(c.err(&format!("scatter_list[{r}]"), format!("{} (the dtype of tensor)", tensor.dtype()), t.dtype()));
                        }
                        Ok(())
                    })
                    .map(|()| l),
                l => Err(c.err(
                    "scatter_list",
                    format!("{} tensors (one per rank) on the source rank", c.size),
                    l.map_or_else(|| "None".to_string(), |l| format!("{} tensors", l.len())),
                )),
            };
            match checked {
                Ok(l) => {
                    d.extend(l.iter().map(|t| t.numel() as i64));
                    1
                }
                Err(e) => {
                    local_err = Some(e);
                    d.extend(std::iter::repeat_n(-1, c.size));
                    0
                }
            }
        } else {
            d.extend(std::iter::repeat_n(0, c.size));
            1
        };
        d.push(list_ok);
        let all = c.exchange(&d)?;
        agree(&c, &all, 0..1, "dtype", |v| dtype_name(v[0]).to_string())?;
        agree(&c, &all, DESC..DESC + 1, "src", |v| format!("src {}", v[0]))?;
        let sd = &all[root];
        if sd[sd.len() - 1] == 0 {
            return Err(local_err.unwrap_or_else(|| Error::Mismatch {
                op: "scatter".into(),
                detail: format!("the source rank {src} passed no usable scatter_list of {} tensors", c.size),
            }));
        }
        let counts: Vec<usize> = all.iter().map(|d| numel_of(d)).collect();
        for r in 0..c.size {
            let listed = sd[DESC + 1 + r];
            if listed != counts[r] as i64 {
                return Err(Error::Mismatch {
                    op: "scatter".into(),
                    detail: format!(
                        "scatter_list[{r}] on the source rank {src} has {listed} elements but rank {} expects {} ({})",
                        c.g.ranks()[r], counts[r], fmt_shape(&all[r])
                    ),
                });
            }
        }
        let b = c.cpu()?;
        dispatch!(tensor.dtype(), "scatter", c.grank, T => {
            if c.rank == root {
                let list = scatter_list.unwrap_or(&[]);
                let mut flat: Vec<T> = Vec::with_capacity(counts.iter().sum());
                for (r, t) in list.iter().enumerate() {
                    if t.dtype() != tensor.dtype() {
                        return Err(c.err(&format!("scatter_list[{r}]"), format!("{}", tensor.dtype()), t.dtype()));
                    }
                    flat.extend(host_vec::<T>(t)?);
                }
                write_host::<T, ()>(tensor, |out| b.scatter(Some(T::buf_ref(&flat)), out, &counts, root, c.timeout()))
            } else {
                write_host::<T, ()>(tensor, |out| b.scatter(None, out, &counts, root, c.timeout()))
            }
        })
    })
}

fn numel_of(d: &[i64]) -> usize {
    let nd = d[1].max(0) as usize;
    (0..nd.min(MAX_DIMS))
        .map(|i| d[2 + i].max(0) as usize)
        .product()
}

/// Rank `r` sends `input_list[s]` to rank `s`, which receives it into `output_list[r]`
/// (`dist.all_to_all`). Sizes may differ per pair but must agree between sender and receiver.
pub fn all_to_all(
    output_list: &[Tensor],
    input_list: &[Tensor],
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let g = resolve(group, "all_to_all")?;
    g.inner
        .seq
        .clone()
        .run_blocking(g.timeout(), "all_to_all", || {
            let c = call(&g, "all_to_all")?;
            for (name, l) in [("output_list", output_list), ("input_list", input_list)] {
                if l.len() != c.size {
                    return Err(c.err(name, format!("{} tensors (one per rank)", c.size), l.len()));
                }
            }
            let dt = input_list[0].dtype();
            for (r, t) in input_list.iter().chain(output_list).enumerate() {
                c.host(&format!("tensor {r} of the lists"), t)?;
                if t.dtype() != dt {
                    return Err(c.err("lists", format!("one dtype ({dt})"), t.dtype()));
                }
            }
            for (r, t) in output_list.iter().enumerate() {
                check_writable(&c, &format!("output_list[{r}]"), t)?;
            }
            let send: Vec<usize> = input_list.iter().map(|t| t.numel()).collect();
            let recv: Vec<usize> = output_list.iter().map(|t| t.numel()).collect();
            a2a_check(&c, dt, &send, &recv)?;
            let b = c.cpu()?;
            dispatch!(dt, "all_to_all", c.grank, T => {
                let mut flat: Vec<T> = Vec::with_capacity(send.iter().sum());
                for t in input_list {
                    flat.extend(host_vec::<T>(t)?);
                }
                let mut out = vec![T::default(); recv.iter().sum()];
                b.all_to_all(T::buf_ref(&flat), &send, T::buf_mut(&mut out), &recv, c.timeout())?;
                let mut off = 0;
                for (o, &n) in output_list.iter().zip(&recv) {
                    let block = &out[off..off + n];
                    write_host::<T, ()>(o, |mut dst| { copy_into::<T>(&mut dst, block); Ok(()) })?;
                    off += n;
                }
                Ok(())
            })
        })
}

/// Checks that what each rank sends to each other rank is what that rank expects to receive.
fn a2a_check(c: &Call<'_>, dt: DType, send: &[usize], recv: &[usize]) -> Result<()> {
    let mut d = vec![dtype_code(dt)];
    d.extend(send.iter().map(|&x| x as i64));
    d.extend(recv.iter().map(|&x| x as i64));
    let all = c.exchange(&d)?;
    agree(c, &all, 0..1, "dtype", |v| dtype_name(v[0]).to_string())?;
    let n = c.size;
    for r in 0..n {
        for s in 0..n {
            let sends = all[r][1 + s];
            let expects = all[s][1 + n + r];
            if sends != expects {
                return Err(Error::Mismatch {
                    op: c.op.to_string(),
                    detail: format!(
                        "rank {} sends {sends} elements to rank {} but rank {} expects {expects} from rank {}",
                        c.g.ranks()[r],
                        c.g.ranks()[s],
                        c.g.ranks()[s],
                        c.g.ranks()[r]
                    ),
                });
            }
        }
    }
    Ok(())
}

/// Splits `input` along its first dimension by `input_split_sizes` (rows; default: equal
/// parts), sends part `s` to rank `s`, and writes what rank `r` sent into `output`'s rows given
/// by `output_split_sizes` (`dist.all_to_all_single`). Rows must have one shape on all ranks.
pub fn all_to_all_single(
    output: &Tensor,
    input: &Tensor,
    output_split_sizes: Option<&[usize]>,
    input_split_sizes: Option<&[usize]>,
    group: Option<&ProcessGroup>,
) -> Result<()> {
    let g = resolve(group, "all_to_all_single")?;
    g.inner
        .seq
        .clone()
        .run_blocking(g.timeout(), "all_to_all_single", || {
            a2as_impl(&g, output, input, output_split_sizes, input_split_sizes)
        })
}

/// [`all_to_all_single`] with `async_op=True`.
pub fn all_to_all_single_async(
    output: &Tensor,
    input: &Tensor,
    output_split_sizes: Option<Vec<usize>>,
    input_split_sizes: Option<Vec<usize>>,
    group: Option<&ProcessGroup>,
) -> Result<Work> {
    let g = resolve(group, "all_to_all_single")?;
    let (o, i, g2) = (output.clone(), input.clone(), g.clone());
    g.inner.seq.submit(
        g.timeout(),
        "all_to_all_single",
        callers_grad_mode(move || {
            a2as_impl(
                &g2,
                &o,
                &i,
                output_split_sizes.as_deref(),
                input_split_sizes.as_deref(),
            )
        }),
    )
}

fn a2as_impl(
    g: &ProcessGroup,
    output: &Tensor,
    input: &Tensor,
    out_splits: Option<&[usize]>,
    in_splits: Option<&[usize]>,
) -> Result<()> {
    let c = call(g, "all_to_all_single")?;
    c.host("input", input)?;
    c.host("output", output)?;
    check_writable(&c, "output", output)?;
    if input.dtype() != output.dtype() {
        return Err(c.err(
            "output",
            format!("input's dtype {}", input.dtype()),
            output.dtype(),
        ));
    }
    let rows = |t: &Tensor| if t.ndim() == 0 { 1 } else { t.shape()[0] };
    let row_numel = |t: &Tensor| {
        if t.ndim() == 0 {
            1
        } else {
            t.shape()[1..].iter().product::<usize>()
        }
    };
    if input.ndim() > 0 && output.ndim() > 0 && input.shape()[1..] != output.shape()[1..] {
        return Err(c.err(
            "output",
            format!("rows of shape {:?} like input's", &input.shape()[1..]),
            format!("{:?}", &output.shape()[1..]),
        ));
    }
    let splits = |given: Option<&[usize]>, t: &Tensor, arg: &str| -> Result<Vec<usize>> {
        match given {
            Some(s) => {
                let sum = s.iter().try_fold(0usize, |a, &v| a.checked_add(v));
                if s.len() != c.size || sum != Some(rows(t)) {
                    return Err(c.err(
                        arg,
                        format!("{} sizes summing to {} rows", c.size, rows(t)),
                        format!("{s:?}"),
                    ));
                }
                Ok(s.to_vec())
            }
            None => {
                if rows(t) % c.size != 0 {
                    return Err(c.err(
                        arg,
                        format!(
                            "given, since {} rows do not split evenly over {} ranks",
                            rows(t),
                            c.size
                        ),
                        "None",
                    ));
                }
                Ok(vec![rows(t) / c.size; c.size])
            }
        }
    };
    let rn = row_numel(input);
    let send: Vec<usize> = splits(in_splits, input, "input_split_sizes")?
        .iter()
        .map(|r| r * rn)
        .collect();
    let recv: Vec<usize> = splits(out_splits, output, "output_split_sizes")?
        .iter()
        .map(|r| r * rn)
        .collect();
    a2a_check(&c, input.dtype(), &send, &recv)?;
    let b = c.cpu()?;
    dispatch!(input.dtype(), "all_to_all_single", c.grank, T => {
        if input.shares_storage_with(output) {
            let inp = host_vec::<T>(input)?;
            write_host::<T, ()>(output, |out| b.all_to_all(T::buf_ref(&inp), &send, out, &recv, c.timeout()))
        } else {
            write_host::<T, ()>(output, |out| read_host::<T, ()>(input, |inp| b.all_to_all(inp, &send, out, &recv, c.timeout())))
        }
    })
}

/// Blocks until every rank of the group has called it (`dist.barrier`).
pub fn barrier(group: Option<&ProcessGroup>) -> Result<()> {
    let g = resolve(group, "barrier")?;
    g.inner
        .seq
        .clone()
        .run_blocking(g.timeout(), "barrier", || {
            let c = call(&g, "barrier")?;
            c.cpu_or_meta()?.barrier(c.timeout())
        })
}

/// Sends `tensor` to global rank `dst` (`dist.send`); `tag` must match the receiver's.
pub fn send(tensor: &Tensor, dst: usize, group: Option<&ProcessGroup>, tag: u64) -> Result<()> {
    let g = resolve(group, "send")?;
    send_impl(&g, tensor, dst, tag)
}

fn send_impl(g: &ProcessGroup, tensor: &Tensor, dst: usize, tag: u64) -> Result<()> {
    let c = call(g, "send")?;
    let peer = c.root("dst", dst)?;
    if peer == c.rank {
        return Err(c.err("dst", "a rank other than this one", dst));
    }
    if let Some(BackendImpl::Nccl(n)) = &g.inner.backend {
        return n.send(&c.grank, tensor, peer, c.timeout());
    }
    c.host("tensor", tensor)?;
    let b = c.cpu()?;
    dispatch!(tensor.dtype(), "send", c.grank, T => read_host::<T, ()>(tensor, |buf| b.send(buf, peer, tag, c.timeout())))
}

/// Receives into `tensor` from global rank `src` (`dist.recv`); the sender's tensor must have
/// as many elements and the same `tag`. Returns `src`.
pub fn recv(tensor: &Tensor, src: usize, group: Option<&ProcessGroup>, tag: u64) -> Result<usize> {
    let g = resolve(group, "recv")?;
    recv_impl(&g, tensor, src, tag)?;
    Ok(src)
}

fn recv_impl(g: &ProcessGroup, tensor: &Tensor, src: usize, tag: u64) -> Result<()> {
    let c = call(g, "recv")?;
    let peer = c.root("src", src)?;
    if peer == c.rank {
        return Err(c.err("src", "a rank other than this one", src));
    }
    if let Some(BackendImpl::Nccl(n)) = &g.inner.backend {
        return n.recv(&c.grank, tensor, peer, c.timeout());
    }
    c.host("tensor", tensor)?;
    check_writable(&c, "tensor", tensor)?;
    let b = c.cpu()?;
    dispatch!(tensor.dtype(), "recv", c.grank, T => write_host::<T, ()>(tensor, |buf| b.recv(buf, peer, tag, c.timeout())))
}

/// Non-blocking [`send`] (`dist.isend`): returns a [`Work`]; the tensor must not be modified
/// until it completes.
pub fn isend(tensor: &Tensor, dst: usize, group: Option<&ProcessGroup>, tag: u64) -> Result<Work> {
    let g = resolve(group, "isend")?;
    let (t, g2) = (tensor.clone(), g.clone());
    p2p_thread("isend", move || send_impl(&g2, &t, dst, tag))
}

/// Non-blocking [`recv`] (`dist.irecv`).
pub fn irecv(tensor: &Tensor, src: usize, group: Option<&ProcessGroup>, tag: u64) -> Result<Work> {
    let g = resolve(group, "irecv")?;
    let (t, g2) = (tensor.clone(), g.clone());
    p2p_thread("irecv", move || recv_impl(&g2, &t, src, tag))
}

/// Point-to-point operations do not take a turn in the group's sequence (a rank may post a
/// receive and a send to different peers at once); each runs on its own thread.
fn p2p_thread(op: &str, f: impl FnOnce() -> Result<()> + Send + 'static) -> Result<Work> {
    let (tx, work) = Work::pending(op);
    std::thread::Builder::new()
        .name(format!("tensorplay-{op}"))
        .spawn(move || {
            let started = Some(std::time::Instant::now());
            let _ = tx.send(crate::work::Done::now(f(), started));
        })
        .map_err(|e| Error::Io(format!("could not start a thread for {op}: {e}")))?;
    Ok(work)
}
