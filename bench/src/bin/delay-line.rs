//! A TCP delay line for bench/sync_replicas.sh on a kernel without netem: forwards each
//! connection to LISTEN on to TARGET, holding every chunk ONE_WAY_US microseconds in each
//! direction (a long link's propagation delay; no bandwidth limit, no loss). Only for benches in
//! network namespaces the script makes: at most [`MAX_CONNECTIONS`] at a time.
//!
//!   delay-line LISTEN TARGET ONE_WAY_US

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const MAX_CONNECTIONS: usize = 64;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, listen, target, one_way] = &args[..] else {
        eprintln!("usage: delay-line LISTEN TARGET ONE_WAY_US");
        std::process::exit(2);
    };
    let delay = Duration::from_micros(one_way.parse().expect("ONE_WAY_US is a number of microseconds"));
    // Sleeps end when due, not up to the default 50 µs later (inherited by every thread).
    // SAFETY: PR_SET_TIMERSLACK takes a plain integer argument and touches no memory.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1) };
    let listener = TcpListener::bind(listen).unwrap_or_else(|e| panic!("listening on {listen}: {e}"));
    let open = Arc::new(AtomicUsize::new(0));
    for client in listener.incoming() {
        let Ok(client) = client else { continue };
        if open.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            open.fetch_sub(1, Ordering::SeqCst);
            continue; // dropped: closed at once
        }
        let (target, open) = (target.clone(), Arc::clone(&open));
        std::thread::spawn(move || {
            if let Ok(server) = TcpStream::connect(&target) {
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (c2, s2) =
                    (client.try_clone().expect("a socket clones"), server.try_clone().expect("a socket clones"));
                let back = std::thread::spawn(move || forward(s2, c2, delay));
                forward(client, server, delay);
                let _ = back.join();
            }
            open.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

/// Copies `from` to `to`, each chunk `delay` after it arrived; what is due together goes in one
/// write. Ends both when `from` ends or `to` fails.
fn forward(mut from: TcpStream, mut to: TcpStream, delay: Duration) {
    let (tx, rx) = mpsc::channel::<(Instant, Vec<u8>)>();
    let writer = std::thread::spawn(move || {
        let (mut out, mut next) = (Vec::new(), None);
        while let Some((due, chunk)) = next.take().or_else(|| rx.recv().ok()) {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            out.extend_from_slice(&chunk);
            while let Ok((due, chunk)) = rx.try_recv() {
                if due > Instant::now() {
                    next = Some((due, chunk));
                    break;
                }
                out.extend_from_slice(&chunk);
            }
            if to.write_all(&out).is_err() {
                break;
            }
            out.clear();
        }
        let _ = to.shutdown(Shutdown::Both);
    });
    let mut buf = vec![0u8; 256 << 10];
    while let Ok(n @ 1..) = from.read(&mut buf) {
        if tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
            break;
        }
    }
    drop(tx);
    let _ = writer.join();
    let _ = from.shutdown(Shutdown::Both);
}
