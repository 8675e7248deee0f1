//! What the running kernel's ublk driver can do, probed once, and what we use of it.

use std::io;
use std::path::Path;

use libublk::ctrl::UblkCtrl;
use libublk::sys;

const CONTROL: &str = "/dev/ublk-control";

/// The driver's `UBLK_F_*` feature bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features(pub u64);

const NAMES: &[(u32, &str)] = &[
    (sys::UBLK_F_SUPPORT_ZERO_COPY, "ZERO_COPY"),
    (sys::UBLK_F_URING_CMD_COMP_IN_TASK, "COMP_IN_TASK"),
    (sys::UBLK_F_NEED_GET_DATA, "NEED_GET_DATA"),
    (sys::UBLK_F_USER_RECOVERY, "USER_RECOVERY"),
    (sys::UBLK_F_USER_RECOVERY_REISSUE, "USER_RECOVERY_REISSUE"),
    (sys::UBLK_F_UNPRIVILEGED_DEV, "UNPRIVILEGED_DEV"),
    (sys::UBLK_F_CMD_IOCTL_ENCODE, "CMD_IOCTL_ENCODE"),
    (sys::UBLK_F_USER_COPY, "USER_COPY"),
    (sys::UBLK_F_ZONED, "ZONED"),
    (sys::UBLK_F_USER_RECOVERY_FAIL_IO, "USER_RECOVERY_FAIL_IO"),
    (sys::UBLK_F_UPDATE_SIZE, "UPDATE_SIZE"),
    (sys::UBLK_F_AUTO_BUF_REG, "AUTO_BUF_REG"),
    (sys::UBLK_F_QUIESCE, "QUIESCE"),
    (sys::UBLK_F_PER_IO_DAEMON, "PER_IO_DAEMON"),
];

/// True where the ublk driver is loaded (`/dev/ublk-control` exists).
pub fn available() -> bool {
    Path::new(CONTROL).exists()
}

impl Features {
    /// Asks the driver (GET_FEATURES, Linux 6.5+) once; later calls only check that the control
    /// device is still there (the module can be unloaded, or loaded after the daemon started, so a
    /// failure is never remembered). An error says why ublk cannot be used here.
    pub fn probe() -> io::Result<Self> {
        static PROBED: std::sync::OnceLock<Features> = std::sync::OnceLock::new();
        if !available() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{CONTROL} does not exist: this kernel has no ublk driver loaded (modprobe ublk_drv)"),
            ));
        }
        if let Some(f) = PROBED.get() {
            return Ok(*f);
        }
        let f = UblkCtrl::get_features().map(Self).ok_or_else(|| {
            io::Error::new(io::ErrorKind::Unsupported, "the ublk driver does not answer GET_FEATURES (kernel < 6.5?)")
        })?;
        Ok(*PROBED.get_or_init(|| f))
    }

    pub fn has(self, flag: u32) -> bool {
        self.0 & u64::from(flag) != 0
    }

    /// Names of the bits the driver reports, in bit order.
    pub fn names(self) -> Vec<&'static str> {
        NAMES.iter().filter(|(f, _)| self.has(*f)).map(|(_, n)| *n).collect()
    }

    /// The device flags we ask for: recovery (with re-issue of the requests the old process held,
    /// which is safe because every Ferrite request is idempotent) where the driver has it.
    pub fn device_flags(self) -> u64 {
        let want = sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE;
        self.0 & u64::from(want)
    }

    /// One line for logs and `ferrite attach`: what the driver has and what we use.
    ///
    /// AUTO_BUF_REG (zero copy) is never used: it hands us a kernel buffer we can only pass to
    /// io_uring fixed-buffer I/O, while the engine must see the bytes (it checksums every block
    /// and packs writes from many requests into one log batch).
    pub fn describe(self) -> String {
        let used = Features(self.device_flags()).names();
        let resize = if self.has(sys::UBLK_F_UPDATE_SIZE) { "online (UPDATE_SIZE)" } else { "on re-attach" };
        format!(
            "driver has [{}]; using [{}]; resize {resize}; zero copy not used",
            self.names().join(" "),
            used.join(" ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_flags_of_a_6_12_driver() {
        // What a 6.12 kernel reports (see the VM notes).
        let f = Features(0b11_1111_1110);
        assert!(f.has(sys::UBLK_F_USER_RECOVERY) && !f.has(sys::UBLK_F_UPDATE_SIZE));
        assert_eq!(f.device_flags(), u64::from(sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE));
        assert!(f.describe().contains("using [USER_RECOVERY USER_RECOVERY_REISSUE]"));
        assert!(f.describe().contains("resize on re-attach"));
        assert!(Features(u64::from(sys::UBLK_F_UPDATE_SIZE)).describe().contains("online"));
        assert_eq!(Features(0).device_flags(), 0);
    }

    #[test]
    fn probe_says_why_without_the_driver() {
        if available() {
            return; // a machine with ublk: nothing to check here
        }
        let e = Features::probe().unwrap_err();
        assert!(e.to_string().contains("ublk-control"), "{e}");
    }
}
