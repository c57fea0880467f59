//! A build without the feature `mpi`: the crate registers nothing, and asking for the `"mpi"`
//! backend is an error that says how to build it (with the feature, this file has no tests:
//! `tests/mpi.rs` runs under `mpirun`).

#[cfg(not(feature = "mpi"))]
#[test]
fn asking_for_mpi_without_the_feature_says_how_to_build_it() {
    use std::time::Duration;
    use tensorplay::distributed as dist;

    const { assert!(!tensorplay_mpi::BUILT_WITH_MPI) };
    tensorplay_mpi::register();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let e = dist::init_process_group(
        "mpi",
        dist::InitOptions {
            init_method: format!("tcp://127.0.0.1:{port}"),
            rank: Some(0),
            world_size: Some(1),
            timeout: Duration::from_secs(20),
        },
    )
    .expect_err("no mpi backend in this build")
    .to_string();
    for want in [
        "build tensorplay with its `mpi` feature",
        "libopenmpi-dev openmpi-bin libclang-dev",
    ] {
        assert!(e.contains(want), "the error lacks {want:?}: {e}");
    }
}
