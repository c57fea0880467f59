//! The GPT split by layers into pipeline stages (`torch.distributed.pipelining`'s manual
//! split): stage `k` of `n` holds a contiguous run of blocks; the first also the embeddings,
//! the last also the final LayerNorm and the head.

use tensorplay_core::nn::{Embedding, LayerNorm, Linear, Module, ModuleCore, ModuleList};
use tensorplay_core::utils::checkpoint::CheckpointWrapper;
use tensorplay_core::{DType, Result, Tensor};

use crate::gpt::{Block, Gpt, GptConfig, fresh_layer_norm, invalid, maybe_dropout, unchecked};

/// Stage `stage` of a [`Gpt`] split into `num_stages` pipeline stages, built by
/// [`Gpt::pipeline_stage`]. Blocks are cut as evenly as the count allows (stage `k` holds
/// blocks `n_layer k / S` to `n_layer (k + 1) / S`). Input: token ids `[B, T]` (int64) on the
/// first stage, activations `[B, T, E]` on the others; output: activations `[B, T, E]`, or
/// logits `[B, T, V]` on the last.
///
/// The last stage's head is a copy of the token embedding (`lm_head.weight`, `[V, E]`): the
/// GPT ties them, so the first and last stages each hold one; tie them with
/// `PipelineStage::tie_parameter` on both ranks ([`GptStage::tied_weight`]) so that their
/// gradients are summed and the copies stay equal. Parameter names are the stage's own:
/// `wte.weight`, `wpe.weight` (first), `h.0...` counting from the stage's first block,
/// `ln_f.*` and `lm_head.weight` (last).
#[derive(Module)]
pub struct GptStage {
    /// The token embedding (first stage).
    pub wte: Option<Embedding>,
    /// The position embedding (first stage).
    pub wpe: Option<Embedding>,
    /// This stage's blocks.
    pub h: ModuleList<CheckpointWrapper<Block>>,
    /// The final LayerNorm (last stage).
    pub ln_f: Option<LayerNorm>,
    /// The head (last stage): `[V, E]` weight, no bias, a copy of the token embedding.
    pub lm_head: Option<Linear>,
    #[module(skip)]
    config: GptConfig,
    #[module(skip)]
    stage: usize,
    #[module(skip)]
    num_stages: usize,
    core: ModuleCore,
}

impl std::fmt::Debug for GptStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GptStage({} of {}, {} blocks)",
            self.stage,
            self.num_stages,
            self.h.len()
        )
    }
}

impl Gpt {
    /// Stage `stage` of this model split into `num_stages` (see [`GptStage`]): copies of
    /// its parameters (new leaf tensors, same values), so that every rank can build the same
    /// model from one seed and keep its stage, as PyTorch's manual split does.
    ///
    /// Errors ([`tensorplay_core::Error::InvalidArgument`]): `num_stages` is 0 or more than
    /// `n_layer` (every stage holds a block), `stage >= num_stages`.
    pub fn pipeline_stage(&self, stage: usize, num_stages: usize) -> Result<GptStage> {
        let n = self.config().n_layer;
        if num_stages == 0 || num_stages > n {
            return Err(invalid(
                "Gpt::pipeline_stage",
                "num_stages",
                format!("1 to n_layer = {n} (a block per stage at least)"),
                num_stages,
            ));
        }
        if stage >= num_stages {
            return Err(invalid(
                "Gpt::pipeline_stage",
                "stage",
                format!("below num_stages = {num_stages}"),
                stage,
            ));
        }
        let copy =
            |t: &Tensor| -> Result<Tensor> { Ok(t.detach().deep_clone()?.requires_grad_(true)) };
        let (lo, hi) = (n * stage / num_stages, n * (stage + 1) / num_stages);
        let mut h = ModuleList::new();
        for b in self.h.iter().skip(lo).take(hi - lo) {
            let mut c = unchecked(b.copy()?);
            c.set_enabled(b.is_enabled());
            h.push(c);
        }
        let first = stage == 0;
        let last = stage + 1 == num_stages;
        Ok(GptStage {
            wte: if first {
                Some(Embedding::from_weights(copy(&self.wte.weight)?)?)
            } else {
                None
            },
            wpe: if first {
                Some(Embedding::from_weights(copy(&self.wpe.weight)?)?)
            } else {
                None
            },
            h,
            ln_f: if last {
                Some(fresh_layer_norm(&self.ln_f)?)
            } else {
                None
            },
            lm_head: if last {
                Some(Linear::from_weights(copy(&self.wte.weight)?, None)?)
            } else {
                None
            },
            config: *self.config(),
            stage,
            num_stages,
            core: ModuleCore::new(),
        })
    }
}

impl GptStage {
    /// The weight this stage shares with the other end of the pipeline: the token embedding
    /// on the first stage, the head on the last (`None` on the middle ones; with one stage,
    /// the embedding). Taken from [`Module::named_parameters`], so after `fully_shard` it is
    /// this rank's shard (the same rows on both stages).
    pub fn tied_weight(&self) -> Option<Tensor> {
        let params = self.named_parameters();
        ["wte.weight", "lm_head.weight"].iter().find_map(|want| {
            params
                .iter()
                .find(|(n, _)| n == want)
                .map(|(_, p)| p.clone())
        })
    }

    /// Turns per-block activation checkpointing on or off, as [`Gpt::set_activation_checkpointing`].
    pub fn set_activation_checkpointing(&mut self, on: bool) {
        for b in self.h.iter_mut() {
            b.set_enabled(on);
        }
    }
}

impl Module for GptStage {
    /// Token ids `[B, T]` (first stage) or activations `[B, T, E]` to activations or, on the
    /// last stage, logits `[B, T, V]`. Errors as [`Gpt`]'s forward on the first stage; a
    /// shape mismatch on the others.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = match (&self.wte, &self.wpe) {
            (Some(wte), Some(wpe)) => {
                if x.ndim() != 2 || x.dtype() != DType::I64 {
                    return Err(invalid(
                        "GptStage::forward",
                        "idx",
                        "int64 token ids [batch, sequence] (the first stage)",
                        format!("{} of shape {:?}", x.dtype(), x.shape()),
                    ));
                }
                let t = x.shape()[1];
                if t == 0 || t > self.config.block_size {
                    return Err(invalid(
                        "GptStage::forward",
                        "idx",
                        format!("1 to block_size = {} positions", self.config.block_size),
                        t,
                    ));
                }
                let pos = Tensor::arange(0.0, t as f64, 1.0, (DType::I64, x.device()))?;
                let e = wte.call(x)?.add(&wpe.call(&pos)?)?;
                maybe_dropout(e, self.config.dropout, self.is_training())?
            }
            _ => x.clone(),
        };
        for block in &self.h {
            x = block.call(&x)?;
        }
        if let (Some(ln), Some(head)) = (&self.ln_f, &self.lm_head) {
            x = head.call(&ln.call(&x)?)?;
        }
        Ok(x)
    }
}
