//! Which vector instructions the CPU kernels use, chosen at run time (PyTorch's
//! `ATEN_CPU_CAPABILITY`): the best level the processor has, or the level set by
//! `TENSORPLAY_CPU_CAPABILITY` / [`set_cpu_capability`]. [`dispatch`] runs a kernel compiled
//! for that level. The kernels are written once as plain loops (`#[inline(always)]`) and
//! compiled three times by the trampolines below, so the compiler vectorises each copy for
//! its instruction set; nothing depends on `-C target-cpu`.

use std::sync::atomic::{AtomicU8, Ordering};

use crate::{Error, Result};

/// A level of vector instructions the CPU kernels can be compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CpuCapability {
    /// Plain code for the baseline of the target (SSE2 on x86-64): the fallback everywhere.
    Default,
    /// x86-64 with AVX2 and FMA (256-bit vectors).
    Avx2,
    /// x86-64 with AVX-512 F/VL/BW/DQ (512-bit vectors).
    Avx512,
}

impl CpuCapability {
    /// Every level, lowest first.
    pub const ALL: [CpuCapability; 3] = [
        CpuCapability::Default,
        CpuCapability::Avx2,
        CpuCapability::Avx512,
    ];

    /// The level's name as `TENSORPLAY_CPU_CAPABILITY` spells it: `default`, `avx2`, `avx512`.
    pub fn name(self) -> &'static str {
        match self {
            CpuCapability::Default => "default",
            CpuCapability::Avx2 => "avx2",
            CpuCapability::Avx512 => "avx512",
        }
    }

    /// Whether this processor can run kernels compiled for the level.
    pub fn is_supported(self) -> bool {
        match self {
            CpuCapability::Default => true,
            #[cfg(target_arch = "x86_64")]
            CpuCapability::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(target_arch = "x86_64")]
            CpuCapability::Avx512 => {
                CpuCapability::Avx2.is_supported()
                    && std::arch::is_x86_feature_detected!("avx512f")
                    && std::arch::is_x86_feature_detected!("avx512vl")
                    && std::arch::is_x86_feature_detected!("avx512bw")
                    && std::arch::is_x86_feature_detected!("avx512dq")
            }
            #[cfg(not(target_arch = "x86_64"))]
            CpuCapability::Avx2 | CpuCapability::Avx512 => false,
        }
    }

    fn code(self) -> u8 {
        match self {
            CpuCapability::Default => 1,
            CpuCapability::Avx2 => 2,
            CpuCapability::Avx512 => 3,
        }
    }

    fn from_code(c: u8) -> Option<CpuCapability> {
        CpuCapability::ALL.into_iter().find(|l| l.code() == c)
    }

    fn parse(s: &str) -> Option<CpuCapability> {
        CpuCapability::ALL
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(s.trim()))
    }
}

impl std::fmt::Display for CpuCapability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// 0 until the first kernel asks; then the level's code.
static LEVEL: AtomicU8 = AtomicU8::new(0);

/// The best level this processor supports.
fn best() -> CpuCapability {
    CpuCapability::ALL
        .into_iter()
        .rev()
        .find(|l| l.is_supported())
        .unwrap_or(CpuCapability::Default)
}

/// The level the CPU kernels use (`torch.backends.cpu.get_cpu_capability()`): the one set by
/// [`set_cpu_capability`], else `TENSORPLAY_CPU_CAPABILITY` when it names a level this
/// processor supports (a higher one is lowered to the best supported, with a warning), else the
/// best supported.
pub fn cpu_capability() -> CpuCapability {
    if let Some(l) = CpuCapability::from_code(LEVEL.load(Ordering::Relaxed)) {
        return l;
    }
    let best = best();
    let chosen = match std::env::var("TENSORPLAY_CPU_CAPABILITY") {
        Ok(v) => match CpuCapability::parse(&v) {
            Some(l) if l <= best => l,
            Some(l) => {
                super::warn_once(
                    "TENSORPLAY_CPU_CAPABILITY",
                    &format!(
                        "TENSORPLAY_CPU_CAPABILITY={v}: this processor lacks {l}; using {best}"
                    ),
                );
                best
            }
            None => {
                super::warn_once(
                    "TENSORPLAY_CPU_CAPABILITY",
                    &format!(
                        "TENSORPLAY_CPU_CAPABILITY={v:?} is not one of default, avx2, avx512; \
                         using {best}"
                    ),
                );
                best
            }
        },
        Err(_) => best,
    };
    // a concurrent first call chooses the same level
    let _ = LEVEL.compare_exchange(0, chosen.code(), Ordering::Relaxed, Ordering::Relaxed);
    CpuCapability::from_code(LEVEL.load(Ordering::Relaxed)).unwrap_or(chosen)
}

/// Makes the CPU kernels use `level` from now on in this process (tests use it to run every
/// path the machine has; every level gives the same bits, except for which NaN a NaN result
/// is).
///
/// Errors: [`Error::InvalidArgument`] naming `level` when this processor does not support it.
pub fn set_cpu_capability(level: CpuCapability) -> Result<()> {
    if !level.is_supported() {
        return Err(Error::invalid(
            "set_cpu_capability",
            "level",
            format!("a level this processor supports (up to {})", best()),
            level.name(),
        ));
    }
    LEVEL.store(level.code(), Ordering::Relaxed);
    Ok(())
}

/// Runs `f` compiled for the current [`cpu_capability`]. `f` should call `#[inline(always)]`
/// kernels so that their loops are compiled inside the trampoline for its instruction set.
#[inline(always)]
pub(crate) fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    match cpu_capability() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `cpu_capability` returns Avx512 only when `is_supported` detected every
        // feature the trampoline enables (set_cpu_capability refuses unsupported levels).
        CpuCapability::Avx512 => unsafe { with_avx512(f) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, Avx2 only when AVX2 and FMA were detected.
        CpuCapability::Avx2 => unsafe { with_avx2(f) },
        #[cfg(not(target_arch = "x86_64"))]
        CpuCapability::Avx512 | CpuCapability::Avx2 => f(),
        CpuCapability::Default => f(),
    }
}

/// Whether bfloat16 products should run on `VDPBF16PS` (AVX512_BF16's dot products): where
/// the processor has it and issues it fast enough to beat widening to float32, which holds on
/// AMD's processors (Zen 4: 160-185 GFLOP/s on one thread against 100-110 for the float32
/// FMA path) and not on the Intel Xeon measured (77 against 120-130: one `VDPBF16PS` every
/// 2.2 cycles). Decided by vendor, not timed, so a machine always takes the same path and
/// gives the same bits (docs/decisions.md, issue 39).
pub(crate) fn fast_bf16_dot() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static FAST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *FAST.get_or_init(|| {
            #[allow(unused_unsafe)]
            // SAFETY: CPUID leaf 0 exists on every x86-64 processor (the intrinsic is safe
            // from Rust 1.90; the block keeps the 1.89 minimum compiling)
            let id = unsafe { std::arch::x86_64::__cpuid(0) };
            let vendor: Vec<u8> = [id.ebx, id.edx, id.ecx]
                .iter()
                .flat_map(|r| r.to_le_bytes())
                .collect();
            std::arch::is_x86_feature_detected!("avx512bf16") && vendor == b"AuthenticAMD"
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Runs `f` compiled for the current [`cpu_capability`] (AVX-512, AVX2 or the baseline), so
/// that plain loops inside it vectorize for the processor: the same run-time choice the core's
/// CPU kernels make, for other crates' element loops (the collectives' 16-bit reductions).
/// `f` should call only `#[inline(always)]` functions in its hot loops; whatever it calls out
/// of line runs as compiled for the baseline.
#[inline(always)]
pub fn with_cpu_capability<R>(f: impl FnOnce() -> R) -> R {
    dispatch(f)
}

/// `f()` compiled with AVX-512.
///
/// # Safety
/// The processor must support every feature enabled here.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
unsafe fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// `f()` compiled with AVX2 and FMA.
///
/// # Safety
/// The processor must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt,popcnt")]
unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}
