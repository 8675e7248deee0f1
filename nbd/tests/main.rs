//! The NBD server's integration tests, one scenario per module (the files beside this one), built
//! as one test binary (`nbd_tests`): one compile of the shared helpers and one link instead of one
//! per file. A test is named `<module>::<test>`: `-E 'test(/^clients::/)'` picks a file's.

mod common;

mod bad_input;
mod clients;
mod event_loop;
mod fuzz_decoders;
