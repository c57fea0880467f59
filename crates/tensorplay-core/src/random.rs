//! The seedable random generator behind `rand`, `randn`, `randint`, dropout and layer
//! initialisation.
//!
//! One generator per process, seeded with 0 at start (`manual_seed` changes it), so a program
//! that seeds once is reproducible run to run. The stream is ChaCha8; normal samples use the
//! Box-Muller transform. The sequences are ours, not PyTorch's.

use std::sync::{Mutex, MutexGuard, OnceLock};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A seedable pseudo-random generator (`torch.Generator`).
#[derive(Debug, Clone)]
pub struct Generator {
    rng: ChaCha8Rng,
    spare_normal: Option<f64>,
}

impl Generator {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Generator {
        Generator {
            rng: ChaCha8Rng::seed_from_u64(seed),
            spare_normal: None,
        }
    }
    /// Re-seeds (`manual_seed`).
    pub fn manual_seed(&mut self, seed: u64) {
        *self = Generator::new(seed);
    }
    /// A uniform sample in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }
    /// A standard normal sample.
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare_normal.take() {
            return z;
        }
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        self.spare_normal = Some(r * t.sin());
        r * t.cos()
    }
    /// A uniform integer in `[low, high)`; `high > low` is the caller's duty.
    pub fn int_range(&mut self, low: i64, high: i64) -> i64 {
        self.rng.random_range(low..high)
    }
}

fn global() -> &'static Mutex<Generator> {
    static G: OnceLock<Mutex<Generator>> = OnceLock::new();
    G.get_or_init(|| Mutex::new(Generator::new(0)))
}

/// Locks the process-wide default generator.
pub fn default_generator() -> MutexGuard<'static, Generator> {
    global().lock().unwrap_or_else(|e| e.into_inner())
}

/// Seeds the process-wide default generator (`torch.manual_seed`).
pub fn manual_seed(seed: u64) {
    default_generator().manual_seed(seed);
}
