//! Cross-memory attach: large reduce_scatter (and, where asked for, all_gather and gather)
//! between the ranks of one host read each peer's tensor straight out of the peer's process
//! with `process_vm_readv` (one copy per byte) instead of through the slots (a copy in, a copy
//! out).
//!
//! # Setup (see `Shm::setup`)
//! Unless `TENSORPLAY_SHM_CMA=0`, every rank lets its siblings read its memory where Yama
//! restricts ptrace to ancestors (`PR_SET_PTRACER` naming its parent, the launcher, whose
//! descendants the ranks are; without Yama the call fails and changes nothing), and adds its pid and the address of its segment's token to its advert. Every rank
//! then reads the token of every peer whose segment it mapped ([`probe_advert`]) and reports
//! the outcome in its row of the reachability matrix (`1`; `2` where it also asks for the
//! gathers). A host uses cross-memory attach only if every rank of it read every other's
//! token, and for the gathers only if every rank asked: every rank sees the same rows, so all
//! agree, and one rank that cannot (seccomp, another pid namespace, `TENSORPLAY_SHM_CMA=0` on
//! that rank) sends the whole host back to the slots.
//!
//! # Which calls
//! reduce_scatter of at least [`CMA_MIN`] input bytes by default; all_gather and gather of at
//! least [`CMA_MIN`] output bytes with `TENSORPLAY_SHM_CMA=all` (or `require`). On the 2-core
//! VM of benchmarks.md the gathers were faster this way at 16 MiB but slower at 64 MiB, where
//! the kernel's copy out of a peer's memory (about 4.5 GB/s against memcpy's 7) costs more than
//! the slot path's second copy through the cache. Smaller calls keep the slot path's latency.
//!
//! # A call
//! One step: every rank writes the address and length of its input into its slot, signs and
//! publishes; after every peer's step it checks their signatures and reads what it needs
//! (all_gather: each peer's input into its block of the output, its own block by a local
//! copy; reduce_scatter: its own block of each input, in pieces of [`PIECE`] bytes, reduced in
//! local rank order with the same `reduce_into` as the slot path, so the bits are the same on
//! either path). A second step then says "I read everything"; no rank returns before every
//! peer's second step, so no input is freed or changed while a peer still reads it. A peer
//! that died is `ESRCH` to the reader, reported like a peer lost while waiting.

use std::io;

use super::ShmCtx;
use crate::backend::cpu::buf::Scratch;
use crate::backend::wide::{is_16bit, reduce_many};
use crate::backend::{BufMut, BufRef, reduce_into};
use crate::{Error, Part, ReduceOp, Result, detail};

/// The environment variable: `0` (or `false`, `off`, `no`) turns cross-memory attach off;
/// `all` uses it for all_gather and gather too; `require` is `all` and makes group creation
/// fail where it cannot be used; anything else (or unset): reduce_scatter only, where every
/// rank of the host can.
pub(super) const ENV: &str = "TENSORPLAY_SHM_CMA";

/// all_gather and gather calls of at least this many output bytes (all ranks' blocks), and
/// reduce_scatter calls of at least this many input bytes, read peers' memory directly.
pub(in crate::backend::cpu) const CMA_MIN: usize = 256 << 10;

/// reduce_scatter reads peers' blocks in pieces of this many bytes (into a scratch buffer that
/// stays in cache while it is reduced into the output).
const PIECE: usize = 256 << 10;

/// One `process_vm_readv` call reads at most this many bytes (on the 2-core VM of
/// benchmarks.md, reads of 256 KiB to 1 MiB ran at 4.5 GB/s, one read of 64 MiB at 3.7).
const MAX_READ: usize = 1 << 20;

/// What `TENSORPLAY_SHM_CMA` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Never (the slot path only).
    Off,
    /// For reduce_scatter, where every rank of the host can.
    Auto,
    /// For reduce_scatter, all_gather and gather, where every rank of the host can.
    All,
    /// As `All`, and group creation fails where some rank of the host cannot.
    Require,
}

impl Mode {
    /// Whether all_gather and gather read peers' memory too.
    pub(super) fn gathers(self) -> bool {
        matches!(self, Mode::All | Mode::Require)
    }
}

/// The mode `TENSORPLAY_SHM_CMA` asks for (default [`Mode::Auto`]).
pub(super) fn mode() -> Mode {
    match std::env::var(ENV) {
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "0" | "false" | "off" | "no" => Mode::Off,
            "all" => Mode::All,
            "require" => Mode::Require,
            _ => Mode::Auto,
        },
        Err(_) => Mode::Auto,
    }
}

/// Lets this process's parent and its descendants read this process's memory where Yama
/// restricts ptrace to ancestors: sibling ranks (children of one launcher, or of one test
/// process) are not each other's ancestors, and Yama's exception covers the named tracer's
/// descendants, so naming the parent admits exactly the launcher's processes, not every process
/// of the user. Ranks with different parents on one host fail the probe and keep the slots.
/// Without Yama the call fails with `EINVAL` and nothing changes; either way the probe
/// decides.
pub(super) fn allow_peers() {
    let unused: libc::c_ulong = 0;
    // SAFETY: getppid has no preconditions and cannot fail.
    let parent = unsafe { libc::getppid() } as libc::c_ulong;
    // SAFETY: prctl with integer arguments; PR_SET_PTRACER only changes this process's Yama
    // ptracer exception and touches no memory of ours.
    unsafe {
        libc::prctl(libc::PR_SET_PTRACER, parent, unused, unused, unused);
    }
}

/// The advert fields this module adds: this process's pid and the address of `token`'s bytes
/// (which must stay put until every peer has probed them).
pub(super) fn advert_fields(token: &str) -> String {
    format!("\n{}\n{}", std::process::id(), token.as_ptr() as usize)
}

/// Reads a peer's advert (`path token slot label pid address`) and checks that this process
/// can read the peer's token at that address in that pid: the pid when it can.
pub(super) fn probe_advert(advert: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(advert).ok()?;
    let f: Vec<&str> = s.split('\n').collect();
    let (token, pid, addr) = (f.get(1)?, f.get(4)?, f.get(5)?);
    let pid: u32 = pid.parse().ok()?;
    let addr: usize = addr.parse().ok()?;
    if pid == 0 || addr == 0 || token.is_empty() {
        return None;
    }
    let mut got = vec![0u8; token.len()];
    read_remote(pid, addr, &mut got).ok()?;
    (got == token.as_bytes()).then_some(pid)
}

/// Copies `local.len()` bytes at address `remote` of process `pid` into `local`.
fn read_remote(pid: u32, remote: usize, local: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < local.len() {
        let n = (local.len() - done).min(MAX_READ);
        let l = libc::iovec {
            iov_base: local[done..].as_mut_ptr().cast(),
            iov_len: n,
        };
        let r = libc::iovec {
            iov_base: (remote + done) as *mut libc::c_void,
            iov_len: n,
        };
        // SAFETY: the kernel writes at most `n` bytes into `local[done..]`, which we borrow
        // mutably and which holds at least `n` bytes; the remote side is only read, in another
        // process, and a bad remote address is an error (EFAULT), never a write here.
        let got = unsafe { libc::process_vm_readv(pid as libc::pid_t, &l, 1, &r, 1, 0) };
        if got < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if got == 0 {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        done += got as usize;
    }
    Ok(())
}

/// Step one: publishes the address and length of `input`, waits for every peer's and checks
/// their signatures. Returns the slot holding everyone's descriptor.
fn publish_input(cx: &mut ShmCtx<'_>, input: &[u8]) -> Result<usize> {
    let s = cx.open_slot(true)?;
    let mut d = [0u8; 16];
    d[..8].copy_from_slice(&(input.as_ptr() as u64).to_le_bytes());
    d[8..].copy_from_slice(&(input.len() as u64).to_le_bytes());
    // SAFETY: the first 16 bytes of our own slot (a slot holds at least 256), which we opened
    // for writing: no peer reads it until we publish.
    unsafe { std::ptr::copy_nonoverlapping(d.as_ptr(), cx.my_slot(s), d.len()) };
    cx.write_sig(s, 0);
    let x = cx.publish(Some(s));
    cx.check_all(s, x, 0)?;
    Ok(s)
}

/// Local rank `li`'s input (address, bytes) as it published it in slot `s`, checked against
/// the `want` bytes this rank expects of it.
fn input_of(cx: &ShmCtx<'_>, li: usize, s: usize, want: usize) -> Result<usize> {
    let mut d = [0u8; 16];
    // SAFETY: the first 16 bytes of a slot the peer published at a step we have seen; it does
    // not write them again before we publish a later step.
    unsafe { std::ptr::copy_nonoverlapping(cx.slot_of(li, s), d.as_mut_ptr(), d.len()) };
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&d[i * 8..i * 8 + 8]);
        u64::from_le_bytes(w) as usize
    };
    if word(1) != want {
        return Err(Error::Mismatch {
            op: cx.op().into(),
            detail: detail!(
                "rank ",
                Part::Rank(cx.rank_of(li)),
                format!(" passes an input of {} bytes but rank ", word(1)),
                Part::Rank(cx.rank()),
                format!(" expects {want} from it (the counts differ between ranks)")
            ),
        });
    }
    Ok(word(0))
}

/// Reads `dst.len()` bytes at address `at` of local rank `li`'s process into `dst`; a peer
/// that is gone is reported as on the slot path.
fn read_peer(cx: &ShmCtx<'_>, li: usize, at: usize, dst: &mut [u8]) -> Result<()> {
    read_remote(cx.pid_of(li), at, dst).map_err(|e| {
        if e.raw_os_error() == Some(libc::ESRCH) || cx.is_gone(li) {
            return cx.lost(li);
        }
        Error::Backend {
            backend: "cpu".into(),
            detail: detail!(
                "rank ",
                Part::Rank(cx.rank()),
                " could not read rank ",
                Part::Rank(cx.rank_of(li)),
                format!(
                    "'s tensor in a shared-memory {} ({e}); TENSORPLAY_SHM_CMA=0 turns \
                     cross-memory attach off",
                    cx.op()
                )
            ),
        }
    })
}

/// Step two: this rank has read everything; returns once every peer has too (so that the
/// caller may free or change its input).
fn finish(cx: &mut ShmCtx<'_>) -> Result<()> {
    let y = cx.publish(None);
    cx.wait_all(y)
}

/// All-gather (`root` `None`) or gather to local rank `root` of per-rank blocks of `counts`
/// elements (`output` is `None` exactly on the ranks that receive nothing), reading the peers'
/// inputs in place.
pub(in crate::backend::cpu) fn gather(
    cx: &mut ShmCtx<'_>,
    input: BufRef<'_>,
    mut output: Option<BufMut<'_>>,
    counts: &[usize],
    root: Option<usize>,
) -> Result<()> {
    let es = input.elem_size();
    let (w, me) = (cx.w(), cx.li());
    let s = publish_input(cx, input.as_bytes())?;
    cx.count_sent(input.as_bytes().len());
    let receives = root.is_none_or(|r| r == me);
    if let (true, Some(out)) = (receives, output.as_mut()) {
        let blocks = super::super::algo::blocks_of(counts);
        let streaming = out.len() * es >= super::algo::STREAM_MIN;
        let mut stage = if streaming {
            vec![0u8; PIECE]
        } else {
            Vec::new()
        };
        copy(
            input.as_bytes(),
            out.slice_mut(blocks[me].clone()).as_bytes_mut(),
            streaming,
        );
        for j in 1..w {
            let p = (me + j) % w;
            let at = input_of(cx, p, s, counts[p] * es)?;
            let mut o = out.slice_mut(blocks[p].clone());
            let dst = o.as_bytes_mut();
            if !streaming {
                read_peer(cx, p, at, dst)?;
                continue;
            }
            // through a cache-sized buffer, then around the cache into the output: the
            // kernel's copy would read every output line before overwriting it
            for (k, d) in dst.chunks_mut(PIECE).enumerate() {
                let t = &mut stage[..d.len()];
                read_peer(cx, p, at + k * PIECE, t)?;
                copy(t, d, true);
            }
        }
    }
    finish(cx)
}

/// Copies `src` into `dst` (as many bytes), with non-temporal stores when `streaming`.
fn copy(src: &[u8], dst: &mut [u8], streaming: bool) {
    let n = src.len().min(dst.len());
    if streaming {
        // SAFETY: a shared and a mutable borrow cannot overlap; `n` bytes valid in each.
        unsafe { super::algo::copy_streaming(src.as_ptr(), dst.as_mut_ptr(), n) }
    } else {
        dst[..n].copy_from_slice(&src[..n]);
    }
}

/// Reduce-scatter: block `me` (of `output.len()` elements) of the reduction of every rank's
/// `input` (`w` blocks), reduced in local rank order: the first rank's piece copied (or read
/// straight into `output`), every later rank's reduced into it.
pub(in crate::backend::cpu) fn reduce_scatter(
    cx: &mut ShmCtx<'_>,
    sc: &mut Scratch,
    input: BufRef<'_>,
    mut output: BufMut<'_>,
    op: ReduceOp,
) -> Result<()> {
    let (es, m) = (input.elem_size(), output.len());
    let (w, me) = (cx.w(), cx.li());
    let s = publish_input(cx, input.as_bytes())?;
    cx.count_sent((w - 1) * m * es);
    let addrs = (0..w)
        .map(|p| {
            if p == me {
                Ok(0)
            } else {
                input_of(cx, p, s, w * m * es)
            }
        })
        .collect::<Result<Vec<usize>>>()?;
    let per = (PIECE / es).max(1);
    // 16-bit: every peer's piece read first (w - 1 pieces of scratch), then one pass in
    // float32 rounding once; other dtypes reduce each piece as it arrives (one piece of scratch)
    let wide = is_16bit(output.dtype());
    let avg = super::algo::avg_of(op, output.dtype(), w);
    let mut tmp = sc.get(output.dtype(), per.min(m) * if wide { w } else { 1 })?;
    for k in 0..m.div_ceil(per) {
        let r = k * per..((k + 1) * per).min(m);
        let len = r.len();
        // the byte offset of this piece of block `me` in every rank's input
        let at = (me * m + r.start) * es;
        let own = input.slice(me * m + r.start..me * m + r.end);
        let mut d = output.slice_mut(r.clone());
        if me == 0 {
            d.as_bytes_mut().copy_from_slice(own.as_bytes());
        } else {
            read_peer(cx, 0, addrs[0] + at, d.as_bytes_mut())?;
        }
        if wide {
            for (p, &addr) in addrs.iter().enumerate().skip(1) {
                if p != me {
                    let mut t = tmp.slice_mut(p * len..(p + 1) * len);
                    read_peer(cx, p, addr + at, t.as_bytes_mut())?;
                }
            }
            let t = tmp.as_ref();
            let srcs: Vec<BufRef<'_>> = (1..w)
                .map(|p| {
                    if p == me {
                        own
                    } else {
                        t.slice(p * len..(p + 1) * len)
                    }
                })
                .collect();
            reduce_many(op, &mut d, &srcs, avg)?;
            continue;
        }
        for (p, &addr) in addrs.iter().enumerate().skip(1) {
            if p == me {
                reduce_into(op, &mut d, own)?;
            } else {
                let mut t = tmp.slice_mut(0..len);
                read_peer(cx, p, addr + at, t.as_bytes_mut())?;
                reduce_into(op, &mut d, t.as_ref())?;
            }
        }
    }
    finish(cx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One read of this process's own memory through `process_vm_readv`.
    struct Case {
        name: &'static str,
        len: usize,
        at: usize,
    }

    fn check(c: Case) {
        let src: Vec<u8> = (0..c.at + c.len).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; c.len];
        match read_remote(std::process::id(), src.as_ptr() as usize + c.at, &mut dst) {
            Ok(()) => assert_eq!(dst[..], src[c.at..], "{}: bytes read", c.name),
            // a sandbox without process_vm_readv: the groups fall back, nothing to check here
            Err(e) => eprintln!("{}: process_vm_readv unavailable here: {e}", c.name),
        }
    }

    #[test]
    fn reads_of_own_memory_return_the_bytes() {
        let cases = [
            Case {
                name: "empty",
                len: 0,
                at: 0,
            },
            Case {
                name: "odd length, odd offset",
                len: 1001,
                at: 3,
            },
            Case {
                name: "more than one call",
                len: MAX_READ + 4097,
                at: 5,
            },
        ];
        for c in cases {
            check(c);
        }
    }

    #[test]
    fn adverts_are_probed_against_the_token() {
        let token = "0123456789abcdef0123456789abcdef".to_string();
        let ad = format!("/dev/shm/x\n{token}\n1024\n{}", advert_fields(&token));
        // the label is empty here: fields are path, token, slot, label, pid, address
        let ok = probe_advert(ad.as_bytes());
        if read_remote(std::process::id(), token.as_ptr() as usize, &mut [0u8; 4]).is_ok() {
            assert_eq!(ok, Some(std::process::id()), "the right token is found");
        }
        let wrong = ad.replacen(&token, "fedcba9876543210fedcba9876543210", 1);
        assert_eq!(
            probe_advert(wrong.as_bytes()),
            None,
            "another token is refused"
        );
        assert_eq!(probe_advert(b"/dev/shm/x\nab\n1024\n"), None, "no pid");
    }
}
