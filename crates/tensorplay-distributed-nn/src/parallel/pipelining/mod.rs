//! Pipeline parallelism (`torch.distributed.pipelining`): a model split by layers into stages
//! on the ranks of a pipeline group, each step's batch split into micro-batches that flow
//! through the stages under a schedule.
//!
//! - [`schedule`]: schedules as data, each a pure function from the pipeline's shape to every
//!   rank's list of actions, with their text form.
//! - [`sim`]: the simulator that checks every list (order, completeness, deadlock) and
//!   measures its bubble before it runs.

pub mod schedule;
pub mod sim;

pub use schedule::{Action, ActionKind, PipelineShape, ScheduleError, ScheduleKind};
pub use sim::{Costs, SimReport, simulate};
