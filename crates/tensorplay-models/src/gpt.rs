//! A decoder-only transformer in GPT-2's shape (Radford et al. 2019; the layout of Karpathy's
//! nanoGPT), and its Megatron-style tensor-parallel form (Shoeybi et al. 2019).

use std::fmt;

use tensorplay_collectives::device_mesh::DeviceMesh;
use tensorplay_collectives::{self as dist, ProcessGroup};
use tensorplay_core::nn::functional::{
    cross_entropy, dropout, linear, scaled_dot_product_attention,
};
use tensorplay_core::nn::{Embedding, LayerNorm, Linear, Module, ModuleCore, ModuleList, init};
use tensorplay_core::utils::checkpoint::CheckpointWrapper;
use tensorplay_core::{DType, Error, Result, Tensor};
use tensorplay_distributed_nn::parallel::tensor::{
    ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module,
};

/// The shape of a [`Gpt`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptConfig {
    /// Tokens in the vocabulary (`V`).
    pub vocab_size: usize,
    /// The longest sequence (context) the position embedding covers (`block_size`).
    pub block_size: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads per block; divides `n_embd`.
    pub n_head: usize,
    /// The model width (`E`).
    pub n_embd: usize,
    /// Dropout on the embeddings, the attention weights and each residual branch (0 for none).
    pub dropout: f64,
    /// The parameters' dtype (float32 or float64).
    pub dtype: DType,
}

impl GptConfig {
    /// Checks the configuration; `world` is the tensor-parallel group size it will be split
    /// over (1 for none). Errors ([`Error::InvalidArgument`]) name the field: a zero size,
    /// `n_head` not dividing `n_embd`, `world` not dividing `n_head`, `dropout` outside
    /// `[0, 1)`, an integer dtype.
    pub fn validate(&self, world: usize) -> Result<()> {
        let bad = |arg: &'static str, expected: String, got: String| {
            Err(invalid("GptConfig", arg, expected, got))
        };
        for (arg, v) in [
            ("vocab_size", self.vocab_size),
            ("block_size", self.block_size),
            ("n_layer", self.n_layer),
            ("n_head", self.n_head),
            ("n_embd", self.n_embd),
        ] {
            if v == 0 {
                return bad(arg, "at least 1".into(), "0".into());
            }
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return bad(
                "n_head",
                format!("a divisor of n_embd = {}", self.n_embd),
                self.n_head.to_string(),
            );
        }
        if world == 0 || !self.n_head.is_multiple_of(world) {
            return bad(
                "world size",
                format!(
                    "a divisor of n_head = {} (heads are split across ranks)",
                    self.n_head
                ),
                world.to_string(),
            );
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(
                "dropout",
                "a probability in [0, 1)".into(),
                self.dropout.to_string(),
            );
        }
        if !self.dtype.is_float() {
            return bad("dtype", "float32 or float64".into(), self.dtype.to_string());
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// the tensor-parallel layout

/// The query, key and value projection: three stacked blocks of `n_embd` rows, each split
/// across the ranks (rank `r` of `W` holds the query, key and value rows of heads
/// `r*H/W .. (r+1)*H/W`).
static QKV: ColwiseParallel = ColwiseParallel::new().stacked(3);
/// `mlp.c_fc`: split by rows (output features).
static COLWISE: ColwiseParallel = ColwiseParallel::new();
/// Both `c_proj`: split by columns (input features); the partial outputs summed, the bias
/// added once (kept by the group's rank 0, see [`RowwiseParallel`]).
static ROWWISE: RowwiseParallel = RowwiseParallel::new();

/// The tensor-parallel plan of a [`Block`] (Megatron's layout), for
/// [`parallelize_module`]: module names (relative to the block) and their styles. Everything
/// else (the LayerNorms) stays replicated.
pub fn block_tensor_parallel_plan() -> [(&'static str, &'static dyn ParallelStyle); 4] {
    [
        ("attn.c_attn", &QKV),
        ("attn.c_proj", &ROWWISE),
        ("mlp.c_fc", &COLWISE),
        ("mlp.c_proj", &ROWWISE),
    ]
}

/// The tensor-parallel plan of a [`Gpt`]: [`block_tensor_parallel_plan`] in every block
/// (`h.*.`); the embeddings, the LayerNorms and the tied head stay replicated.
pub fn tensor_parallel_plan() -> [(&'static str, &'static dyn ParallelStyle); 4] {
    [
        ("h.*.attn.c_attn", &QKV),
        ("h.*.attn.c_proj", &ROWWISE),
        ("h.*.mlp.c_fc", &COLWISE),
        ("h.*.mlp.c_proj", &ROWWISE),
    ]
}

/// Rank `rank`'s value (of `world`) of the parameter `name` (as [`Module::named_parameters`]
/// names it, with or without the `h.N.` prefix) given its full value, as
/// [`Gpt::tensor_parallel`] leaves it: the planned style's shard ([`tensor_parallel_plan`]),
/// or a copy for a replicated parameter. A new contiguous tensor, not requiring grad. Also
/// shards gradients (to compare a tensor-parallel run's with a single process's).
///
/// Errors ([`Error::InvalidArgument`]): `rank >= world` (`rank`); `full` lacks the split
/// dimension or `world` does not divide it (for the stacked query-key-value rows, `3 * world`)
/// (`full`).
pub fn shard_parameter(name: &str, full: &Tensor, rank: usize, world: usize) -> Result<Tensor> {
    if rank >= world {
        return Err(invalid(
            "shard_parameter",
            "rank",
            format!("less than the world size {world}"),
            rank,
        ));
    }
    let (module, local) = name.rsplit_once('.').unwrap_or(("", name));
    let style = block_tensor_parallel_plan()
        .into_iter()
        .find(|(path, _)| module.ends_with(path))
        .map(|(_, style)| style);
    let Some(style) = style else {
        return full.detach().contiguous()?.deep_clone();
    };
    style
        .shard_parameter(local, full, rank, world)
        .map_err(|e| match e {
            Error::InvalidArgument { expected, got, .. } => Error::InvalidArgument {
                op: "shard_parameter",
                arg: "full",
                expected: format!("{expected} ({name})"),
                got,
            },
            e => e,
        })
}

pub(crate) fn invalid(
    op: &'static str,
    arg: &'static str,
    expected: impl Into<String>,
    got: impl fmt::Display,
) -> Error {
    Error::InvalidArgument {
        op,
        arg,
        expected: expected.into(),
        got: got.to_string(),
    }
}

/// A 1-D mesh over `group` (errors: this process is not a member).
fn mesh_of(group: &ProcessGroup) -> Result<DeviceMesh> {
    Ok(DeviceMesh::from_group(group, "tp")?)
}

// ---------------------------------------------------------------------------------------------
// layers

/// `N(0, std)` of `shape`, drawn from the default generator, on the default device (on the
/// meta device nothing is drawn).
fn normal(shape: &[usize], std: f64, dtype: DType) -> Result<Tensor> {
    let t = Tensor::randn(shape, dtype)?;
    if t.device().is_meta() {
        return Ok(t.requires_grad_(true));
    }
    Ok(t.mul_scalar(std)?.detach().requires_grad_(true))
}

/// `N(0, std)` for a Linear layer's weight and zeros for its bias, through `nn::init`.
fn reset_linear(l: &Linear, std: f64) -> Result<()> {
    init::normal_(&l.weight, 0.0, std)?;
    match &l.bias {
        Some(b) => init::zeros_(b),
        None => Ok(()),
    }
}

/// The standard deviation of the projections into the residual stream (GPT-2's scaled
/// initialisation).
fn proj_std(c: &GptConfig) -> f64 {
    0.02 / (2.0 * c.n_layer as f64).sqrt()
}

fn linear_init(i: usize, o: usize, std: f64, dtype: DType) -> Result<Linear> {
    let b = Tensor::zeros(&[o], dtype)?.requires_grad_(true);
    Linear::from_weights(normal(&[o, i], std, dtype)?, Some(b))
}

/// A copy of `full` with new leaf parameters (requiring grad).
fn copy_linear(full: &Linear) -> Result<Linear> {
    let fresh =
        |t: &Tensor| -> Result<Tensor> { Ok(t.detach().deep_clone()?.requires_grad_(true)) };
    Linear::from_weights(
        fresh(&full.weight)?,
        full.bias.as_ref().map(fresh).transpose()?,
    )
}

pub(crate) fn fresh_layer_norm(full: &LayerNorm) -> Result<LayerNorm> {
    let mut ln = LayerNorm::with_dtype(full.normalized_shape(), full.eps(), full.weight.dtype())?;
    ln.weight = full.weight.detach().deep_clone()?.requires_grad_(true);
    ln.bias = full.bias.detach().deep_clone()?.requires_grad_(true);
    Ok(ln)
}

pub(crate) fn maybe_dropout(x: Tensor, p: f64, training: bool) -> Result<Tensor> {
    if p > 0.0 && training {
        dropout(&x, p, true)
    } else {
        Ok(x)
    }
}

/// Causal multi-head self-attention: `c_attn` (`E -> 3E`: query, key, value), the heads,
/// `c_proj` (`E -> E`). Split over a group ([`block_tensor_parallel_plan`]), this rank holds
/// `n_head / W` heads: `c_attn` is column-parallel with its three blocks stacked, `c_proj`
/// row-parallel; the forward counts its heads from `c_attn`'s output.
#[derive(Module)]
pub struct CausalSelfAttention {
    /// The query, key and value projection (`[3E, E]`, or `[3E/W, E]` on a rank).
    pub c_attn: Linear,
    /// The output projection (`[E, E]`, or `[E, E/W]` on a rank; its bias is whole on the
    /// group's rank 0 and zero elsewhere).
    pub c_proj: Linear,
    proj_std: f64,
    heads: usize,
    head_dim: usize,
    dropout: f64,
    core: ModuleCore,
}

impl CausalSelfAttention {
    fn new(c: &GptConfig) -> Result<CausalSelfAttention> {
        let e = c.n_embd;
        Ok(CausalSelfAttention {
            c_attn: linear_init(e, 3 * e, 0.02, c.dtype)?,
            c_proj: linear_init(e, e, proj_std(c), c.dtype)?,
            proj_std: proj_std(c),
            heads: c.n_head,
            head_dim: e / c.n_head,
            dropout: c.dropout,
            core: ModuleCore::new(),
        })
    }

    fn copy(&self) -> Result<CausalSelfAttention> {
        Ok(CausalSelfAttention {
            c_attn: copy_linear(&self.c_attn)?,
            c_proj: copy_linear(&self.c_proj)?,
            proj_std: self.proj_std,
            heads: self.heads,
            head_dim: self.head_dim,
            dropout: self.dropout,
            core: ModuleCore::new(),
        })
    }
}

impl Module for CausalSelfAttention {
    /// `[B, T, E]` -> `[B, T, E]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t) = (x.shape()[0], x.shape()[1]);
        let qkv = self.c_attn.call(x)?;
        let local = qkv.shape()[2] / 3;
        let (d, heads) = (self.head_dim, local / self.head_dim);
        // one split: its backward writes the three gradients into one buffer
        let parts = qkv.split(local, 2)?;
        let heads = |i: usize| -> Result<Tensor> {
            parts[i].reshape(&[b, t, heads, d])?.permute(&[0, 2, 1, 3])
        };
        let p = if self.is_training() {
            self.dropout
        } else {
            0.0
        };
        let y =
            scaled_dot_product_attention(&heads(0)?, &heads(1)?, &heads(2)?, None, p, true, None)?;
        let y = y.permute(&[0, 2, 1, 3])?.reshape(&[b, t, local])?;
        maybe_dropout(self.c_proj.call(&y)?, self.dropout, self.is_training())
    }
    /// As the constructor draws them ([`Gpt`]'s recipe), through `nn::init`.
    fn reset_parameters(&mut self) -> Result<()> {
        reset_linear(&self.c_attn, 0.02)?;
        reset_linear(&self.c_proj, self.proj_std)
    }
}

/// The MLP of a block: `c_fc` (`E -> 4E`), tanh-GELU, `c_proj` (`4E -> E`). Split over a
/// group ([`block_tensor_parallel_plan`]), `c_fc` is column-parallel and `c_proj` row-parallel.
#[derive(Module)]
pub struct Mlp {
    /// `[4E, E]`, or `[4E/W, E]` on a rank.
    pub c_fc: Linear,
    /// `[E, 4E]`, or `[E, 4E/W]` on a rank (its bias whole on the group's rank 0, zero
    /// elsewhere).
    pub c_proj: Linear,
    proj_std: f64,
    dropout: f64,
    core: ModuleCore,
}

impl Mlp {
    fn new(c: &GptConfig) -> Result<Mlp> {
        let e = c.n_embd;
        Ok(Mlp {
            c_fc: linear_init(e, 4 * e, 0.02, c.dtype)?,
            c_proj: linear_init(4 * e, e, proj_std(c), c.dtype)?,
            proj_std: proj_std(c),
            dropout: c.dropout,
            core: ModuleCore::new(),
        })
    }

    fn copy(&self) -> Result<Mlp> {
        Ok(Mlp {
            c_fc: copy_linear(&self.c_fc)?,
            c_proj: copy_linear(&self.c_proj)?,
            proj_std: self.proj_std,
            dropout: self.dropout,
            core: ModuleCore::new(),
        })
    }
}

impl Module for Mlp {
    /// `[B, T, E]` -> `[B, T, E]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.c_fc.call(x)?.gelu_tanh()?;
        maybe_dropout(self.c_proj.call(&h)?, self.dropout, self.is_training())
    }
    /// As the constructor draws them ([`Gpt`]'s recipe), through `nn::init`.
    fn reset_parameters(&mut self) -> Result<()> {
        reset_linear(&self.c_fc, 0.02)?;
        reset_linear(&self.c_proj, self.proj_std)
    }
}

/// A pre-norm transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
#[derive(Module)]
pub struct Block {
    /// The LayerNorm before attention (replicated).
    pub ln_1: LayerNorm,
    /// Causal self-attention.
    pub attn: CausalSelfAttention,
    /// The LayerNorm before the MLP (replicated).
    pub ln_2: LayerNorm,
    /// The MLP.
    pub mlp: Mlp,
    core: ModuleCore,
}

impl Block {
    /// A block of `config`'s width, heads and dtype, initialised as [`Gpt::new`] does (from the
    /// default generator). Errors as [`GptConfig::validate`].
    pub fn new(config: &GptConfig) -> Result<Block> {
        config.validate(1)?;
        Ok(Block {
            ln_1: LayerNorm::with_dtype(&[config.n_embd], 1e-5, config.dtype)?,
            attn: CausalSelfAttention::new(config)?,
            ln_2: LayerNorm::with_dtype(&[config.n_embd], 1e-5, config.dtype)?,
            mlp: Mlp::new(config)?,
            core: ModuleCore::new(),
        })
    }

    /// This rank's part of the block split over `group`: a copy (new leaf tensors)
    /// parallelised by [`parallelize_module`] with [`block_tensor_parallel_plan`] (its heads
    /// and MLP columns). Every rank of `group` must call it with the same block, and run the
    /// forward and backward passes together.
    ///
    /// Errors: the group's size does not divide the heads; this process is not in `group`;
    /// collective errors.
    pub fn tensor_parallel(&self, group: &ProcessGroup) -> Result<Block> {
        let world = group.size();
        if !self.attn.heads.is_multiple_of(world) {
            return Err(invalid(
                "tensor_parallel (Gpt or Block)",
                "group",
                format!("a size dividing the {} heads", self.attn.heads),
                world,
            ));
        }
        let mut block = self.copy()?;
        parallelize_module(&mut block, &mesh_of(group)?, &block_tensor_parallel_plan())?;
        Ok(block)
    }

    /// A copy with new leaf tensors (same values).
    pub(crate) fn copy(&self) -> Result<Block> {
        Ok(Block {
            ln_1: fresh_layer_norm(&self.ln_1)?,
            attn: self.attn.copy()?,
            ln_2: fresh_layer_norm(&self.ln_2)?,
            mlp: self.mlp.copy()?,
            core: ModuleCore::new(),
        })
    }
}

impl Module for Block {
    /// `[B, T, E]` -> `[B, T, E]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.add(&self.attn.call(&self.ln_1.call(x)?)?)?;
        x.add(&self.mlp.call(&self.ln_2.call(&x)?)?)
    }
}

/// A block in a checkpoint wrapper that is switched off.
pub(crate) fn unchecked(block: Block) -> CheckpointWrapper<Block> {
    let mut w = CheckpointWrapper::new(block);
    w.set_enabled(false);
    w
}

// ---------------------------------------------------------------------------------------------
// the model

/// A GPT: token and position embeddings, `n_layer` pre-norm [`Block`]s, a final LayerNorm and
/// a language-model head **tied** to the token embedding (logits `= x @ wte.weight^T`, no
/// bias).
///
/// Input: token ids, int64 `[B, T]` with `T <= block_size`; output: logits `[B, T, V]` of the
/// config's dtype. Parameters are named as in nanoGPT without its `transformer.` prefix
/// (`wte.weight`, `wpe.weight`, `h.0.ln_1.weight`, `h.0.attn.c_attn.weight`, ...,
/// `ln_f.bias`); the head has no parameter of its own. Initialisation follows GPT-2: weights
/// `N(0, 0.02)`, the residual projections (`c_proj`) `N(0, 0.02 / sqrt(2 n_layer))`, biases
/// zero, LayerNorms one and zero, drawn from the default generator in parameter order.
///
/// [`Gpt::tensor_parallel`] splits it over a process group in Megatron's layout: each rank
/// holds `n_head / W` heads of every attention and `4E / W` columns of every MLP; embeddings,
/// LayerNorms and the head are replicated. See [`tensor_parallel_plan`] and `docs/models.md`.
///
/// ```
/// use tensorplay::{self as tp, models::{Gpt, GptConfig}, nn::Module};
/// tp::manual_seed(0);
/// let config = GptConfig { vocab_size: 11, block_size: 8, n_layer: 2, n_head: 2, n_embd: 16,
///                          dropout: 0.0, dtype: tp::DType::F32 };
/// let gpt = Gpt::new(config)?;
/// let idx = tp::Tensor::from_vec(vec![1i64, 2, 3, 4, 5, 6], &[2, 3])?;
/// assert_eq!(gpt.call(&idx)?.shape(), [2, 3, 11]);
/// let loss = gpt.loss(&idx, &idx)?; // next-token targets, [B, T]
/// loss.backward()?;
/// assert!(gpt.wte.weight.grad().is_some()); // the embedding and the tied head
/// # Ok::<(), tp::Error>(())
/// ```
#[derive(Module)]
pub struct Gpt {
    /// The token embedding `[V, E]`, also the output head.
    pub wte: Embedding,
    /// The position embedding `[block_size, E]`.
    pub wpe: Embedding,
    /// The blocks, each in a [`CheckpointWrapper`] that is off unless
    /// [`Gpt::set_activation_checkpointing`] turned it on (the wrapper is transparent: names
    /// and fields are the block's).
    pub h: ModuleList<CheckpointWrapper<Block>>,
    /// The final LayerNorm.
    pub ln_f: LayerNorm,
    #[module(skip)]
    config: GptConfig,
    core: ModuleCore,
}

impl Gpt {
    /// A model of `config`, initialised as described on [`Gpt`]. Errors as
    /// [`GptConfig::validate`].
    pub fn new(config: GptConfig) -> Result<Gpt> {
        config.validate(1)?;
        let (v, e) = (config.vocab_size, config.n_embd);
        let wte = Embedding::from_weights(normal(&[v, e], 0.02, config.dtype)?)?;
        let wpe = Embedding::from_weights(normal(&[config.block_size, e], 0.02, config.dtype)?)?;
        let mut h = ModuleList::new();
        for _ in 0..config.n_layer {
            h.push(unchecked(Block::new(&config)?));
        }
        Ok(Gpt {
            wte,
            wpe,
            h,
            ln_f: LayerNorm::with_dtype(&[e], 1e-5, config.dtype)?,
            config,
            core: ModuleCore::new(),
        })
    }

    /// Turns per-block activation checkpointing on or off (off after [`Gpt::new`]): with it,
    /// each block's activations are recomputed in backward instead of kept, as torchtitan's
    /// per-block AC does (see [`CheckpointWrapper`]); gradients are identical, at the cost of
    /// a second forward of each block. With fully sharded data parallelism, turn it on before
    /// or after `fully_shard` alike.
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        for b in self.h.iter_mut() {
            b.set_enabled(on);
        }
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    /// This rank's part of the model split over `group` (tensor parallelism, Megatron's
    /// layout): a copy of the model (new leaf tensors) parallelised by [`parallelize_module`]
    /// with [`tensor_parallel_plan`] — every block as [`Block::tensor_parallel`], the
    /// embeddings and the final LayerNorm whole. Parameter names are unchanged. Every rank of `group` calls
    /// it with the same model (for instance built from the same seed), then runs every forward
    /// and backward together, computes the full loss and calls `backward` on it; each shard's
    /// gradient is then its slice of the single-process gradient, and replicated parameters get
    /// the full gradient on every rank (no further synchronisation); the row-parallel biases
    /// are trained by the group's rank 0 and stay zero on the others (see
    /// [`RowwiseParallel`]).
    ///
    /// Errors: the group's size does not divide `n_head`; collective errors.
    pub fn tensor_parallel(&self, group: &ProcessGroup) -> Result<Gpt> {
        let world = dist::get_world_size(Some(group))?;
        self.config.validate(world)?;
        let copy =
            |t: &Tensor| -> Result<Tensor> { Ok(t.detach().deep_clone()?.requires_grad_(true)) };
        let mut h = ModuleList::new();
        for b in &self.h {
            let mut c = unchecked(b.copy()?);
            c.set_enabled(b.is_enabled());
            h.push(c);
        }
        let mut gpt = Gpt {
            wte: Embedding::from_weights(copy(&self.wte.weight)?)?,
            wpe: Embedding::from_weights(copy(&self.wpe.weight)?)?,
            h,
            ln_f: fresh_layer_norm(&self.ln_f)?,
            config: self.config,
            core: ModuleCore::new(),
        };
        parallelize_module(&mut gpt, &mesh_of(group)?, &tensor_parallel_plan())?;
        Ok(gpt)
    }

    /// The mean next-token cross-entropy of `idx` (`[B, T]` token ids) against `targets`
    /// (`[B, T]`, int64): a 0-d tensor of the model's dtype.
    ///
    /// Errors: as [`Module::forward`], and targets of another shape or out of range.
    pub fn loss(&self, idx: &Tensor, targets: &Tensor) -> Result<Tensor> {
        if targets.shape() != idx.shape() {
            return Err(invalid(
                "Gpt::loss",
                "targets",
                format!("shape {:?}, as idx", idx.shape()),
                format!("{:?}", targets.shape()),
            ));
        }
        let logits = self.call(idx)?;
        let n = targets.numel();
        cross_entropy(
            &logits.reshape(&[n, self.config.vocab_size])?,
            &targets.reshape(&[n])?,
        )
    }
}

impl fmt::Debug for Gpt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gpt({:?})", self.config)
    }
}

impl Module for Gpt {
    /// Logits `[B, T, V]` for token ids `[B, T]` (int64). Errors
    /// ([`Error::InvalidArgument`]): not 2-d int64, or `T` is 0 or longer than `block_size`;
    /// [`Error::IndexOutOfBounds`] for a token id outside `0..V`.
    fn forward(&self, idx: &Tensor) -> Result<Tensor> {
        if idx.ndim() != 2 || idx.dtype() != DType::I64 {
            return Err(invalid(
                "Gpt::forward",
                "idx",
                "int64 token ids [batch, sequence]",
                format!("{} of shape {:?}", idx.dtype(), idx.shape()),
            ));
        }
        let t = idx.shape()[1];
        if t == 0 || t > self.config.block_size {
            return Err(invalid(
                "Gpt::forward",
                "idx",
                format!("1 to block_size = {} positions", self.config.block_size),
                t,
            ));
        }
        let pos = Tensor::arange(0.0, t as f64, 1.0, (DType::I64, idx.device()))?;
        let x = self.wte.call(idx)?.add(&self.wpe.call(&pos)?)?;
        let mut x = maybe_dropout(x, self.config.dropout, self.is_training())?;
        for block in &self.h {
            x = block.call(&x)?;
        }
        let x = self.ln_f.call(&x)?;
        // the head, tied to the token embedding
        linear(&x, &self.wte.weight, None)
    }
    /// Initialises every parameter again with [`Gpt`]'s recipe, through
    /// [`tensorplay_core::nn::init`] (one seed per parameter from the default generator): the
    /// step of deferred initialisation after `to_empty`, also on a fully sharded model, whose
    /// ranks then hold the rows of the same values an unsharded model gets from the same seed.
    /// The values differ from [`Gpt::new`]'s draws (same distributions).
    fn reset_parameters(&mut self) -> Result<()> {
        init::normal_(&self.wte.weight, 0.0, 0.02)?;
        init::normal_(&self.wpe.weight, 0.0, 0.02)?;
        for b in self.h.iter_mut() {
            b.reset_parameters()?;
        }
        self.ln_f.reset_parameters()
    }
}
