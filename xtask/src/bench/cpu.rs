//! The machine a benchmark ran on: the CPU model and its SIMD flags from `/proc/cpuinfo`,
//! printed first by every bench command (the numbers mean little without them).

/// The x86 flags that decide which kernels run (ours through `gemm`'s runtime dispatch,
/// PyTorch's through its CPU capability), in the order printed.
const X86_FLAGS: &[&str] = &[
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx_vnni",
    "avx512f",
    "avx512dq",
    "avx512cd",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
];

/// The same for Arm (`Features` in `/proc/cpuinfo`).
const ARM_FLAGS: &[&str] = &["asimd", "asimdhp", "asimddp", "sve", "sve2", "bf16", "i8mm"];

/// What `/proc/cpuinfo` says about the CPU.
#[derive(Debug, PartialEq)]
pub(crate) struct Cpu {
    /// `model name` of the first processor (`unknown` when absent).
    pub(crate) model: String,
    /// Number of logical CPUs (`processor` entries).
    pub(crate) logical: usize,
    /// The flags of [`X86_FLAGS`] (or [`ARM_FLAGS`]) the CPU has, in that order.
    pub(crate) present: Vec<&'static str>,
    /// Those it lacks.
    pub(crate) absent: Vec<&'static str>,
}

/// Reads the text of `/proc/cpuinfo`.
pub(crate) fn parse(cpuinfo: &str) -> Cpu {
    let value = |key: &str| {
        cpuinfo.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
    };
    let logical = cpuinfo
        .lines()
        .filter(|l| {
            l.split_once(':')
                .is_some_and(|(k, _)| k.trim() == "processor")
        })
        .count();
    let (flags, known) = match value("flags") {
        Some(f) => (f, X86_FLAGS),
        None => (value("Features").unwrap_or_default(), ARM_FLAGS),
    };
    let have: Vec<&str> = flags.split_whitespace().collect();
    let (present, absent) = known.iter().partition(|f| have.contains(f));
    Cpu {
        model: value("model name").unwrap_or_else(|| "unknown".into()),
        logical,
        present,
        absent,
    }
}

/// Prints `cpu: <model>, N logical CPUs` and `simd: <flags>; absent: <flags>`.
pub(crate) fn print_cpu() {
    match std::fs::read_to_string("/proc/cpuinfo") {
        Ok(text) => {
            let c = parse(&text);
            println!("cpu: {}, {} logical CPUs", c.model, c.logical);
            println!(
                "simd: {}; absent: {}",
                join_or_none(&c.present),
                join_or_none(&c.absent)
            );
        }
        Err(e) => {
            println!("cpu: unknown (/proc/cpuinfo: {e})");
            println!("simd: unknown");
        }
    }
}

fn join_or_none(v: &[&str]) -> String {
    if v.is_empty() {
        "none".into()
    } else {
        v.join(" ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Case {
        name: &'static str,
        text: &'static str,
        want: Cpu,
    }

    fn check(c: Case) {
        assert_eq!(parse(c.text), c.want, "case {}", c.name);
    }

    #[test]
    fn reads_the_model_and_the_simd_flags() {
        let cases = [
            Case {
                name: "x86, two processors",
                text: "processor\t: 0\nmodel name\t: AMD EPYC 7B13\n\
                       flags\t\t: fpu sse4_2 avx avx2 fma f16c bmi2\n\n\
                       processor\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2\n",
                want: Cpu {
                    model: "AMD EPYC 7B13".into(),
                    logical: 2,
                    present: vec!["sse4_2", "avx", "avx2", "fma", "f16c"],
                    absent: X86_FLAGS[5..].to_vec(),
                },
            },
            Case {
                name: "arm, no model name",
                text: "processor\t: 0\nFeatures\t: fp asimd sve i8mm\n",
                want: Cpu {
                    model: "unknown".into(),
                    logical: 1,
                    present: vec!["asimd", "sve", "i8mm"],
                    absent: vec!["asimdhp", "asimddp", "sve2", "bf16"],
                },
            },
        ];
        for c in cases {
            check(c);
        }
    }
}
