//! Volume groups and group snapshots: membership, crash consistency across members, clones.

#![allow(clippy::cast_possible_truncation)] // the shared pattern helper narrows on purpose

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use common::Fixture;
use ferrite_engine::{ErrorKind, Image, Pool};

fn counter(pool: &Pool, image: Image<'_>) -> u64 {
    let v = match image {
        Image::Volume(n) => pool.open_volume(n),
        Image::Snapshot(n) => pool.open_snapshot(n),
    }
    .unwrap();
    let mut b = [0u8; 8];
    v.read(0, &mut b).unwrap();
    u64::from_le_bytes(b)
}

#[test]
fn group_snapshots_are_one_point_in_time_across_members() {
    let (_f, pool) = Fixture::new(128);
    let pool = Arc::new(pool);
    for v in ["a", "b", "c"] {
        pool.create_volume(v, 1 << 20).unwrap();
    }
    pool.create_group("app", &["a", "b", "c"]).unwrap();
    // One writer stamps the same counter into a, then b, then c. Any point in time has
    // a >= b >= c and a - c <= 1; snapshots taken one by one would not.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (pool, stop) = (Arc::clone(&pool), Arc::clone(&stop));
        std::thread::spawn(move || {
            let vols: Vec<_> = ["a", "b", "c"].iter().map(|n| pool.open_volume(n).unwrap()).collect();
            let mut i = 1u64;
            while !stop.load(Ordering::Relaxed) {
                for v in &vols {
                    v.write(0, &i.to_le_bytes()).unwrap();
                }
                i += 1;
            }
        })
    };
    for k in 0..40 {
        let gs = pool.create_group_snapshot("app", &format!("g{k}")).unwrap();
        assert_eq!(gs.snapshots.len(), 3);
        let [a, b, c] = ["a", "b", "c"].map(|v| counter(&pool, Image::Snapshot(&format!("g{k}.{v}"))));
        assert!(a >= b && b >= c && a - c <= 1, "group snapshot g{k} is not one point in time: {a} {b} {c}");
    }
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert_eq!(pool.group_snapshots(Some("app")).unwrap().len(), 40);
}

#[test]
fn membership_clone_delete_and_persistence() {
    let (f, pool) = Fixture::new(64);
    for v in ["a", "b", "c"] {
        pool.create_volume(v, 1 << 20).unwrap();
        pool.open_volume(v).unwrap().write(0, &(v.as_bytes()[0] as u64).to_le_bytes()).unwrap();
    }
    let g = pool.create_group("app", &["a", "b"]).unwrap();
    assert_eq!(g.volumes, vec!["a", "b"]);
    assert_eq!(pool.create_group("other", &["a"]).unwrap_err().kind(), ErrorKind::AlreadyExists);
    assert_eq!(pool.create_group("app", &["c"]).unwrap_err().kind(), ErrorKind::AlreadyExists);
    assert_eq!(pool.create_group("x", &["nope"]).unwrap_err().kind(), ErrorKind::NotFound);
    let g = pool.update_group("app", &["c"], &["a"]).unwrap();
    assert_eq!(g.volumes, vec!["b", "c"]);
    pool.create_group_snapshot("app", "s1").unwrap();
    // Member snapshots belong to the group snapshot.
    assert_eq!(pool.delete_snapshot("s1.b").unwrap_err().kind(), ErrorKind::InvalidArgument);
    let clone = pool.clone_group_snapshot("s1", "copy").unwrap();
    assert_eq!(clone.volumes, vec!["copy.b", "copy.c"]);
    assert_eq!(counter(&pool, Image::Volume("copy.c")), u64::from(b'c'));
    // Deleting a member volume drops it from the group; everything survives a reopen.
    pool.delete_volume("b").unwrap();
    assert_eq!(pool.groups().iter().find(|g| g.name == "app").unwrap().volumes, vec!["c"]);
    pool.close().unwrap();
    let pool = f.reopen();
    let names: Vec<_> = pool.groups().into_iter().map(|g| (g.name, g.volumes)).collect();
    assert_eq!(
        names,
        vec![("app".into(), vec!["c".to_string()]), ("copy".into(), vec!["copy.b".into(), "copy.c".into()])]
    );
    let gs = pool.group_snapshots(None).unwrap();
    assert_eq!(gs[0].snapshots, vec![("s1.b".to_string(), "b".to_string()), ("s1.c".into(), "c".into())]);
    assert_eq!(counter(&pool, Image::Snapshot("s1.b")), u64::from(b'b'));
    pool.delete_group_snapshot("s1").unwrap();
    assert!(pool.snapshots(None).unwrap().is_empty());
    assert_eq!(counter(&pool, Image::Volume("copy.b")), u64::from(b'b'), "clones keep what they need");
    pool.delete_group("app").unwrap();
    assert_eq!(pool.delete_group("app").unwrap_err().kind(), ErrorKind::NotFound);
    assert!(pool.open_volume("c").is_ok(), "deleting a group keeps its volumes");
}
