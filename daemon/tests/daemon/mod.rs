//! The daemon as a whole: its command line, roles, TLS, metrics, versions, and the layout of
//! its source.

mod cli;
mod layout;
mod monitoring;
mod roles;
mod tls;
mod versions;
