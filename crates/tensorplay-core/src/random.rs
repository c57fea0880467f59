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
    /// A uniform 64-bit word: the seed [`crate::nn::init`] draws for each tensor it fills.
    pub fn next_u64(&mut self) -> u64 {
        self.rng.random::<u64>()
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

/// Length of [`get_rng_state`]'s bytes.
const RNG_STATE_LEN: usize = 32 + 8 + 16 + 1 + 8;

/// The default generator's state as bytes (`torch.get_rng_state`): ChaCha8's key, stream and
/// position and the spare normal sample, 65 bytes. [`set_rng_state`] restores it, so a
/// resumed run draws what the uninterrupted one would.
pub fn get_rng_state() -> Vec<u8> {
    default_generator().state()
}

/// Restores the default generator from [`get_rng_state`]'s bytes (`torch.set_rng_state`).
///
/// # Errors
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when `state` is not 65 bytes
/// with a flag byte of 0 or 1; the generator is then unchanged.
pub fn set_rng_state(state: &[u8]) -> crate::Result<()> {
    let g = Generator::from_state(state)?;
    *default_generator() = g;
    Ok(())
}

impl Generator {
    /// The state as [`get_rng_state`] gives it.
    pub fn state(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(RNG_STATE_LEN);
        out.extend_from_slice(&self.rng.get_seed());
        out.extend_from_slice(&self.rng.get_stream().to_le_bytes());
        out.extend_from_slice(&self.rng.get_word_pos().to_le_bytes());
        out.push(u8::from(self.spare_normal.is_some()));
        out.extend_from_slice(&self.spare_normal.unwrap_or(0.0).to_le_bytes());
        out
    }

    /// The generator whose [`state`](Generator::state) is `state`.
    ///
    /// # Errors
    /// As [`set_rng_state`].
    pub fn from_state(state: &[u8]) -> crate::Result<Generator> {
        if state.len() != RNG_STATE_LEN || state[56] > 1 {
            return Err(crate::Error::invalid(
                "set_rng_state",
                "state",
                format!("the {RNG_STATE_LEN} bytes get_rng_state returns"),
                format!("{} bytes (flag byte {:?})", state.len(), state.get(56)),
            ));
        }
        let mut seed = [0u8; 32];
        seed.copy_from_slice(&state[..32]);
        let mut b8 = [0u8; 8];
        b8.copy_from_slice(&state[32..40]);
        let stream = u64::from_le_bytes(b8);
        let mut b16 = [0u8; 16];
        b16.copy_from_slice(&state[40..56]);
        b8.copy_from_slice(&state[57..65]);
        let mut rng = ChaCha8Rng::from_seed(seed);
        rng.set_stream(stream);
        rng.set_word_pos(u128::from_le_bytes(b16));
        Ok(Generator {
            rng,
            spare_normal: (state[56] == 1).then(|| f64::from_le_bytes(b8)),
        })
    }
}

/// Counter-based samples: sample `i` of the stream of `seed` is a function of `(seed, i)`
/// alone, so any range of a tensor's elements can be drawn without drawing those before it
/// (how a rank fills its shard with the values of the whole tensor's rows). Uniform sample `i`
/// takes the stream's 64-bit word `i`; normal samples `2k` and `2k + 1` are the Box-Muller pair
/// of uniforms `2k` and `2k + 1`, as [`Generator::normal`] makes them.
pub(crate) struct Stream {
    rng: ChaCha8Rng,
}

impl Stream {
    pub(crate) fn new(seed: u64) -> Stream {
        Stream {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }
    /// Uniform samples in `[0, 1)` number `start..start + out.len()`.
    pub(crate) fn uniform(&mut self, start: usize, out: &mut [f64]) {
        // one 64-bit sample is two of ChaCha's 32-bit words
        self.rng.set_word_pos(2 * start as u128);
        for x in out {
            *x = self.rng.random::<f64>();
        }
    }
    /// Standard normal samples number `start..start + out.len()`.
    pub(crate) fn normal(&mut self, start: usize, out: &mut [f64]) {
        let pair = start / 2;
        self.rng.set_word_pos(4 * pair as u128);
        let mut skip = start % 2;
        let mut i = 0;
        while i < out.len() {
            let u1 = 1.0 - self.rng.random::<f64>();
            let u2 = self.rng.random::<f64>();
            let r = (-2.0 * u1.ln()).sqrt();
            let t = 2.0 * std::f64::consts::PI * u2;
            for z in [r * t.cos(), r * t.sin()] {
                if skip > 0 {
                    skip -= 1;
                } else if i < out.len() {
                    out[i] = z;
                    i += 1;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any range of a stream equals the same range of the whole stream.
    #[test]
    fn stream_ranges_equal_the_whole_streams_elements() {
        let cases: [(&str, usize, usize); 4] = [
            ("from the start", 0, 5),
            ("odd start (second of a Box-Muller pair)", 3, 4),
            ("even start", 6, 7),
            ("one element", 9, 1),
        ];
        let mut whole_u = vec![0.0; 20];
        let mut whole_n = vec![0.0; 20];
        Stream::new(7).uniform(0, &mut whole_u);
        Stream::new(7).normal(0, &mut whole_n);
        for (name, start, n) in cases {
            let mut u = vec![0.0; n];
            let mut z = vec![0.0; n];
            Stream::new(7).uniform(start, &mut u);
            Stream::new(7).normal(start, &mut z);
            assert_eq!(u, whole_u[start..start + n], "{name}: uniform");
            assert_eq!(z, whole_n[start..start + n], "{name}: normal");
        }
        // the uniforms are in range, and another seed gives other samples
        assert!(whole_u.iter().all(|x| (0.0..1.0).contains(x)));
        let mut other = vec![0.0; 20];
        Stream::new(8).uniform(0, &mut other);
        assert_ne!(other, whole_u);
    }
}

#[cfg(test)]
mod state_tests {
    use super::*;

    #[test]
    fn a_restored_state_draws_the_same_samples() {
        let mut g = Generator::new(42);
        let _ = g.normal(); // leaves a spare normal sample
        let _ = g.next_u64();
        let saved = g.state();
        let want: Vec<f64> = (0..5).map(|_| g.normal()).collect();
        let mut back = Generator::from_state(&saved).unwrap();
        let got: Vec<f64> = (0..5).map(|_| back.normal()).collect();
        assert_eq!(got, want);
        let mut flag = saved.clone();
        flag[56] = 7;
        let cases: [(&str, Vec<u8>); 3] = [
            ("short", vec![0; 10]),
            ("long", vec![0; 66]),
            ("bad flag", flag),
        ];
        for (name, bad) in cases {
            assert!(Generator::from_state(&bad).is_err(), "{name}");
        }
    }
}
