use super::*;
use tensorplay_core::{DType, Tensor};

fn root() -> PathBuf {
    // a private root, so the tests neither see nor sweep anything else
    let base = if Path::new(ROOT).is_dir() {
        PathBuf::from(ROOT)
    } else {
        std::env::temp_dir()
    };
    let p = base.join(format!(
        "tp-shm-test-{}-{}",
        std::process::id(),
        random_hex(4).unwrap()
    ));
    std::fs::create_dir_all(&p).unwrap();
    p
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn a_tensor_goes_through_a_segment_and_the_segment_is_reused() {
    let root = root();
    let dir = ShmDir::create(&root, 1, 1 << 30).unwrap();
    let peer = confirm_peer(&root, dir.advert().as_bytes()).expect("own directory confirmed");
    let x = Tensor::from_vec(
        (0..100_000).map(|i| i as f32).collect::<Vec<f32>>(),
        &[100, 1000],
    )
    .unwrap();
    for round in 0..3 {
        // new values each round: the receiver's kept mapping sees every transfer's data
        let x = x.mul_scalar(f64::from(round)).unwrap();
        let c = dir.claim(400_000).unwrap();
        c.write_tensor(&x).unwrap();
        let (seg, xfer) = c.reference();
        c.commit();
        assert_eq!(seg, 1, "round {round}: the one segment is reused");
        let y = read_tensor(&peer, seg, xfer, DType::F32, 100_000, &[100, 1000]).unwrap();
        assert_eq!(y.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
        assert_eq!(entries(dir.path()), vec!["0000000000000001.free", "host"]);
    }
    // views travel as their logical values; other dtypes too
    let t = x.t().unwrap();
    let c = dir.claim(400_000).unwrap();
    c.write_tensor(&t).unwrap();
    let (seg, xfer) = c.reference();
    c.commit();
    let y = read_tensor(&peer, seg, xfer, DType::F32, 100_000, &[1000, 100]).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap());
    let b = Tensor::from_vec(vec![true, false, true], &[3]).unwrap();
    let c = dir.claim(3).unwrap();
    c.write_tensor(&b).unwrap();
    let (seg, xfer) = c.reference();
    c.commit();
    let y = read_tensor(&peer, seg, xfer, DType::Bool, 3, &[3]).unwrap();
    assert_eq!(y.to_vec::<bool>().unwrap(), vec![true, false, true]);
    dir.close();
    assert!(!peer.exists());
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn an_unsent_claim_is_given_back_and_bad_references_are_errors() {
    let root = root();
    let dir = ShmDir::create(&root, 1, 1 << 30).unwrap();
    let peer = confirm_peer(&root, dir.advert().as_bytes()).unwrap();
    let c = dir.claim(1000).unwrap();
    let (seg, xfer) = c.reference();
    drop(c); // never committed: back to free
    assert_eq!(entries(dir.path()), vec![free_name(seg), "host".into()]);
    // a transfer that does not exist, or a segment too small for what the frame claims
    assert!(read_tensor(&peer, seg, xfer, DType::F32, 10, &[10]).is_err());
    let c = dir.claim(1000).unwrap();
    let (seg, xfer) = c.reference();
    c.commit();
    assert!(read_tensor(&peer, seg, xfer, DType::F64, 1 << 20, &[1 << 20]).is_err());
    // the failed read still gave the segment back
    assert_eq!(entries(dir.path()), vec![free_name(seg), "host".into()]);
    // a bool segment holding other bytes
    let x = Tensor::from_vec(vec![7i64; 4], &[4]).unwrap();
    let c = dir.claim(32).unwrap();
    c.write_tensor(&x).unwrap();
    let (seg, xfer) = c.reference();
    c.commit();
    assert!(read_tensor(&peer, seg, xfer, DType::Bool, 32, &[32]).is_err());
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn the_budget_bounds_the_segments() {
    let root = root();
    let dir = ShmDir::create(&root, 1, 256 << 10).unwrap();
    let a = dir.claim(100 << 10).unwrap(); // a 128 KiB segment
    let b = dir.claim(100 << 10).unwrap(); // another: 256 KiB in all
    assert!(dir.claim(10).is_none(), "over the budget with both in use");
    // both given back; neither fits a larger one, so both are deleted to make room for it
    drop(a);
    drop(b);
    let c = dir.claim(200 << 10).unwrap();
    assert_eq!(c.seg.cap, 256 << 10);
    drop(c);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn only_real_directories_with_the_token_are_confirmed() {
    let root = root();
    let dir = ShmDir::create(&root, 1, 1 << 30).unwrap();
    let ad = dir.advert();
    assert!(confirm_peer(&root, ad.as_bytes()).is_some());
    let (path, _) = ad.split_once('\n').unwrap();
    // wrong token, outside the root, traversal, a symlink, garbage
    assert!(confirm_peer(&root, format!("{path}\nbad").as_bytes()).is_none());
    assert!(confirm_peer(&std::env::temp_dir().join("elsewhere"), ad.as_bytes()).is_none());
    let sneaky = format!("{}/{PREFIX}x/../../etc\n{}", root.display(), dir.token);
    assert!(confirm_peer(&root, sneaky.as_bytes()).is_none());
    let link = root.join(format!("{PREFIX}link"));
    std::os::unix::fs::symlink(dir.path(), &link).unwrap();
    let via_link = format!("{}\n{}", link.display(), dir.token);
    assert!(confirm_peer(&root, via_link.as_bytes()).is_none());
    // a FIFO as the token file neither blocks nor confirms
    let fifo_dir = root.join(format!("{PREFIX}fifo"));
    std::fs::create_dir(&fifo_dir).unwrap();
    let fifo = std::ffi::CString::new(fifo_dir.join(HOST_FILE).to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
    let via_fifo = format!("{}\n{}", fifo_dir.display(), dir.token);
    assert!(confirm_peer(&root, via_fifo.as_bytes()).is_none());
    assert!(confirm_peer(&root, b"\xff\xfe").is_none());
    assert!(confirm_peer(&root, b"").is_none());
    let _ = std::fs::remove_dir_all(&root);
}
