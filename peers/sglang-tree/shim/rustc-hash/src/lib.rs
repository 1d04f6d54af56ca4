//! `rustc_hash` as the vendored tree imports it, over the rustc-hash 1.1 that Debian ships.
//!
//! rustc-hash 2 added `FxBuildHasher`, a unit struct that builds an `FxHasher`; 1.1 only has the
//! `FxHasher` itself. The hash function is 1.1's (2.x changed its mixing), which the tree uses for
//! its per-tenant count map only.

use std::hash::BuildHasher;

pub use rustc_hash::{FxHashMap, FxHashSet, FxHasher};

/// Builds an [`FxHasher`], as rustc-hash 2's `FxBuildHasher` does.
#[derive(Clone, Copy, Debug, Default)]
pub struct FxBuildHasher;

impl BuildHasher for FxBuildHasher {
    type Hasher = FxHasher;

    fn build_hasher(&self) -> FxHasher {
        FxHasher::default()
    }
}
