//! What the workspace's tests share, a dev-dependency only: recording a skip the suite lists
//! (`skip`, `have`), the test data generator (`pattern`), and the layout tests' reader of a
//! crate's source (`bands`).

pub mod bands;
mod data;
mod skips;

pub use data::pattern;
pub use skips::{have, skip};
