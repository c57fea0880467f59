//! Fully sharded data parallelism (`torch.distributed.fsdp.fully_shard`, issue 38), being
//! built. What is here so far is its arithmetic, pure and tested in memory:
//!
//! - [`param`]: how one parameter's dimension 0 is split across the ranks (`torch.chunk`'s
//!   rule, each piece padded to the chunk size in the collectives' buffers);
//! - [`group`]: the flat layout in which the parameters of one `fully_shard` call are
//!   all-gathered and their gradients reduce-scattered together.
//!
//! `fully_shard` itself (the hooks that gather before forward and backward and free after,
//! the reduce-scatter into the sharded parameters' `.grad`) builds on these.

// used by `fully_shard`, which is not written yet; the tests exercise everything
#![cfg_attr(not(test), allow(dead_code))]

pub(crate) mod group;
pub(crate) mod param;
