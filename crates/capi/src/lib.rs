//! `libstarling` (`.so` and `.a`): the C API declared in
//! `include/starling.h`, over starling's remote fork.
//!
//! The entry points are defined in `starling_fork::ffi` (so the fork crate's
//! own C test-suite can link them without this crate) and re-exported here;
//! this crate exists to produce the C-facing library artefacts. Numbering:
//! `sf_clone` returns 0 in the parent and 1..m in the m clones.

pub use starling_fork::ffi::*;

