//! Pipeline parallelism (`torch.distributed.pipelining`): a model split by layers into stages
//! on the ranks of a pipeline group, each step's batch split into micro-batches that flow
//! through the stages under a schedule.
//!
//! - [`schedule`]: schedules as data, each a pure function from the pipeline's shape to every
//!   rank's list of actions, with their text form.
//! - [`sim`]: the simulator that checks every list (order, completeness, deadlock) and
//!   measures its bubble before it runs.
//! - [`PipelineStage`] (a part of the model on this rank) and the schedules users call,
//!   [`ScheduleGPipe`], [`Schedule1F1B`], [`ScheduleInterleaved1F1B`] and
//!   [`ScheduleInterleavedZeroBubble`], each a [`PipelineSchedule`] whose executor runs this
//!   rank's list over batched point-to-point sends and receives.

mod agreement;
mod error;
mod executor;
pub mod schedule;
mod schedules;
pub mod sim;
mod stage;
mod step_sync;
mod wire;

pub use error::PipelineError;
pub use executor::LossFn;
pub use schedule::{
    Action, ActionKind, PipelineShape, ScheduleError, ScheduleKind, from_csv, to_csv,
};
pub use schedules::{
    PipelineSchedule, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble, loss_fn,
};
pub use sim::{Costs, SimReport, simulate};
pub use stage::{MultiIo, PipelineStage, StageModule};
