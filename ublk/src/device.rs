//! A volume attached as /dev/ublkbN: the control thread that adds (or recovers) the device and
//! runs its queues, and the handle that detaches it.

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use ferrite_engine::Volume;
use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::UblkDev;
use libublk::{UblkError, UblkFlags, sys};

use crate::features::Features;
use crate::queue::Gate;

/// Queue layout of a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Hardware queues, each served by its own thread and ring (default: one per core).
    pub queues: u16,
    /// Requests in flight per queue.
    pub depth: u16,
    /// Largest request in bytes (the kernel splits larger ones).
    pub max_io_bytes: u32,
}

impl Default for Options {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        Self { queues: u16::try_from(cores).unwrap_or(u16::MAX).min(16), depth: 128, max_io_bytes: 512 << 10 }
    }
}

impl Options {
    pub fn validate(&self) -> io::Result<()> {
        let bad = |m: String| Err(io::Error::new(io::ErrorKind::InvalidInput, m));
        if !(1..=64).contains(&self.queues) {
            return bad(format!("ublk queues must be 1..=64, not {}", self.queues));
        }
        if !(1..=4096).contains(&self.depth) {
            return bad(format!("ublk queue depth must be 1..=4096, not {}", self.depth));
        }
        if !(4096..=(4 << 20)).contains(&self.max_io_bytes) || !self.max_io_bytes.is_multiple_of(4096) {
            return bad(format!("ublk max I/O size must be 4 KiB..4 MiB in 4 KiB steps, not {}", self.max_io_bytes));
        }
        Ok(())
    }
}

#[allow(clippy::cast_possible_truncation)] // 4096
const BLOCK_BYTES: u32 = ferrite_engine::io::BLOCK as u32;

/// Largest discard / write-zeroes request the kernel sends us, in sectors (1 GiB).
const MAX_DISCARD_SECTORS: u32 = 1 << 21;

fn ublk_error(what: &str, e: UblkError) -> io::Error {
    match e {
        UblkError::IOError(io) => io::Error::new(io.kind(), format!("ublk: {what}: {io}")),
        // A command the kernel refused: its errno says why (libublk's message does not). The kind
        // stays Other: the refusal is the host's, not the caller's (no InvalidInput for EINVAL).
        UblkError::UringIOError(res) => {
            let os = io::Error::from_raw_os_error(res.abs());
            io::Error::other(format!("ublk: {what}: the kernel refused a command: {os}"))
        }
        e => io::Error::other(format!("ublk: {what}: {e}")),
    }
}

/// An attached device. Dropping the handle leaves the device to the kernel: with USER_RECOVERY it
/// waits (queued I/O, nothing failed) for a new daemon to `recover` it.
#[derive(Debug)]
pub struct Device {
    id: u32,
    read_only: bool,
    gate: Arc<Gate>,
    thread: Option<JoinHandle<()>>,
}

impl Device {
    /// Adds /dev/ublkbN for `volume` (read-only for a snapshot handle) and starts serving it.
    pub fn attach(volume: Volume, opts: &Options) -> io::Result<Self> {
        Self::start(volume, opts, None)
    }

    /// Takes over device `id` left by a daemon that exited (USER_RECOVERY): its queued and
    /// re-issued requests are served from now on, and the block device never went away.
    pub fn recover(id: u32, volume: Volume, opts: &Options) -> io::Result<Self> {
        Self::start(volume, opts, Some(id))
    }

    /// Ends device `id` left by a daemon that exited, without taking it over: the requests the
    /// kernel holds for it, and every later one, fail (EIO) and the device goes away. For a
    /// device whose volume may have lost acknowledged writes: resuming it would hand the
    /// filesystem above stale blocks it believes written.
    pub fn fail(id: u32) -> io::Result<()> {
        let ctrl = UblkCtrl::new_simple(i32::try_from(id).unwrap_or(i32::MAX))
            .map_err(|e| ublk_error("opening the device to fail it", e))?;
        // Stopping a device no daemon serves fails what it held; deleting it removes it. The
        // deletion does not wait for the last user (a mounted filesystem holds the disk until
        // it is unmounted): DEL_DEV_ASYNC, Linux 6.8+.
        ctrl.kill_dev().map_err(|e| ublk_error("stopping the device", e))?;
        ctrl.del_dev_async().map(drop).map_err(|e| ublk_error("deleting the device", e))
    }

    fn start(volume: Volume, opts: &Options, recover: Option<u32>) -> io::Result<Self> {
        opts.validate()?;
        let features = Features::probe()?;
        let read_only = volume.is_read_only();
        let size = volume.size().map_err(io::Error::other)?;
        let (tx, rx) = mpsc::sync_channel(1);
        let opts = *opts;
        let gate = Arc::new(Gate::default());
        let queue_gate = Arc::clone(&gate);
        let thread = std::thread::Builder::new().name("ublk-ctrl".into()).spawn(move || {
            let started = tx.clone();
            let result = run(volume, queue_gate, size, &opts, features, recover, move |id| {
                let _ = started.send(Ok(id));
            });
            if let Err(e) = result {
                let _ = tx.send(Err(e));
            }
        })?;
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(Ok(id)) => Ok(Self { id, read_only, gate, thread: Some(thread) }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(io::Error::new(io::ErrorKind::TimedOut, "ublk: the device did not start within 120 s")),
        }
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    pub fn path(&self) -> PathBuf {
        block_path(self.id)
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    /// Sets the device's size after the volume grew: online where the driver has UPDATE_SIZE
    /// (Linux 6.16+), returning false where it does not (the new size shows on re-attach).
    pub fn resize(&self, bytes: u64) -> io::Result<bool> {
        if !Features::probe()?.has(sys::UBLK_F_UPDATE_SIZE) {
            return Ok(false);
        }
        let ctrl = UblkCtrl::new_simple(self.id_i32()).map_err(|e| ublk_error("opening the device", e))?;
        ctrl.update_size(bytes).map_err(|e| ublk_error("UPDATE_SIZE", e))?;
        Ok(true)
    }

    fn id_i32(&self) -> i32 {
        i32::try_from(self.id).unwrap_or(i32::MAX)
    }

    /// Before the daemon exits: stop handing requests to the engine and wait for those already
    /// there, so none fails on a closed pool. The device stays; the kernel keeps (and re-issues)
    /// later requests for the daemon that recovers it. False if requests were still running
    /// after `limit`.
    pub fn freeze(&self, limit: Duration) -> bool {
        self.gate.freeze(limit)
    }

    /// Stops and deletes the device (in-flight requests finish first; the block layer fails
    /// later ones) and waits for its threads. Can be retried after an error.
    pub fn detach(&mut self) -> io::Result<()> {
        let ctrl = UblkCtrl::new_simple(self.id_i32()).map_err(|e| ublk_error("opening the device", e))?;
        ctrl.kill_dev().map_err(|e| ublk_error("stopping the device", e))?;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // A recovered device's control is not the one that added it, so nothing deleted it yet.
        if std::path::Path::new(&format!("/sys/class/ublk-char/ublkc{}", self.id)).exists() {
            ctrl.del_dev().map_err(|e| ublk_error("deleting the device", e))?;
        }
        Ok(())
    }
}

/// /dev/ublkbN of device `id`.
pub fn block_path(id: u32) -> PathBuf {
    PathBuf::from(format!("/dev/ublkb{id}"))
}

fn set_params(dev: &mut UblkDev, size: u64, read_only: bool) {
    let depth = dev.dev_info.queue_depth;
    let max_sectors = dev.dev_info.max_io_buf_bytes >> 9;
    let mut attrs = sys::UBLK_ATTR_VOLATILE_CACHE | sys::UBLK_ATTR_FUA;
    if read_only {
        attrs |= sys::UBLK_ATTR_READ_ONLY;
    }
    dev.tgt.dev_size = size;
    dev.tgt.params = sys::ublk_params {
        types: sys::UBLK_PARAM_TYPE_BASIC | sys::UBLK_PARAM_TYPE_DISCARD,
        basic: sys::ublk_param_basic {
            attrs,
            logical_bs_shift: 9,
            physical_bs_shift: 12,
            io_opt_shift: 12,
            io_min_shift: 12,
            max_sectors,
            dev_sectors: size >> 9,
            ..Default::default()
        },
        discard: sys::ublk_param_discard {
            // Trim frees whole engine blocks only.
            discard_granularity: BLOCK_BYTES,
            max_discard_sectors: MAX_DISCARD_SECTORS,
            max_write_zeroes_sectors: MAX_DISCARD_SECTORS,
            max_discard_segments: 1,
            ..Default::default()
        },
        ..Default::default()
    };
    // One more ring slot per queue for the completion eventfd's poll.
    dev.tgt.sq_depth = depth + 1;
    dev.tgt.cq_depth = depth + 1;
}

/// The control thread: add or recover the device, serve its queues until it stops.
#[allow(clippy::too_many_arguments)]
fn run(
    volume: Volume,
    gate: Arc<Gate>,
    size: u64,
    opts: &Options,
    features: Features,
    recover: Option<u32>,
    started: impl FnOnce(u32) + Send + Sync + 'static,
) -> io::Result<()> {
    let (id, dev_flags) = match recover {
        Some(id) => {
            let id = i32::try_from(id).map_err(io::Error::other)?;
            let ctrl = UblkCtrl::new_simple(id).map_err(|e| ublk_error("opening the device to recover", e))?;
            ctrl.start_user_recover().map_err(|e| ublk_error("START_USER_RECOVERY", e))?;
            (id, UblkFlags::UBLK_DEV_F_RECOVER_DEV)
        }
        None => (-1, UblkFlags::UBLK_DEV_F_ADD_DEV),
    };
    let ctrl = UblkCtrlBuilder::default()
        .name("ferrite")
        .id(id)
        .nr_queues(opts.queues)
        .depth(opts.depth)
        .io_buf_bytes(opts.max_io_bytes)
        .ctrl_flags(features.device_flags())
        .dev_flags(dev_flags)
        .build()
        .map_err(|e| ublk_error("adding the device", e))?;
    let read_only = volume.is_read_only();
    let queue_volume = volume.clone();
    ctrl.run_target(
        move |dev: &mut UblkDev| {
            set_params(dev, size, read_only);
            Ok(())
        },
        move |qid, dev: &UblkDev| crate::queue::serve(qid, dev, queue_volume.clone(), Arc::clone(&gate)),
        move |ctrl: &UblkCtrl| started(ctrl.dev_info().dev_id),
    )
    .map_err(|e| match e {
        // Some kernels (Debian's 6.17) compare START_DEV's pid with the host's view of ours.
        UblkError::UringIOError(res) if res.abs() == libc::EINVAL => ublk_error(
            "running the device (if this server runs in a PID namespace other than the host's: some kernels, \
             Debian's 6.17 among them, refuse its START_DEV; run it in the host's, e.g. hostPID in a pod)",
            e,
        ),
        e => ublk_error("running the device", e),
    })?;
    tracing::info!(volume = volume.name(), "ublk device stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_command_names_its_errno() {
        let e = ublk_error("running the device", UblkError::UringIOError(-libc::EINVAL));
        assert_eq!(e.kind(), io::ErrorKind::Other);
        assert!(e.to_string().contains("Invalid argument"), "{e}");
        let e = ublk_error("adding the device", UblkError::IOError(io::Error::from(io::ErrorKind::NotFound)));
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }
}
