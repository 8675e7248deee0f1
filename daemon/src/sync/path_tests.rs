//! The mirror path as a property: a primary (the engine's volume with its [`Primary`], real
//! [`Link`]s) and two members (the real stream service applying to their copies, acks through
//! [`AckSink`]), joined by pipes that cut the byte streams at random points and hold them for
//! random moments, so members read, apply and acknowledge in batches of every size. Clients on
//! three threads send random writes (overlapping within each thread's region, some FUA, some
//! through the completion path), trims, zeroings and flushes. When the client hears its answer,
//! every member holds the request (or a newer one over the same blocks); at the end the copies
//! are equal. Each run is one seed: a failure names it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use ferrite_engine::io::MemoryBackend;
use ferrite_engine::{Mirror, Pool, PoolOptions, Volume, WriteDone};
use ferrite_proto::ferrite::v1::mirror_message::Op;
use ferrite_proto::ferrite::v1::{MirrorAck, MirrorMessage, MirrorOpen};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::SyncHub;
use super::ack_sink::AckSink;
use super::link::Link;
use super::primary::Primary;
use super::records::{Member, Membership, State};
use super::serve::{MirrorService, Opened};
use super::wire::Frames;

const BS: usize = 4096;
const B: u64 = BS as u64;
const SIZE: u64 = 12 << 20;
const THREADS: u64 = 3;
const OPS: u64 = 250;
const PRIMARY: &str = "tcp://primary:1";
const MEMBERS: [&str; 2] = ["tcp://member-a:1", "tcp://member-b:1"];

fn idx(v: u64) -> usize {
    usize::try_from(v).expect("a test-sized number")
}

fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn pool(dir: &std::path::Path, name: &str) -> Pool {
    let p = Pool::create_on(Arc::new(MemoryBackend::committed(1 << 30)), &dir.join(name), PoolOptions::default())
        .expect("a pool");
    p.create_volume("v", SIZE).expect("a volume");
    p
}

fn hub(dir: &std::path::Path, me: &str, pool: Pool) -> Arc<SyncHub> {
    let data = dir.join(me.replace([':', '/'], "_"));
    let text = format!("data-dir = {:?}\nreplication-endpoint = {me:?}\n", data.display().to_string());
    let cfg = crate::base::config::Config::load_str(&text).expect("a config");
    std::fs::create_dir_all(&cfg.data_dir).expect("data dir");
    let policy = Arc::new(crate::authz::Policy::new(Vec::new()));
    SyncHub::new(Arc::new(pool), policy, &cfg).expect("a hub")
}

fn membership() -> Membership {
    let member =
        |e: &str| Member { endpoint: e.into(), state: State::InSync, reason: String::new(), mark: String::new() };
    Membership {
        volume: "v".into(),
        generation: 2,
        primary: PRIMARY.into(),
        members: std::iter::once(PRIMARY).chain(MEMBERS).map(member).collect(),
        size: SIZE,
        wrapped_key: Vec::new(),
    }
}

/// Copies `r` to `w` in pieces of random size, now and then after a pause.
async fn choppy(mut r: tokio::io::DuplexStream, mut w: tokio::io::DuplexStream, mut x: u64) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let want = 1 + usize::try_from(next(&mut x) % buf.len() as u64).expect("below the buffer's size");
        let n = match r.read(&mut buf[..want]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if w.write_all(&buf[..n]).await.is_err() {
            break;
        }
        match next(&mut x) % 8 {
            0 => tokio::time::sleep(Duration::from_micros(next(&mut x) % 300)).await,
            1 => tokio::task::yield_now().await,
            _ => {}
        }
    }
    let _ = w.shutdown().await;
}

/// A member's end of a stream: the open acknowledged, then the service applies the rest.
async fn member(svc: MirrorService, volume: Volume, r: tokio::io::DuplexStream, w: tokio::io::DuplexStream) {
    let mut inbound = Frames::<_, MirrorMessage>::new(r, None);
    let acks = AckSink::framed(w);
    let first = inbound.next().await.expect("a frame").expect("an open");
    assert!(matches!(first.op, Some(Op::Open(_))), "{first:?}");
    assert!(acks.send(MirrorAck { seq: 0, error: String::new(), through: 0 }).await);
    svc.apply_all(Opened::plain("v", PRIMARY, volume), inbound, acks.clone()).await;
    acks.close();
}

/// What each block was last written with by a request that started: its number (0 for zeros).
struct Model {
    /// Per block, the number of the newest trim or zeroing started over it.
    zeroed: Vec<AtomicU64>,
}

/// A 4 KiB block written by request `n` at block `lba`.
fn block(n: u64, lba: u64) -> Vec<u8> {
    let mut b = vec![n.to_le_bytes()[0]; BS];
    b[..8].copy_from_slice(&n.to_le_bytes());
    b[8..16].copy_from_slice(&lba.to_le_bytes());
    b
}

/// Checks, once request `n` over `blocks` was answered to its client, that every member holds
/// it there, or a request started after it.
fn held_by_members(members: &[Volume], model: &Model, n: u64, blocks: std::ops::Range<u64>, zeroing: bool) {
    for (i, m) in members.iter().enumerate() {
        for lba in blocks.clone() {
            let mut got = vec![0u8; BS];
            m.read(lba * B, &mut got).expect("a member read");
            let at = u64::from_le_bytes(got[..8].try_into().unwrap());
            if got.iter().all(|&b| b == 0) {
                let later_zeroing = model.zeroed[idx(lba)].load(Ordering::SeqCst) >= n;
                assert!(zeroing || later_zeroing, "member {i}, block {lba}: zeros when request {n} was answered");
            } else {
                assert!(at >= n, "member {i}, block {lba}: request {at} when request {n} was answered");
                assert_eq!(got, block(at, lba), "member {i}, block {lba}: a damaged block");
            }
        }
    }
}

/// One client thread: `OPS` random requests in its region, up to four writes in flight.
fn client(t: u64, seed: u64, vol: &Volume, members: &[Volume], model: &Arc<Model>, counter: &AtomicU64) {
    let region = SIZE / B / THREADS;
    let base = t * region;
    let mut x = seed ^ (t + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let (tx, rx) = mpsc::channel::<()>();
    let mut in_flight = 0;
    for _ in 0..OPS {
        let n = counter.fetch_add(1, Ordering::SeqCst);
        let len = 1 + next(&mut x) % 8;
        let lba = base + next(&mut x) % (region - len);
        let data: Vec<u8> = (lba..lba + len).flat_map(|b| block(n, b)).collect();
        match next(&mut x) % 10 {
            0..=4 => {
                if in_flight == 4 {
                    rx.recv().expect("a completion");
                    in_flight -= 1;
                }
                // Checked on the thread that answers, as the client hears it.
                let (tx, members, model) = (tx.clone(), members.to_vec(), Arc::clone(model));
                let done: WriteDone = Box::new(move |r| {
                    r.expect("a mirrored write");
                    held_by_members(&members, &model, n, lba..lba + len, false);
                    let _ = tx.send(());
                });
                if let Err(done) = vol.start_write(lba * B, &data, done) {
                    done(vol.write(lba * B, &data));
                }
                in_flight += 1;
            }
            5 | 6 => {
                vol.write_fua(lba * B, &data).expect("a FUA write");
                held_by_members(members, model, n, lba..lba + len, false);
            }
            7 | 8 => {
                for b in lba..lba + len {
                    model.zeroed[idx(b)].fetch_max(n, Ordering::SeqCst);
                }
                if next(&mut x).is_multiple_of(2) {
                    vol.trim(lba * B, len * B).expect("a trim");
                } else {
                    vol.write_zeroes(lba * B, len * B, next(&mut x).is_multiple_of(2)).expect("a zeroing");
                }
                held_by_members(members, model, n, lba..lba + len, true);
            }
            _ => vol.flush().expect("a flush"),
        }
    }
    for _ in 0..in_flight {
        rx.recv().expect("a completion");
    }
}

fn run(seed: u64) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let _in_rt = rt.enter();
    let primary_hub = hub(dir.path(), PRIMARY, pool(dir.path(), "primary"));
    let primary = Primary::new(&primary_hub, membership(), None);
    let mut copies = Vec::new();
    for (i, endpoint) in MEMBERS.into_iter().enumerate() {
        let h = hub(dir.path(), endpoint, pool(dir.path(), endpoint));
        h.records.put(membership()).expect("a membership");
        let copy = h.pool.open_volume("v").expect("the copy").past_read_only();
        // Requests: primary -> choppy pipe -> member; acks: member -> choppy pipe -> primary.
        let pipe = || tokio::io::duplex(1 << 16);
        let ((primary_w, requests_r), (requests_w, member_r)) = (pipe(), pipe());
        let ((member_w, acks_r), (acks_w, primary_r)) = (pipe(), pipe());
        rt.spawn(choppy(requests_r, requests_w, seed ^ (i as u64 + 11)));
        rt.spawn(choppy(acks_r, acks_w, seed ^ (i as u64 + 23)));
        rt.spawn(member(MirrorService(h.clone()), copy.clone(), member_r, member_w));
        let open = MirrorOpen { volume: "v".into(), generation: 2, cumulative_acks: true, ..Default::default() };
        let open = Link::over(primary_r, primary_w, endpoint, open, Duration::from_secs(30));
        let link = rt.block_on(open).expect("a stream");
        primary.add_link(link);
        copies.push((h, copy));
    }
    primary_hub.pool.set_mirror("v", Some(Arc::clone(&primary) as Arc<dyn Mirror>)).expect("mirrored");
    let vol = primary_hub.pool.open_volume("v").expect("the volume");
    let members: Vec<Volume> = copies.iter().map(|(_, c)| c.clone()).collect();
    let model = Arc::new(Model { zeroed: (0..SIZE / B).map(|_| AtomicU64::new(0)).collect() });
    let counter = AtomicU64::new(1);
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (vol, members, model, counter) = (&vol, &members, &model, &counter);
            s.spawn(move || client(t, seed, vol, members, model, counter));
        }
    });
    vol.flush().expect("a flush");
    let image = |v: &Volume| {
        let mut all = vec![0u8; idx(SIZE)];
        v.read(0, &mut all).expect("a read");
        all
    };
    let here = image(&vol);
    for (i, m) in members.iter().enumerate() {
        assert!(image(m) == here, "seed {seed:#x}: member {i}'s copy differs from the primary's");
    }
    primary.close("the test ends");
    primary_hub.pool.set_mirror("v", None).expect("unmirrored");
}

#[test]
fn nothing_is_answered_before_every_member_holds_it_and_the_copies_end_equal() {
    let seeds: u64 = std::env::var("FERRITE_MIRROR_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(6);
    for i in 0..seeds {
        let seed = 0x5EED_0000_0000_0001u64.wrapping_add(i.wrapping_mul(0x9E37_79B9));
        let r = std::panic::catch_unwind(|| run(seed));
        assert!(r.is_ok(), "seed {seed:#x} failed (above)");
    }
}
