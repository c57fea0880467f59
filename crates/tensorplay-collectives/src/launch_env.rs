//! The job's environment as launchers describe it: torchrun's variables (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, as `tensorplay-run` and `spawn`
//! set them), else Slurm's (`srun ./train`), else Open MPI's (`mpirun ./train`), so a program
//! using the `env://` rendezvous runs under any of them without a wrapper script.
//!
//! | torchrun | Slurm | Open MPI |
//! |---|---|---|
//! | `RANK` | `SLURM_PROCID` | `OMPI_COMM_WORLD_RANK` |
//! | `WORLD_SIZE` | `SLURM_NTASKS` | `OMPI_COMM_WORLD_SIZE` |
//! | `LOCAL_RANK` | `SLURM_LOCALID` | `OMPI_COMM_WORLD_LOCAL_RANK` |
//! | `MASTER_ADDR` | the first host of `SLURM_JOB_NODELIST` | `127.0.0.1` when every rank is on this host |
//! | `MASTER_PORT` | `20000 + SLURM_JOB_ID % 20000` | `29500` |
//!
//! A variable that is set always wins over the derived ones (PyTorch users set `MASTER_ADDR`
//! and `MASTER_PORT` by hand under Slurm; that keeps working).

/// Where a value of the job's environment came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// The value.
    pub value: String,
    /// The variable (or rule) it came from, e.g. `"SLURM_PROCID"` or
    /// `"the first host of SLURM_JOB_NODELIST"`.
    pub from: String,
}

/// Looks `name` (one of torchrun's variables) up in the environment `get`, falling back to
/// Slurm's and Open MPI's; `None` when no launcher describes it.
pub fn lookup(name: &str, get: &dyn Fn(&str) -> Option<String>) -> Option<Found> {
    let found = |var: &str| {
        get(var).map(|value| Found {
            value,
            from: var.to_string(),
        })
    };
    if let Some(f) = found(name) {
        return Some(f);
    }
    let (slurm, ompi) = match name {
        "RANK" => ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK"),
        "WORLD_SIZE" => ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"),
        "LOCAL_RANK" => ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"),
        "MASTER_ADDR" => {
            if let Some(list) = get("SLURM_JOB_NODELIST").or_else(|| get("SLURM_NODELIST")) {
                return first_host(&list).map(|value| Found {
                    value,
                    from: "the first host of SLURM_JOB_NODELIST".into(),
                });
            }
            let (size, local) = (
                get("OMPI_COMM_WORLD_SIZE"),
                get("OMPI_COMM_WORLD_LOCAL_SIZE"),
            );
            return match (size, local) {
                (Some(s), Some(l)) if s.trim() == l.trim() => Some(Found {
                    value: "127.0.0.1".into(),
                    from: "Open MPI (every rank on this host)".into(),
                }),
                _ => None,
            };
        }
        "MASTER_PORT" => {
            if let Some(id) = get("SLURM_JOB_ID").and_then(|j| j.trim().parse::<u64>().ok()) {
                return Some(Found {
                    value: (20000 + id % 20000).to_string(),
                    from: "SLURM_JOB_ID (20000 + job id % 20000)".into(),
                });
            }
            if get("OMPI_COMM_WORLD_SIZE").is_some() {
                return Some(Found {
                    value: "29500".into(),
                    from: "Open MPI (the default port 29500)".into(),
                });
            }
            return None;
        }
        _ => return None,
    };
    found(slurm).or_else(|| found(ompi))
}

/// [`lookup`] in this process's environment.
pub fn lookup_env(name: &str) -> Option<Found> {
    lookup(name, &|v| std::env::var(v).ok())
}

/// The first host of a Slurm hostlist (`"node[01-04,07],gpu2"` → `"node01"`); `None` when the
/// list is empty or malformed.
pub fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    // the first entry ends at a comma outside brackets
    let mut depth = 0usize;
    let mut end = list.len();
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.checked_sub(1)?,
            ',' if depth == 0 => {
                end = i;
                break;
            }
            _ => {}
        }
    }
    let entry = &list[..end];
    if entry.is_empty() {
        return None;
    }
    let Some(open) = entry.find('[') else {
        return Some(entry.to_string());
    };
    let close = entry[open..].find(']')? + open;
    let prefix = &entry[..open];
    let suffix = &entry[close + 1..];
    // the first range (or number) inside the brackets, zero padding kept
    let inner = &entry[open + 1..close];
    let first = inner.split(',').next()?.split('-').next()?.trim();
    if first.is_empty() || !first.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    Some(format!("{prefix}{first}{suffix}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn hostlists_give_their_first_host() {
        assert_eq!(first_host("node01").as_deref(), Some("node01"));
        assert_eq!(first_host("node[01-04]").as_deref(), Some("node01"));
        assert_eq!(first_host("node[07,01-03]").as_deref(), Some("node07"));
        assert_eq!(first_host("gpu[3-4]-ib,cpu1").as_deref(), Some("gpu3-ib"));
        assert_eq!(first_host("a1,b[2-3]").as_deref(), Some("a1"));
        assert_eq!(first_host("rack[001-010]x").as_deref(), Some("rack001x"));
        assert_eq!(first_host(""), None);
        assert_eq!(first_host("node[]"), None);
        assert_eq!(first_host("node[a-b]"), None);
        assert_eq!(first_host("node]"), None);
    }

    #[test]
    fn torchrun_then_slurm_then_open_mpi() {
        let e = env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "cn[10-13]"),
            ("SLURM_JOB_ID", "123456"),
        ]);
        let v = |n: &str| lookup(n, &e).map(|f| f.value);
        assert_eq!(v("RANK").as_deref(), Some("3"));
        assert_eq!(v("WORLD_SIZE").as_deref(), Some("8"));
        assert_eq!(v("LOCAL_RANK").as_deref(), Some("1"));
        assert_eq!(v("MASTER_ADDR").as_deref(), Some("cn10"));
        assert_eq!(v("MASTER_PORT").as_deref(), Some("23456"));
        // set variables win
        let e = env(&[
            ("SLURM_PROCID", "3"),
            ("RANK", "5"),
            ("MASTER_PORT", "1234"),
        ]);
        assert_eq!(lookup("RANK", &e).unwrap().from, "RANK");
        assert_eq!(lookup("MASTER_PORT", &e).unwrap().value, "1234");
        // Open MPI on one host
        let e = env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ]);
        assert_eq!(lookup("RANK", &e).unwrap().from, "OMPI_COMM_WORLD_RANK");
        assert_eq!(lookup("MASTER_ADDR", &e).unwrap().value, "127.0.0.1");
        assert_eq!(lookup("MASTER_PORT", &e).unwrap().value, "29500");
        // Open MPI over several hosts needs MASTER_ADDR
        let e = env(&[
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]);
        assert_eq!(lookup("MASTER_ADDR", &e), None);
        assert_eq!(lookup("RANK", &env(&[])), None);
    }
}
