//! Test names for tests that run one of their own again in a fresh process.

/// The name libtest knows the test `test` by, when it is defined in the module whose
/// `module_path!()` is `module_path` (the crate's name, the binary's, is not part of it):
/// `test_name(module_path!(), "child")` in `tests/it/checkpoint.rs` is `"checkpoint::child"`.
/// Pass it with `--exact` to the test binary (`std::env::current_exe()`).
pub fn test_name(module_path: &str, test: &str) -> String {
    match module_path.split_once("::") {
        Some((_crate, module)) => format!("{module}::{test}"),
        None => test.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        for (module, test, want) in [
            ("it", "t", "t"),
            ("it::checkpoint", "child", "checkpoint::child"),
            ("it::a::b", "c", "a::b::c"),
        ] {
            assert_eq!(test_name(module, test), want, "case {module} {test}");
        }
    }
}
