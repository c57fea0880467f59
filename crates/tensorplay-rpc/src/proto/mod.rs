//! The RPC protocol's state, without sockets, clocks or globals: each table is a state
//! machine owned by one agent, whose transitions take what arrived (a message, a dropped
//! handle) and return what to send. The agent (`crate::agent`) is the I/O shell around them;
//! the tests drive several tables in memory, delivering messages in any order.

pub(crate) mod context;
pub(crate) mod message;
pub(crate) mod owner;
pub(crate) mod user;

#[cfg(test)]
mod sim;
#[cfg(test)]
mod sim_rref;
