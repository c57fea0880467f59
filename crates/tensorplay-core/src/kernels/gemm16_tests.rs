//! The 16-bit matrix products against a float64 reference of the inputs' exact values, rounded
//! once: every element within one unit in the last place of the 16-bit type (float32 sums in
//! another order than float64's can land on the other side of a rounding boundary).

use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

/// How an operand is laid out in its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lay {
    /// Row-major, contiguous.
    Rows,
    /// Column-major: a transposed view (row stride 1).
    Cols,
    /// Every other element of padded rows (column stride 2, row stride `2 * cols + 3`).
    Gaps,
}

/// The element types under test.
trait Elem16: Half16 + std::fmt::Debug {
    fn of(x: f64) -> Self;
    fn value(self) -> f64;
    /// The bits ordered as the numbers (negative below positive), for ulp distances.
    fn key(self) -> i32;
}

impl Elem16 for bf16 {
    fn of(x: f64) -> Self {
        bf16::from_f64(x)
    }
    fn value(self) -> f64 {
        self.to_f64()
    }
    fn key(self) -> i32 {
        let b = i32::from(self.to_bits());
        if b & 0x8000 != 0 { -(b & 0x7fff) } else { b }
    }
}

impl Elem16 for f16 {
    fn of(x: f64) -> Self {
        f16::from_f64(x)
    }
    fn value(self) -> f64 {
        self.to_f64()
    }
    fn key(self) -> i32 {
        let b = i32::from(self.to_bits());
        if b & 0x8000 != 0 { -(b & 0x7fff) } else { b }
    }
}

/// `rows x cols` values laid out as `lay`; the holes of `Gaps` hold a large filler that shows
/// in the result if read.
fn layout<T: Elem16>(v: &[T], rows: usize, cols: usize, lay: Lay) -> (Vec<T>, isize, isize) {
    let (rs, cs, len) = match lay {
        Lay::Rows => (cols, 1, rows * cols),
        Lay::Cols => (1, rows, rows * cols),
        Lay::Gaps => (2 * cols + 3, 2, rows * (2 * cols + 3)),
    };
    let mut buf = vec![T::of(4096.0); len];
    for r in 0..rows {
        for c in 0..cols {
            buf[r * rs + c * cs] = v[r * cols + c];
        }
    }
    (buf, rs as isize, cs as isize)
}

#[derive(Debug, Clone, Copy)]
struct Case {
    name: &'static str,
    m: usize,
    n: usize,
    k: usize,
    lhs: Lay,
    rhs: Lay,
    read_dst: bool,
    /// 1: on this thread; more: in a pool of that many threads (and compared with 1's bits).
    threads: usize,
    /// The lowest value drawn (the highest is `low + 2`): -0.5 keeps sums away from zero.
    low: f64,
}

const fn case(name: &'static str, m: usize, n: usize, k: usize) -> Case {
    Case {
        name,
        m,
        n,
        k,
        lhs: Lay::Rows,
        rhs: Lay::Rows,
        read_dst: false,
        threads: 1,
        low: -0.5,
    }
}

fn cases() -> Vec<Case> {
    vec![
        case("square", 64, 64, 64),
        case("square 200 (several row bands)", 200, 200, 200),
        // n past a column block, k past a block of pairs (three of them), odd k
        case("blocks", 13, 600, 1101),
        case("tall", 300, 7, 40),
        case("wide", 5, 700, 33),
        case("odd sizes", 37, 45, 51),
        case("k = 1", 17, 19, 1),
        case("k = 2", 12, 32, 2),
        case("m = 1", 1, 100, 77),
        case("n = 1", 90, 1, 65),
        case("1 x 1 x 1", 1, 1, 1),
        Case {
            low: -1.0,
            ..case("mixed signs, small k", 20, 30, 5)
        },
        Case {
            lhs: Lay::Cols,
            ..case("transposed lhs", 29, 41, 67)
        },
        Case {
            rhs: Lay::Cols,
            ..case("transposed rhs", 29, 41, 67)
        },
        Case {
            lhs: Lay::Cols,
            rhs: Lay::Cols,
            ..case("both transposed", 50, 33, 18)
        },
        Case {
            lhs: Lay::Gaps,
            rhs: Lay::Gaps,
            ..case("column stride 2", 23, 35, 45)
        },
        Case {
            read_dst: true,
            ..case("read_dst", 31, 70, 90)
        },
        Case {
            read_dst: true,
            rhs: Lay::Cols,
            ..case("read_dst, transposed rhs, k odd", 14, 33, 9)
        },
        Case {
            threads: 3,
            ..case("3 threads", 150, 130, 300)
        },
        Case {
            threads: 2,
            read_dst: true,
            lhs: Lay::Cols,
            ..case("2 threads, read_dst, transposed lhs", 97, 520, 130)
        },
    ]
}

/// Runs `f` on this thread, or inside a pool of `threads` threads with `par = true`.
fn on_threads<R: Send>(threads: usize, f: impl FnOnce(bool) -> R + Send) -> R {
    if threads == 1 {
        return f(false);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a test pool");
    pool.install(|| f(true))
}

/// The case's product by `run` against the float64 reference (one ulp); `label` names the path.
fn check<T: Elem16>(
    c: &Case,
    label: &str,
    run: impl Fn(bool, &mut [T], (usize, usize, usize), Operand<'_, T>, Operand<'_, T>, bool) + Sync,
) {
    let Case { m, n, k, .. } = *c;
    let mut rng = ChaCha8Rng::seed_from_u64((m * 1_000_003 + n * 1009 + k) as u64);
    let mut draw = |len: usize| -> Vec<T> {
        (0..len)
            .map(|_| T::of(c.low + 2.0 * rng.random::<f64>()))
            .collect()
    };
    let (a, b, old) = (draw(m * k), draw(k * n), draw(m * n));
    let (abuf, a_rs, a_cs) = layout(&a, m, k, c.lhs);
    let (bbuf, b_rs, b_cs) = layout(&b, k, n, c.rhs);
    let product = |threads: usize| {
        let mut dst = if c.read_dst {
            old.clone()
        } else {
            vec![T::of(-7.0); m * n]
        };
        on_threads(threads, |par| {
            run(
                par,
                &mut dst,
                (m, n, k),
                (&abuf, a_rs, a_cs),
                (&bbuf, b_rs, b_cs),
                c.read_dst,
            )
        });
        dst
    };
    let got = product(c.threads);
    for i in 0..m {
        for j in 0..n {
            let mut exact: f64 = (0..k)
                .map(|p| a[i * k + p].value() * b[p * n + j].value())
                .sum();
            if c.read_dst {
                exact += old[i * n + j].value();
            }
            let want = T::of(exact);
            let g = got[i * n + j];
            assert!(
                (g.key() - want.key()).abs() <= 1,
                "{} ({label}, {}): [{i}][{j}] = {g:?}, the float64 product rounded is {want:?} \
                 ({exact})",
                c.name,
                std::any::type_name::<T>(),
            );
        }
    }
    if c.threads > 1 {
        let one = product(1);
        assert!(
            got.iter().zip(&one).all(|(x, y)| x.key() == y.key()),
            "{} ({label}): {} threads differ from one",
            c.name,
            c.threads
        );
    }
}

/// Every path this machine has (a path it lacks resolves to `Convert`, said on stderr).
fn paths<T: Half16>(all: &[Path]) -> Vec<Path> {
    for &p in all {
        if resolve::<T>(p) != p {
            eprintln!(
                "gemm16: {p:?} is not available here; it runs as {:?}",
                resolve::<T>(p)
            );
        }
    }
    all.to_vec()
}

#[test]
fn bf16_products_match_float64_rounded_once_on_every_path() {
    for c in cases() {
        for path in paths::<bf16>(&[Path::Fma, Path::Dpbf16, Path::Convert]) {
            check::<bf16>(&c, &format!("{path:?}"), |par, d, dims, l, r, rd| {
                gemm_on(path, par, d, dims, l, r, rd)
            });
        }
    }
}

#[test]
fn f16_products_match_float64_rounded_once_on_every_path() {
    for c in cases() {
        for path in paths::<f16>(&[Path::Fma, Path::Convert]) {
            check::<f16>(&c, &format!("{path:?}"), |par, d, dims, l, r, rd| {
                gemm_on(path, par, d, dims, l, r, rd)
            });
        }
    }
}

#[test]
fn empty_products_leave_or_zero_dst() {
    let (a, b) = ([bf16::ONE; 6], [bf16::ONE; 6]);
    for (name, read_dst, want) in [("k = 0", false, 0.0), ("k = 0, read_dst", true, 5.0)] {
        for path in [Path::Fma, Path::Dpbf16, Path::Convert] {
            let mut dst = [bf16::from_f32(5.0); 6];
            gemm_on(
                path,
                false,
                &mut dst,
                (2, 3, 0),
                (&a, 0, 1),
                (&b, 3, 1),
                read_dst,
            );
            assert!(
                dst.iter().all(|x| x.to_f32() == want),
                "{name} ({path:?}): {dst:?}, want all {want}"
            );
        }
        let mut dst = [f16::from_f32(5.0); 6];
        let (a, b) = ([f16::ONE; 6], [f16::ONE; 6]);
        gemm_f16(&mut dst, (2, 3, 0), (&a, 0, 1), (&b, 3, 1), read_dst);
        assert!(
            dst.iter().all(|x| x.to_f32() == want),
            "{name} (f16): {dst:?}"
        );
    }
    // m = 0 or n = 0: nothing to write
    let mut none: [bf16; 0] = [];
    gemm_bf16(&mut none, (0, 3, 2), (&a, 2, 1), (&b, 3, 1), false);
    gemm_bf16(&mut none, (2, 0, 3), (&a, 3, 1), (&b, 0, 1), false);
}

/// GFLOP/s of a 1024^3 product on one thread, best of 10 after 3 warm-ups, for each path
/// (`cargo test --release -p tensorplay-core --lib gemm16 -- --ignored --nocapture`; the
/// numbers in docs/decisions.md, issue 39, come from it).
#[test]
#[ignore = "a measurement, not a test"]
fn measure_1024_one_thread() {
    use std::time::Instant;
    let n = 1024;
    crate::kernels::set_num_threads(1);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let a32: Vec<f32> = (0..n * n)
        .map(|_| rng.random::<f32>() * 2.0 - 1.0)
        .collect();
    let b32: Vec<f32> = (0..n * n)
        .map(|_| rng.random::<f32>() * 2.0 - 1.0)
        .collect();
    let (ab, bb): (Vec<bf16>, Vec<bf16>) = (
        a32.iter().map(|&x| bf16::from_f32(x)).collect(),
        b32.iter().map(|&x| bf16::from_f32(x)).collect(),
    );
    let (ah, bh): (Vec<f16>, Vec<f16>) = (
        a32.iter().map(|&x| f16::from_f32(x)).collect(),
        b32.iter().map(|&x| f16::from_f32(x)).collect(),
    );
    let (mut cb, mut ch, mut c32) = (
        vec![bf16::ZERO; n * n],
        vec![f16::ZERO; n * n],
        vec![0.0f32; n * n],
    );
    let s = n as isize;
    let gflops = |f: &mut dyn FnMut()| {
        for _ in 0..3 {
            f();
        }
        let mut best = f64::MAX;
        for _ in 0..10 {
            let t = Instant::now();
            f();
            best = best.min(t.elapsed().as_secs_f64());
        }
        2.0 * (n as f64).powi(3) / best / 1e9
    };
    for round in 0..2 {
        let mut line = format!("round {round}: 1024^3 one thread, GFLOP/s:");
        for path in [Path::Fma, Path::Dpbf16, Path::Convert] {
            let g = gflops(&mut || {
                gemm_on(
                    path,
                    false,
                    &mut cb,
                    (n, n, n),
                    (&ab, s, 1),
                    (&bb, s, 1),
                    false,
                )
            });
            line += &format!(" bf16 {:?} {g:.1},", resolve::<bf16>(path));
        }
        for path in [Path::Fma, Path::Convert] {
            let g = gflops(&mut || {
                gemm_on(
                    path,
                    false,
                    &mut ch,
                    (n, n, n),
                    (&ah, s, 1),
                    (&bh, s, 1),
                    false,
                )
            });
            line += &format!(" f16 {:?} {g:.1},", resolve::<f16>(path));
        }
        let native = gflops(&mut || {
            // SAFETY: n x n contiguous operands and destination
            unsafe {
                gemm::gemm(
                    n,
                    n,
                    n,
                    ch.as_mut_ptr(),
                    1,
                    s,
                    false,
                    ah.as_ptr(),
                    1,
                    s,
                    bh.as_ptr(),
                    1,
                    s,
                    f16::ZERO,
                    f16::ONE,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                )
            }
        });
        let f = gflops(&mut || {
            crate::ops::matmul::gemm_into(&mut c32, (n, n, n), (&a32, s, 1), (&b32, s, 1), false)
        });
        println!("{line} f16 gemm-native {native:.1}, f32 gemm {f:.1}");
    }
    // each micro-kernel's parts: packing, and the tiles under other blockings
    let dims = (n, n, n);
    let blockings = [
        (256, 16, 16),
        (128, 16, 16),
        (192, 16, 16),
        (384, 16, 16),
        (256, 8, 16),
        (256, 24, 16),
        (256, 16, 32),
    ];
    fn parts<K: Micro>(
        name: &str,
        kern: &K,
        dims: (usize, usize, usize),
        blockings: &[(usize, usize, usize)],
        out: &mut [bf16],
        gflops: &dyn Fn(&mut dyn FnMut()) -> f64,
    ) {
        let flop = 2.0 * (dims.0 * dims.1 * dims.2) as f64;
        let (mut pa, mut pb) = (Vec::new(), Vec::new());
        let pack_ms = flop / gflops(&mut || pack(kern, dims, false, (&mut pa, &mut pb))) / 1e6;
        let mut line =
            format!("bf16 {name} parts: packing {pack_ms:.2} ms; tiles and rounding GFLOP/s:");
        for &(kb, mc, nc) in blockings {
            let bl = Blocking {
                kb,
                mc: mc * MR,
                nc: nc * NR,
            };
            let g = gflops(&mut || compute::<bf16, K>(&pa, &pb, bl, out, dims, false, false));
            line += &format!(" kb {kb} mc {} nc {}: {g:.1},", bl.mc, bl.nc);
        }
        println!("{line}");
    }
    let wide = Wide {
        lhs: (&ab[..], s, 1),
        rhs: (&bb[..], s, 1),
    };
    parts("Fma", &wide, dims, &blockings, &mut cb, &gflops);
    if resolve::<bf16>(Path::Dpbf16) == Path::Dpbf16 {
        let pairs = Pairs::of((&ab[..], s, 1), (&bb[..], s, 1));
        parts("Dpbf16", &pairs, dims, &blockings, &mut cb, &gflops);
    }
}
