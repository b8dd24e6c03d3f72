//! The multicast test lab, shared by the netns test and the mcdist benchmark
//! (`examples/mcdist_bench.rs`): network namespaces joined by a bridge
//! ([`netlab`]) and a simulated parent and clones over the real sender and
//! receivers ([`sim`]). Not part of the library.

// Each user takes what it needs.
#![allow(dead_code)]

pub mod netlab;
pub mod sim;
