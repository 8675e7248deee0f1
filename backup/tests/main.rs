//! The backup crate's integration tests, one scenario per module (the files beside this one), built
//! as one test binary (`backup_tests`): one compile of the shared helpers and one link instead of
//! one per file. A test is named `<module>::<test>`: `-E 'test(/^copy::/)'` picks a file's.

mod common;
#[path = "common/pool.rs"]
mod pool;

mod bases;
mod caps;
mod concurrency;
mod copy;
mod evidence;
mod heal;
mod object_lock;
mod point_in_time;
mod s3;
mod segments;
