//! The packages that hold the binaries, examples and benches the commands build with
//! `cargo ... -p PACKAGE`: one constant per target, so that moving a target to another package
//! changes one line here. (Commands that build with `--workspace` name no package.)

/// The package of the `tensorplay-gpu-check` binary (`gpu-check`).
pub(crate) const GPU_CHECK_PACKAGE: &str = "tensorplay-gpu-check";

/// The package of the launcher binary `tensorplay-run` (`bench-collectives --hosts`).
pub(crate) const LAUNCH_PACKAGE: &str = "tensorplay-launch";

/// The package of the `wine_quality` example (`gpu-check`'s bundle).
pub(crate) const WINE_QUALITY_PACKAGE: &str = "tensorplay-examples";

/// The package of the GPT training-step bench `gpt_step` (`bench-core`).
pub(crate) const GPT_BENCH_PACKAGE: &str = "tensorplay-examples";

/// The package of the `bench_remote_module` example (`bench-rpc`).
pub(crate) const REMOTE_MODULE_BENCH_PACKAGE: &str = "tensorplay-remote-module";
