//! The `"cpu"` backend: host tensors over TCP between processes. (Being written.)
