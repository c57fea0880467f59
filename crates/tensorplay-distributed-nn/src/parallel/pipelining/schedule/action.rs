//! One step of a schedule ([`Action`]) and the text form of per-rank action lists (PyTorch's
//! `_Action` strings, one rank per CSV line).

use std::fmt;
use std::str::FromStr;

/// What an [`Action`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionKind {
    /// Forward of one micro-batch through the stage (`F`).
    Forward,
    /// Full backward of one micro-batch: input and weight gradients (`B`).
    Backward,
    /// Backward for the stage's input gradients only (`I`); the weight gradients wait for a
    /// [`ActionKind::BackwardWeight`] of the same micro-batch.
    BackwardInput,
    /// The weight gradients of a micro-batch whose [`ActionKind::BackwardInput`] ran (`W`).
    BackwardWeight,
    /// Send the stage's output activation to the next stage (`SEND_F`).
    SendF,
    /// Receive the stage's input activation from the previous stage (`RECV_F`).
    RecvF,
    /// Send the gradient of the stage's input to the previous stage (`SEND_B`).
    SendB,
    /// Receive the gradient of the stage's output from the next stage (`RECV_B`).
    RecvB,
}

impl ActionKind {
    /// Every kind, in the order of their codes' table.
    pub const ALL: [ActionKind; 8] = [
        ActionKind::Forward,
        ActionKind::Backward,
        ActionKind::BackwardInput,
        ActionKind::BackwardWeight,
        ActionKind::SendF,
        ActionKind::RecvF,
        ActionKind::SendB,
        ActionKind::RecvB,
    ];

    /// The code in the text form (`F`, `B`, `I`, `W`, `SEND_F`, `RECV_F`, `SEND_B`,
    /// `RECV_B`), PyTorch's.
    pub fn code(self) -> &'static str {
        match self {
            ActionKind::Forward => "F",
            ActionKind::Backward => "B",
            ActionKind::BackwardInput => "I",
            ActionKind::BackwardWeight => "W",
            ActionKind::SendF => "SEND_F",
            ActionKind::RecvF => "RECV_F",
            ActionKind::SendB => "SEND_B",
            ActionKind::RecvB => "RECV_B",
        }
    }

    /// True for the compute kinds (`F`, `B`, `I`, `W`).
    pub fn is_compute(self) -> bool {
        matches!(
            self,
            ActionKind::Forward
                | ActionKind::Backward
                | ActionKind::BackwardInput
                | ActionKind::BackwardWeight
        )
    }
}

/// One action of a rank's list: `kind` for micro-batch `microbatch` of stage `stage` (the
/// global stage index, `0..num_stages * virtual stages`). Written `"{stage}{code}{microbatch}"`
/// as in PyTorch (`"0F3"`, `"1RECV_F0"`, `"2W1"`); see [`ActionKind::code`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Action {
    /// The stage it runs on (global index).
    pub stage: usize,
    /// What it does.
    pub kind: ActionKind,
    /// The micro-batch, `0..n_microbatches`.
    pub microbatch: usize,
}

impl Action {
    /// `Action { stage, kind, microbatch }`.
    pub fn new(stage: usize, kind: ActionKind, microbatch: usize) -> Action {
        Action {
            stage,
            kind,
            microbatch,
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage, self.kind.code(), self.microbatch)
    }
}

/// Why a text form did not parse: the line (1-based, 0 for one action), the token and what
/// was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("schedule text, line {line}: {token:?} is not an action ({expected})")]
pub struct ParseActionError {
    /// The line of the file (1-based; 0 when one action was parsed).
    pub line: usize,
    /// The token that failed.
    pub token: String,
    /// What an action looks like.
    pub expected: &'static str,
}

const EXPECTED: &str = "stage digits, one of F B I W SEND_F RECV_F SEND_B RECV_B, micro-batch \
                        digits: \"0F3\", \"1RECV_B2\"";

impl FromStr for Action {
    type Err = ParseActionError;

    /// Parses `"{stage}{code}{microbatch}"`, spaces around it allowed.
    fn from_str(s: &str) -> Result<Action, ParseActionError> {
        let bad = || ParseActionError {
            line: 0,
            token: s.to_string(),
            expected: EXPECTED,
        };
        let t = s.trim();
        let digits = t.bytes().take_while(u8::is_ascii_digit).count();
        let tail_digits = t.bytes().rev().take_while(u8::is_ascii_digit).count();
        if digits == 0 || tail_digits == 0 || digits + tail_digits >= t.len() {
            return Err(bad());
        }
        let code = &t[digits..t.len() - tail_digits];
        let kind = ActionKind::ALL
            .into_iter()
            .find(|k| k.code() == code)
            .ok_or_else(bad)?;
        let stage = t[..digits].parse().map_err(|_| bad())?;
        let microbatch = t[t.len() - tail_digits..].parse().map_err(|_| bad())?;
        Ok(Action::new(stage, kind, microbatch))
    }
}

/// Writes per-rank action lists as text: one line per rank, its actions separated by commas
/// (PyTorch's CSV form of a schedule; `ranks[r]` is rank `r`'s list).
pub fn to_csv(ranks: &[Vec<Action>]) -> String {
    let mut s = String::new();
    for list in ranks {
        let line: Vec<String> = list.iter().map(Action::to_string).collect();
        s.push_str(&line.join(","));
        s.push('\n');
    }
    s
}

/// Reads per-rank action lists written by [`to_csv`] (or by PyTorch's
/// `_dump_csv`): one line per rank, comma-separated actions; empty cells are skipped.
///
/// # Errors
/// A cell that is not an action, with its line.
pub fn from_csv(text: &str) -> Result<Vec<Vec<Action>>, ParseActionError> {
    let mut ranks = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let mut list = Vec::new();
        for cell in line.split(',') {
            if cell.trim().is_empty() {
                continue;
            }
            list.push(
                cell.parse::<Action>()
                    .map_err(|e| ParseActionError { line: i + 1, ..e })?,
            );
        }
        ranks.push(list);
    }
    Ok(ranks)
}
