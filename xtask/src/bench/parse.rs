//! Parsers of the lines the benchmark programs print, ours and PyTorch's alike (the first
//! token, a program prefix such as `tensorplay-core` or `torch-core`, differs and is skipped).

/// One measured value of a program's output.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Metric {
    /// The summary table's metric (one token, e.g. `matmul_512`).
    pub(crate) key: String,
    pub(crate) value: f64,
    pub(crate) unit: String,
}

/// The metric token of a core bench line's name: its first word, and for `matmul N^3 f32`
/// the size (`matmul_512`), for another dtype the dtype too (`matmul 1024^3 bf16`:
/// `matmul_bf16_1024`).
fn core_token(words: &[&str]) -> String {
    match words {
        ["matmul", size, dtype, ..] if *dtype != "f32" => {
            format!("matmul_{dtype}_{}", size.split('^').next().unwrap_or(size))
        }
        ["matmul", size, ..] => {
            format!("matmul_{}", size.split('^').next().unwrap_or(size))
        }
        [first, ..] => first.to_string(),
        [] => String::new(),
    }
}

/// Parses the core benches' lines, `<prefix> mlp_step batch64   123.4 us/step`,
/// `<prefix> matmul 512^3 f32   80.1 GFLOP/s` and `<prefix> gpt_step batch16x64 ... us/step`,
/// into the metrics `mlp_step`, `matmul_512`, `gpt_step`; and the ops benches' lines
/// `<prefix>-ops exp_1m 512.3 us` into `exp_1m` (unit `us`).
pub(crate) fn parse_core(text: &str) -> Vec<Metric> {
    let mut out = Vec::new();
    for line in text.lines() {
        let toks: Vec<&str> = line.split_whitespace().collect();
        if toks.len() < 4 {
            continue;
        }
        let unit = toks[toks.len() - 1];
        // `us`: the ops rows (`<prefix>-ops exp_1m 512.3 us`)
        let ops_row = unit == "us" && toks.len() == 4 && toks[0].ends_with("-ops");
        if unit != "us/step" && unit != "GFLOP/s" && !ops_row {
            continue;
        }
        let Ok(value) = toks[toks.len() - 2].parse::<f64>() else {
            continue;
        };
        out.push(Metric {
            key: core_token(&toks[1..toks.len() - 2]),
            value,
            unit: unit.to_string(),
        });
    }
    out
}

/// The bfloat16 rows of the anchors' `torch_bf16_step.py`: `torch-bf16 matmul 1024 bf16 Y
/// GFLOP/s` as `matmul_bf16_1024` and `torch-bf16 gpt step autocast-bf16 B us` as
/// `gpt_step_autocast_bf16` (unit `us/step`); its float32 rows (measured by the core anchors
/// already) and its loss line are skipped.
pub(crate) fn parse_bf16(text: &str) -> Vec<Metric> {
    text.lines()
        .filter_map(|line| {
            let toks: Vec<&str> = line.split_whitespace().collect();
            let (key, value, unit) = match toks.as_slice() {
                ["torch-bf16", "matmul", size, "bf16", v, "GFLOP/s"] => {
                    (format!("matmul_bf16_{size}"), v, "GFLOP/s")
                }
                ["torch-bf16", "gpt", "step", "autocast-bf16", v, "us"] => {
                    ("gpt_step_autocast_bf16".to_string(), v, "us/step")
                }
                _ => return None,
            };
            Some(Metric {
                key,
                value: value.parse().ok()?,
                unit: unit.into(),
            })
        })
        .collect()
}

/// The wall time in seconds of a single-process training run: `gpt_distributed
/// --single-process`'s table row `single-process  54.7s  91.2` or `torch_gpt.py train`'s
/// `pytorch: validation loss 2.2354 (200 steps, seed 0, 12.3 s, 2 threads)`.
pub(crate) fn parse_train_seconds(text: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let toks: Vec<&str> = line.split_whitespace().collect();
        match toks.as_slice() {
            ["single-process", wall, _per_step] => wall.strip_suffix('s')?.parse().ok(),
            ["pytorch:", ..] => {
                let i = toks.iter().position(|t| *t == "s,")?;
                toks.get(i.checked_sub(1)?)?.parse().ok()
            }
            _ => None,
        }
    })
}

/// Parses the lines both RPC benchmarks print (the prefix differs):
/// `<p> rpc_sync small  p50 X us  p99 Y us`, `<p> rpc_async small  X calls/s (5000 in flight)`,
/// `<p> echo N MiB  X ms/round trip  Y GB/s`, `<p> remote+to_here   p50 X us`,
/// `<p> RemoteModule Linear(16,8) forward  p50 X us`.
pub(crate) fn parse_rpc(text: &str) -> Vec<Metric> {
    let mut out = Vec::new();
    let mut push = |key: String, value: Option<f64>, unit: &str| {
        if let Some(value) = value {
            out.push(Metric {
                key,
                value,
                unit: unit.to_string(),
            });
        }
    };
    for line in text.lines() {
        let t: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| t.get(i).and_then(|s| s.parse::<f64>().ok());
        match t.get(1..3) {
            Some(["rpc_sync", "small"]) if t.len() >= 9 => {
                push("rpc_sync_p50".into(), num(4), "us");
                push("rpc_sync_p99".into(), num(7), "us");
            }
            Some(["rpc_async", "small"]) if t.len() >= 5 => {
                push("rpc_async_5000".into(), num(3), "calls/s");
            }
            Some(["echo", n]) if t.len() >= 9 && t[3] == "MiB" => {
                push(format!("echo_{n}MiB"), num(7), "GB/s");
            }
            Some(["remote+to_here", "p50"]) if t.len() >= 5 => {
                push("remote_to_here_p50".into(), num(3), "us");
            }
            Some(["RemoteModule", "Linear(16,8)"]) if t.len() >= 7 => {
                push("remote_module_fwd_p50".into(), num(5), "us");
            }
            _ => {}
        }
    }
    out
}

/// One collective of a `bench_collectives`-style table: name and bytes, time and bus bandwidth.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Coll {
    pub(crate) name: String,
    pub(crate) bytes: u64,
    pub(crate) us: f64,
    pub(crate) busbw: f64,
}

/// Parses `<prefix> <name> <bytes> B <us> us algbw <x> GB/s busbw <y> GB/s`.
pub(crate) fn parse_coll(text: &str) -> Vec<Coll> {
    text.lines()
        .filter_map(|l| {
            let t: Vec<&str> = l.split_whitespace().collect();
            if t.len() < 12 || t[3] != "B" || t[5] != "us" {
                return None;
            }
            Some(Coll {
                name: t[1].to_string(),
                bytes: t[2].parse().ok()?,
                us: t[4].parse().ok()?,
                busbw: t[10].parse().ok()?,
            })
        })
        .collect()
}

/// What one run of a DDP benchmark printed (`<prefix>-ddp ...` lines; the prefix differs).
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct DdpRun {
    pub(crate) params: Option<u64>,
    pub(crate) grad_bytes: Option<u64>,
    pub(crate) buckets: Option<i64>,
    pub(crate) local_us: Option<f64>,
    pub(crate) ddp_us: Option<f64>,
    pub(crate) overhead_us: Option<f64>,
    pub(crate) hidden_fraction: Option<f64>,
    pub(crate) wait_us: Option<f64>,
    pub(crate) allreduce_us: Option<f64>,
}

/// Parses the lines both DDP benchmarks print: `<p> params N grad_bytes B buckets K`,
/// `<p> local step X us`, `<p> ddp step Y us`, `<p> overhead Z us`, and ours only:
/// `<p> hidden fraction F`, `<p> exposed wait W us`, `<p> all-reduce time T us ...`.
pub(crate) fn parse_ddp(text: &str) -> DdpRun {
    let mut r = DdpRun::default();
    for line in text.lines() {
        let t: Vec<&str> = line.split_whitespace().collect();
        if !t.first().is_some_and(|p| p.ends_with("-ddp")) {
            continue;
        }
        let num = |i: usize| t.get(i).and_then(|s| s.parse::<f64>().ok());
        let us = |i: usize| num(i).filter(|_| t.get(i + 1) == Some(&"us"));
        match t.get(1..3) {
            Some(["params", _]) if t.len() >= 7 => {
                r.params = t[2].parse().ok();
                r.grad_bytes = t[4].parse().ok();
                r.buckets = t[6].parse().ok();
            }
            Some(["local", "step"]) => r.local_us = us(3),
            Some(["ddp", "step"]) => r.ddp_us = us(3),
            Some(["overhead", _]) => r.overhead_us = us(2),
            Some(["hidden", "fraction"]) => r.hidden_fraction = num(3),
            Some(["exposed", "wait"]) => r.wait_us = us(3),
            Some(["all-reduce", "time"]) => r.allreduce_us = us(3),
            _ => {}
        }
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_wall_times_are_read_from_both_programs() {
        let cases: &[(&str, &str, Option<f64>)] = &[
            (
                "ours",
                "single-process: validation loss 2.4\n\nrun  wall time  ms per step\nsingle-process        54.7s         91.2\n",
                Some(54.7),
            ),
            (
                "pytorch",
                "pytorch: validation loss 2.2354 (200 steps, seed 0, 12.3 s, 2 threads)\n",
                Some(12.3),
            ),
            (
                "the validation line only",
                "single-process: validation loss 2.4\n",
                None,
            ),
            ("nothing", "", None),
        ];
        for (case, text, want) in cases {
            assert_eq!(parse_train_seconds(text), *want, "{case}");
        }
    }

    fn m(key: &str, value: f64, unit: &str) -> Metric {
        Metric {
            key: key.into(),
            value,
            unit: unit.into(),
        }
    }

    #[test]
    fn parses_the_core_lines_of_both_programs() {
        let got = parse_core(
            "torch-core mlp_step batch64     151.2 us/step\n\
             torch-core matmul 512^3 f32      88.5 GFLOP/s\nnoise line\n\
             tensorplay-core matmul 1024^3 f32  70.0 GFLOP/s\n\
             tensorplay-core gpt_step batch16x64  139900.0 us/step\n\
             tensorplay-core matmul 1024^3 bf16  120.5 GFLOP/s\n\
             tensorplay-core gpt_step_autocast_bf16 batch16x64  99000.0 us/step\n\
             torch-ops softmax_1m 714.7 us\nops-total softmax_1m 1.0 us\n",
        );
        assert_eq!(
            got,
            [
                m("mlp_step", 151.2, "us/step"),
                m("matmul_512", 88.5, "GFLOP/s"),
                m("matmul_1024", 70.0, "GFLOP/s"),
                m("gpt_step", 139900.0, "us/step"),
                m("matmul_bf16_1024", 120.5, "GFLOP/s"),
                m("gpt_step_autocast_bf16", 99000.0, "us/step"),
                m("softmax_1m", 714.7, "us"),
            ]
        );
    }

    #[test]
    fn parses_the_bf16_anchor_lines() {
        let got = parse_bf16(
            "torch-bf16 matmul 1024 f32 95.0 GFLOP/s\n\
             torch-bf16 matmul 1024 bf16 180.2 GFLOP/s\n\
             torch-bf16 gpt step f32 41000.0 us\n\
             torch-bf16 gpt step autocast-bf16 52000.5 us\n\
             torch-bf16 gpt loss f32 1.5000 bf16 1.5100 after 50 steps\n\
             torch-bf16 matmul 1024 bf16 x GFLOP/s\n",
        );
        assert_eq!(
            got,
            [
                m("matmul_bf16_1024", 180.2, "GFLOP/s"),
                m("gpt_step_autocast_bf16", 52000.5, "us/step"),
            ]
        );
    }

    #[test]
    fn parses_the_collective_lines() {
        let got = parse_coll(
            "tensorplay-cpu all_reduce 4096 B 7.6 us algbw 0.5 GB/s busbw 0.539 GB/s\n\
             torch-gloo broadcast 1048576 B 1401.0 us algbw 0.7 GB/s busbw 0.748 GB/s\n\
             tensorplay-cpu short line\n",
        );
        assert_eq!(
            got,
            [
                Coll {
                    name: "all_reduce".into(),
                    bytes: 4096,
                    us: 7.6,
                    busbw: 0.539
                },
                Coll {
                    name: "broadcast".into(),
                    bytes: 1048576,
                    us: 1401.0,
                    busbw: 0.748
                },
            ]
        );
    }

    #[test]
    fn parses_the_ddp_lines_of_both_programs() {
        let text = "torch-ddp params 2913290 grad_bytes 11653160 buckets 2\n\
            torch-ddp local step    12000.5 us\n\
            torch-ddp ddp step      20000.0 us\n\
            torch-ddp overhead       7999.5 us\n\
            [rank 0] noise\n";
        let t = parse_ddp(text);
        assert_eq!(t.params, Some(2913290));
        assert_eq!(t.grad_bytes, Some(11653160));
        assert_eq!(t.buckets, Some(2));
        assert_eq!(t.local_us, Some(12000.5));
        assert_eq!(t.ddp_us, Some(20000.0));
        assert_eq!(t.overhead_us, Some(7999.5));
        assert_eq!(t.hidden_fraction, None);
        let o = parse_ddp(
            "tensorplay-ddp hidden fraction 0.875\n\
             tensorplay-ddp hidden fraction -\n\
             tensorplay-ddp exposed wait      310.2 us\n\
             tensorplay-ddp all-reduce time  2500.0 us (sum over buckets, 11653160 bytes)\n",
        );
        assert_eq!(o.hidden_fraction, None);
        assert_eq!(o.wait_us, Some(310.2));
        assert_eq!(o.allreduce_us, Some(2500.0));
        assert_eq!(
            parse_ddp("tensorplay-ddp hidden fraction 0.875\n").hidden_fraction,
            Some(0.875)
        );
    }

    #[test]
    fn parses_the_rpc_lines_of_both_programs() {
        let text = "torch-rpc rpc_sync small  p50    312.5 us  p99    901.0 us\n\
            torch-rpc rpc_async small       8123 calls/s (5000 in flight)\n\
            torch-rpc echo  16 MiB     13.40 ms/round trip    2.504 GB/s\n\
            torch-rpc remote+to_here   p50    700.2 us\n\
            torch-rpc RemoteModule Linear(16,8) forward  p50    400.0 us\n";
        assert_eq!(
            parse_rpc(text),
            [
                m("rpc_sync_p50", 312.5, "us"),
                m("rpc_sync_p99", 901.0, "us"),
                m("rpc_async_5000", 8123.0, "calls/s"),
                m("echo_16MiB", 2.504, "GB/s"),
                m("remote_to_here_p50", 700.2, "us"),
                m("remote_module_fwd_p50", 400.0, "us"),
            ]
        );
    }
}
