//! The restorer as a library: the static restorer executable embedded as
//! bytes, so any process (the local backend, a cluster agent) can run it
//! from a memfd without knowing where it was installed. Its input format
//! and contract are the process image's `abi` layer (`starling-image`).
//!
//! The restorer itself lives in `src/restorer.rs` (see `build.rs` for why it
//! is compiled separately).

/// The static, no-libc restorer executable (x86-64 ELF).
pub static RESTORER_ELF: &[u8] = include_bytes!(env!("STARLING_RESTORER_ELF"));
