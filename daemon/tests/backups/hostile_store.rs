//! An S3 endpoint that lies: answers that claim 64 GiB, never end, trickle one byte a second,
//! stop short or carry garbage, listings that page forever. The daemon behind `ferrite backup`
//! never aborts, its memory stays bounded (64 MiB over its idle RSS), and each call fails in
//! bounded time with an error that names the target and the object, the Object Lock probe of a
//! locked target's opening included.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Daemon;
use common::nbd::{reset_peak, rss_kib};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// `Content-Length: 68719476736`, then a few bytes.
    HugeLength,
    /// A chunked body that never ends (until the client goes).
    Endless,
    /// A length the store announces and a body that runs past it is not possible in HTTP/1.1;
    /// this announces 1 GiB and sends it (as fast as it can).
    LargeLength,
    /// One byte a second.
    Trickle,
    /// 1000 bytes announced, 10 sent, the connection closed.
    Truncated,
    /// The announced number of bytes, all garbage.
    Garbage,
    /// Listings: valid ListObjectsV2 pages of 1000 entries each (CommonPrefixes when asked
    /// with a delimiter, else objects), always truncated, each with a new continuation token.
    /// Anything else: as `Garbage`.
    EndlessPages,
}

/// What a valid (unsealed) index of volume `db` listing backup `db/x` of one chunk looks like:
/// the envelope's header (`FRBK`, format 1, kind 3 = index, no flags) and its JSON.
fn index() -> Vec<u8> {
    let json = br#"{"format":1,"volume":"db","backups":[{"id":"x","snapshot":"s","created":1,"size":1048576,"full":true,"previous":null,"chunks":1,"bytes":1048576,"uploaded_bytes":0}]}"#;
    [&b"FRBK\x01\x03\x00"[..], json].concat()
}

/// The hostile store. The marker is always answered truly (the target opens); with
/// `honest_index`, so is the index of `db` (the manifest is then what lies).
struct Store {
    port: u16,
    mode: Arc<Mutex<(Mode, bool)>>,
}

impl Store {
    fn start() -> Store {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mode = Arc::new(Mutex::new((Mode::HugeLength, false)));
        let m = Arc::clone(&mode);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let m = Arc::clone(&m);
                std::thread::spawn(move || serve(conn, &m));
            }
        });
        Store { port, mode }
    }

    fn set(&self, mode: Mode, honest_index: bool) {
        *self.mode.lock().unwrap() = (mode, honest_index);
    }
}

/// Answers every request on `conn` (keep-alive) as the mode says; every loop ends when the
/// client goes or after a bounded time.
fn serve(conn: TcpStream, mode: &Mutex<(Mode, bool)>) {
    let started = Instant::now();
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut out = conn;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let (method, path) = {
            let mut parts = line.split_whitespace();
            (parts.next().unwrap_or("").to_owned(), parts.next().unwrap_or("").to_owned())
        };
        let mut length = 0usize;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap_or(0);
            }
            if h == "\r\n" {
                break;
            }
        }
        let mut body = vec![0u8; length];
        if std::io::Read::read_exact(&mut reader, &mut body).is_err() {
            return;
        }
        let (mode, honest_index) = *mode.lock().unwrap();
        let honest = if path.ends_with("/ferrite-backup.json") {
            Some(br#"{"format":1,"key-check":null}"#.to_vec())
        } else if path.ends_with("/gc/clock") {
            Some(Vec::new())
        } else if honest_index && path.ends_with("/volumes/db/index") {
            Some(index())
        } else {
            None
        };
        let head_only = method == "HEAD";
        let sent = match &honest {
            Some(b) => answer(&mut out, &format!("Content-Length: {}", b.len()), if head_only { &[] } else { b }),
            None if mode == Mode::EndlessPages && path.contains("list-type=2") => {
                let page = page(&path);
                answer(&mut out, &format!("Content-Length: {}", page.len()), page.as_bytes())
            }
            None if mode == Mode::EndlessPages => lie(&mut out, Mode::Garbage, head_only, started),
            None => lie(&mut out, mode, head_only, started),
        };
        if mode == Mode::EndlessPages && sent.is_ok() && honest.is_none() && path.contains("list-type=2") {
            continue;
        }
        // After a lie the connection is closed (what it sent may leave it in any state).
        if sent.is_err() || honest.is_none() {
            return;
        }
    }
}

/// One page of a listing that never ends: 1000 new names under the asked prefix.
fn page(path: &str) -> String {
    static PAGES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = PAGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let query = path.split_once('?').map_or("", |(_, q)| q);
    let param = |name: &str| {
        query.split('&').find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')).unwrap_or("").replace("%2F", "/")
    };
    let (prefix, delimited) = (param("prefix"), !param("delimiter").is_empty());
    let mut xml = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">\
         <Name>b</Name><Prefix>{prefix}</Prefix><KeyCount>1000</KeyCount><MaxKeys>1000</MaxKeys>\
         <IsTruncated>true</IsTruncated><NextContinuationToken>page-{n}</NextContinuationToken>"
    );
    for i in 0..1000 {
        if delimited {
            xml += &format!("<CommonPrefixes><Prefix>{prefix}v{n}-{i}/</Prefix></CommonPrefixes>");
        } else {
            xml += &format!(
                "<Contents><Key>{prefix}v{n}-{i}/backups/x</Key><LastModified>2026-12-06T00:00:00.000Z</LastModified>\
                 <ETag>\"e\"</ETag><Size>100</Size><StorageClass>STANDARD</StorageClass></Contents>"
            );
        }
    }
    xml + "</ListBucketResult>"
}

fn answer(out: &mut TcpStream, header: &str, body: &[u8]) -> std::io::Result<()> {
    write!(out, "HTTP/1.1 200 OK\r\n{header}\r\nLast-Modified: Wed, 02 Dec 2026 00:00:00 GMT\r\nETag: \"e\"\r\n\r\n")?;
    out.write_all(body)?;
    out.flush()
}

/// Sends `mode`'s lie; returns when the client has gone, or after two minutes.
fn lie(out: &mut TcpStream, mode: Mode, head_only: bool, started: Instant) -> std::io::Result<()> {
    let garbage = vec![b'<'; 64 << 10];
    let within = || started.elapsed() < Duration::from_secs(120);
    match mode {
        Mode::HugeLength => answer(out, "Content-Length: 68719476736", if head_only { &[] } else { &garbage[..100] }),
        Mode::Endless => {
            answer(out, "Transfer-Encoding: chunked", &[])?;
            while within() {
                write!(out, "{:x}\r\n", garbage.len())?;
                out.write_all(&garbage)?;
                out.write_all(b"\r\n")?;
            }
            Ok(())
        }
        Mode::LargeLength => {
            answer(out, "Content-Length: 1073741824", &[])?;
            for _ in 0..(1 << 30) / garbage.len() {
                if !within() {
                    break;
                }
                out.write_all(&garbage)?;
            }
            Ok(())
        }
        Mode::Trickle => {
            answer(out, "Content-Length: 100", &[])?;
            for _ in 0..100 {
                out.write_all(b"x")?;
                out.flush()?;
                std::thread::sleep(Duration::from_secs(1));
            }
            Ok(())
        }
        Mode::Truncated => {
            answer(out, "Content-Length: 1000", &garbage[..10])?;
            out.shutdown(std::net::Shutdown::Both)
        }
        Mode::Garbage | Mode::EndlessPages => {
            answer(out, "Content-Length: 4096", if head_only { &[] } else { &garbage[..4096] })
        }
    }
}

#[test]
fn a_lying_store_neither_aborts_the_daemon_nor_fills_its_memory() {
    let store = Store::start();
    let dir = tempfile::tempdir().unwrap();
    let toml = format!(
        "pool-size = \"1G\"\nsegment-size = \"4M\"\nlog-level = \"info\"\n\
         [backup-targets.evil]\nkind = \"s3\"\nendpoint = \"http://127.0.0.1:{}\"\nbucket = \"b\"\nprefix = \"p\"\n\
         timeout-s = 3\nretries = 1\n\
         [backup-targets.locked]\nkind = \"s3\"\nendpoint = \"http://127.0.0.1:{0}\"\nbucket = \"b\"\nprefix = \"l\"\n\
         timeout-s = 3\nretries = 1\nobject-lock-days = 1\n",
        store.port
    );
    std::fs::write(dir.path().join("ferrite.toml"), toml).unwrap();
    let mut d = Daemon::start(dir.path());
    let pid = d.child.as_ref().unwrap().id();
    d.ok(&["volume", "create", "db", "8MiB"]);
    // The target opens (its marker is true) and a first call has run: the baseline.
    store.set(Mode::Garbage, false);
    assert!(!d.cli(&["backup", "list", "db", "--target", "evil"]).status.success());
    let baseline = rss_kib(pid).1 << 10;
    reset_peak(pid);

    // The names an error may give, one of them (`|`): a prune without retention begins with a
    // PUT of its clock, which the store may refuse before the listing of what the prune marks.
    let calls: [(&[&str], bool, &str); 8] = [
        (&["backup", "list", "--target", "evil"], false, "LIST volumes"),
        (&["backup", "list", "db", "--target", "evil"], false, "volumes/db/index"),
        (&["backup", "create", "db", "--target", "evil"], false, "volumes/db/index"),
        (&["backup", "show", "db/x", "--target", "evil"], true, "volumes/db/backups/x"),
        (&["backup", "verify", "--target", "evil"], false, "LIST volumes"),
        (&["backup", "prune", "--target", "evil", "--keep-last", "1"], false, "LIST volumes"),
        (&["backup", "prune", "--target", "evil"], false, "gc/clock|volumes"),
        (&["backup", "list", "--target", "locked"], false, "object-lock"),
    ];
    let modes = [
        Mode::HugeLength,
        Mode::Endless,
        Mode::LargeLength,
        Mode::Trickle,
        Mode::Truncated,
        Mode::Garbage,
        Mode::EndlessPages,
    ];
    for mode in modes {
        for (args, honest_index, names) in calls {
            store.set(mode, honest_index);
            let start = Instant::now();
            let out = d.cli(args);
            let took = start.elapsed();
            let msg = String::from_utf8_lossy(&out.stderr);
            println!("{mode:?} {args:?}: {took:?}: {}", msg.trim());
            assert!(!out.status.success(), "{mode:?} {args:?} succeeded");
            let at = args.iter().position(|&a| a == "--target").unwrap();
            let target = format!("backup target {}", args[at + 1]);
            let named = names.split('|').any(|name| msg.contains(name));
            assert!(msg.contains(&target) && named, "{mode:?} {args:?}: {msg}");
            assert!(took < Duration::from_secs(45), "{mode:?} {args:?} took {took:?}");
            assert!(d.child.as_mut().unwrap().try_wait().unwrap().is_none(), "the daemon ended: {}", d.log());
            let grown = (rss_kib(pid).0 << 10).saturating_sub(baseline);
            println!("  peak +{} MiB over the baseline", grown >> 20);
            assert!(grown < 64 << 20, "{mode:?} {args:?}: the daemon's peak grew by {} MiB", grown >> 20);
        }
    }
    d.ok(&["pool", "status"]);
    assert!(!d.log().contains("memory allocation"), "{}", d.log());
}
