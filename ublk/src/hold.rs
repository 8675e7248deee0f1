//! The bound on how long a ublk device waits for its daemon.
//!
//! With USER_RECOVERY the kernel holds a device's I/O while no daemon serves it (the device is
//! QUIESCED), with no time limit: a daemon that never comes back leaves every process using the
//! device hanging in D state. So the daemon lists its devices and their hold in a file next to
//! its admin socket ([`List`], written durably and privately by the daemon), and a watchdog outside the daemon (the CSI node plugin, or
//! `ferrite watchdog`) fails a device that has waited longer than its hold ([`Watchdog`]): its
//! held and later requests end with EIO and the device goes away, as a dead disk's would.
//!
//! The list carries the boot it was written in: after a reboot its device ids may name other
//! servers' devices, so a list from another boot is empty until the daemon rewrites it.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use libublk::ctrl::UblkCtrl;
use libublk::sys;
use serde::{Deserialize, Serialize};

/// A device the daemon serves, and how long it may wait for the next daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Held {
    pub id: u32,
    pub volume: String,
    pub hold_s: u64,
}

/// The file's contents: the devices, and the boot they were listed in.
#[derive(Debug, Serialize, Deserialize)]
pub struct List {
    boot_id: String,
    devices: Vec<Held>,
}

impl List {
    /// `devices`, listed in this boot.
    pub fn now(devices: Vec<Held>) -> io::Result<Self> {
        Ok(Self { boot_id: boot_id()?, devices })
    }
}

/// The list's place: `ublk-hold.json` in the directory of the daemon's admin socket, which the
/// node plugin shares.
pub fn path(admin_socket: &Path) -> PathBuf {
    admin_socket.parent().unwrap_or(Path::new(".")).join("ublk-hold.json")
}

fn boot_id() -> io::Result<String> {
    Ok(std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?.trim().to_owned())
}

/// The devices the last daemon listed in this boot; none if there is no list or it is from an
/// earlier boot.
pub fn load(path: &Path) -> io::Result<Vec<Held>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let list: List = serde_json::from_slice(&bytes)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{}: {e}", path.display())))?;
    Ok(if list.boot_id == boot_id()? { list.devices } else { Vec::new() })
}

/// A device's state as the watchdog needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// A daemon serves it.
    Served,
    /// No daemon serves it; the kernel holds its I/O.
    Waiting,
    /// No such device.
    Gone,
}

/// Asks the driver (GET_DEV_INFO) for device `id`'s state.
pub fn state(id: u32) -> io::Result<State> {
    if !Path::new(&format!("/sys/class/ublk-char/ublkc{id}")).exists() {
        return Ok(State::Gone);
    }
    let ctrl = UblkCtrl::new_simple(i32::try_from(id).unwrap_or(i32::MAX))
        .map_err(|e| io::Error::other(format!("ublk: reading device {id}: {e}")))?;
    Ok(match u32::from(ctrl.dev_info().state) {
        sys::UBLK_S_DEV_QUIESCED | sys::UBLK_S_DEV_FAIL_IO => State::Waiting,
        sys::UBLK_S_DEV_DEAD => State::Gone,
        _ => State::Served,
    })
}

/// What a pass did to one device.
#[derive(Debug)]
pub struct Failed {
    pub device: Held,
    pub waited: Duration,
    pub result: io::Result<()>,
}

/// Fails devices that wait longer than their hold; remembers since when each one waits.
#[derive(Debug, Default)]
pub struct Watchdog {
    waiting_since: HashMap<u32, Instant>,
}

impl Watchdog {
    /// One look at the listed devices, reading the driver and failing through it.
    pub fn pass(&mut self, devices: &[Held]) -> Vec<Failed> {
        self.pass_with(devices, Instant::now(), state, crate::Device::fail)
    }

    /// [`Self::pass`] with the clock, the state and the failing given (tests).
    pub fn pass_with(
        &mut self,
        devices: &[Held],
        now: Instant,
        state: impl Fn(u32) -> io::Result<State>,
        fail: impl Fn(u32) -> io::Result<()>,
    ) -> Vec<Failed> {
        let mut failed = Vec::new();
        let mut still = HashMap::new();
        for d in devices {
            match state(d.id) {
                Ok(State::Waiting) => {
                    let since = *self.waiting_since.get(&d.id).unwrap_or(&now);
                    let waited = now.saturating_duration_since(since);
                    if waited < Duration::from_secs(d.hold_s) {
                        still.insert(d.id, since);
                        continue;
                    }
                    let result = fail(d.id);
                    if result.is_err() {
                        still.insert(d.id, since); // tried again next pass
                    }
                    failed.push(Failed { device: d.clone(), waited, result });
                }
                Ok(State::Served | State::Gone) => {}
                // Unreadable this time: keep the clock running, try again next pass.
                Err(_) => {
                    if let Some(since) = self.waiting_since.get(&d.id) {
                        still.insert(d.id, *since);
                    }
                }
            }
        }
        self.waiting_since = still;
        failed
    }
}

/// How often the watchdog looks.
const EVERY: Duration = Duration::from_secs(1);

/// Watches the devices listed at `list` for as long as the process runs: every second, reads
/// the list and fails the devices that waited past their hold, logging each.
pub fn run(list: &Path) -> ! {
    let mut dog = Watchdog::default();
    let mut last_error = String::new();
    loop {
        match load(list) {
            Ok(devices) => {
                last_error.clear();
                for f in dog.pass(&devices) {
                    let Failed { device: d, waited, result } = f;
                    match result {
                        Ok(()) => tracing::error!(device = d.id, volume = %d.volume, ?waited,
                            "ublk device failed: no daemon served it within its hold ({} s); its I/O ends with EIO",
                            d.hold_s),
                        Err(e) => tracing::error!(device = d.id, volume = %d.volume, error = %e,
                            "cannot fail a ublk device past its hold; trying again"),
                    }
                }
            }
            Err(e) if e.to_string() != last_error => {
                tracing::warn!(list = %list.display(), error = %e, "cannot read the ublk hold list");
                last_error = e.to_string();
            }
            Err(_) => {}
        }
        std::thread::sleep(EVERY);
    }
}

/// [`run`] on a thread of its own (the CSI node plugin).
pub fn spawn(list: PathBuf) -> io::Result<()> {
    tracing::info!(list = %list.display(), "ublk watchdog on: devices no daemon serves past their hold fail");
    std::thread::Builder::new().name("ublk-watchdog".into()).spawn(move || run(&list)).map(drop)
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    fn held(id: u32, hold_s: u64) -> Held {
        Held { id, volume: format!("v{id}"), hold_s }
    }

    #[test]
    fn a_device_fails_only_after_waiting_its_whole_hold() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let states = RefCell::new(HashMap::from([(1, State::Waiting), (2, State::Served)]));
        let failed = RefCell::new(Vec::new());
        let mut w = Watchdog::default();
        let devices = [held(1, 10), held(2, 10)];
        let mut pass = |t: Instant| {
            w.pass_with(
                &devices,
                t,
                |id| Ok(states.borrow()[&id]),
                |id| {
                    failed.borrow_mut().push(id);
                    Ok(())
                },
            )
        };
        assert!(pass(at(0)).is_empty());
        assert!(pass(at(9)).is_empty(), "9 s of a 10 s hold");
        // Served again (a daemon recovered it): the clock starts over on the next wait.
        states.borrow_mut().insert(1, State::Served);
        assert!(pass(at(10)).is_empty());
        states.borrow_mut().insert(1, State::Waiting);
        assert!(pass(at(11)).is_empty());
        assert!(pass(at(20)).is_empty());
        let f = pass(at(21));
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].device.id, f[0].waited), (1, Duration::from_secs(10)));
        assert_eq!(*failed.borrow(), [1], "the served device is never touched");
    }

    #[test]
    fn an_unreadable_device_keeps_its_clock_and_a_gone_one_is_forgotten() {
        let t0 = Instant::now();
        let mut w = Watchdog::default();
        let d = [held(3, 5)];
        let never = |_| -> io::Result<()> { panic!("not yet") };
        assert!(w.pass_with(&d, t0, |_| Ok(State::Waiting), never).is_empty());
        assert!(w.pass_with(&d, t0 + Duration::from_secs(3), |_| Err(io::Error::other("busy")), never).is_empty());
        let f = w.pass_with(&d, t0 + Duration::from_secs(5), |_| Ok(State::Waiting), |_| Ok(()));
        assert_eq!(f.len(), 1, "the unreadable pass did not restart the clock");
        assert!(w.waiting_since.is_empty(), "a failed device is forgotten");
        w.pass_with(&d, t0 + Duration::from_secs(5), |_| Ok(State::Waiting), never);
        let f = w.pass_with(&d, t0 + Duration::from_secs(10), |_| Ok(State::Waiting), |_| Err(io::Error::other("x")));
        assert!(f[0].result.is_err());
        let f = w.pass_with(&d, t0 + Duration::from_secs(11), |_| Ok(State::Waiting), |_| Ok(()));
        assert_eq!(f[0].waited, Duration::from_secs(6), "a failed attempt is retried with the same clock");
        assert!(w.pass_with(&d, t0, |_| Ok(State::Gone), never).is_empty());
        assert!(w.waiting_since.is_empty());
    }

    #[test]
    fn the_list_round_trips_and_an_earlier_boots_list_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let p = path(&dir.path().join("admin.sock"));
        assert_eq!(p, dir.path().join("ublk-hold.json"));
        assert!(load(&p).unwrap().is_empty(), "no list: nothing held");
        let list = List::now(vec![held(0, 120), held(4, 30)]).unwrap();
        std::fs::write(&p, serde_json::to_vec(&list).unwrap()).unwrap();
        assert_eq!(load(&p).unwrap(), [held(0, 120), held(4, 30)]);
        let other = serde_json::json!({"boot_id": "another-boot", "devices": [held(0, 1)]});
        std::fs::write(&p, other.to_string()).unwrap();
        assert!(load(&p).unwrap().is_empty());
        std::fs::write(&p, b"{oops").unwrap();
        assert!(load(&p).unwrap_err().to_string().contains("ublk-hold.json"));
    }
}
