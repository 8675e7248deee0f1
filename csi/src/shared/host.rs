//! The node's host side: the mount table, mount/umount, mkfs, filesystem growth, usage and
//! device sizes. Tools are the ones every Linux node has (util-linux, e2fsprogs, xfsprogs); their
//! stderr goes into the error a caller sees.

use std::io;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tonic::Status;

/// How long one host command may take (mkfs of a large xfs volume is the slowest).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(600);

/// One line of `/proc/self/mountinfo` (proc(5)): the fields this driver decides by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The device number of the mounted filesystem (for a bind of a device node: devtmpfs's).
    pub dev: (u32, u32),
    /// The path inside that filesystem that is mounted (for a device node bind: `/ublkb0`).
    pub root: PathBuf,
    pub target: PathBuf,
    pub read_only: bool,
    pub fs_type: String,
}

/// Undoes the kernel's escaping of mountinfo paths: space, tab, newline and backslash appear as
/// `\ooo` (octal). Paths are bytes, not necessarily UTF-8.
fn unescape(s: &[u8]) -> PathBuf {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        let octal = s.get(i + 1..i + 4).filter(|o| o.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (s[i], octal) {
            (b'\\', Some(o)) => {
                out.push(o.iter().fold(0u8, |n, c| n.wrapping_mul(8).wrapping_add(c - b'0')));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    PathBuf::from(std::ffi::OsString::from_vec(out))
}

/// Parses one line: `id parent major:minor root target options [optional fields...] - fstype
/// source super-options`. None for a line that does not have that shape.
fn parse_line(line: &[u8]) -> Option<Mount> {
    let f: Vec<&[u8]> = line.split(|b| *b == b' ').collect();
    let sep = f.iter().skip(6).position(|x| *x == b"-")? + 6;
    let fs_type = f.get(sep + 1)?;
    let dev = std::str::from_utf8(f[2]).ok()?;
    let (maj, min) = dev.split_once(':')?;
    Some(Mount {
        dev: (maj.parse().ok()?, min.parse().ok()?),
        root: unescape(f[3]),
        target: unescape(f[4]),
        read_only: f[5].split(|b| *b == b',').any(|o| o == b"ro"),
        fs_type: String::from_utf8_lossy(fs_type).into_owned(),
    })
}

/// Every well-formed line of a mountinfo table, in its order (later mounts stack on earlier).
pub fn parse_mountinfo(text: &[u8]) -> Vec<Mount> {
    text.split(|b| *b == b'\n').filter_map(parse_line).collect()
}

pub fn mounts() -> io::Result<Vec<Mount>> {
    Ok(parse_mountinfo(&std::fs::read("/proc/self/mountinfo")?))
}

/// What is mounted at `path` (the topmost mount), if anything.
pub fn mounted_at(path: &Path) -> io::Result<Option<Mount>> {
    let Ok(path) = path.canonicalize() else { return Ok(None) };
    Ok(mounts()?.into_iter().rev().find(|m| m.target == path))
}

/// Whether `m` shows `device` itself: its filesystem, or (raw block publish) a bind of its node.
pub fn shows_device(m: &Mount, device: &Path) -> io::Result<bool> {
    let name = device.file_name().map(|n| Path::new("/").join(n));
    Ok(m.dev == device_number(device)? || (m.fs_type == "devtmpfs" && Some(&m.root) == name.as_ref()))
}

pub fn device_number(device: &Path) -> io::Result<(u32, u32)> {
    let rdev = std::fs::metadata(device)?.rdev();
    Ok((rustix::fs::major(rdev), rustix::fs::minor(rdev)))
}

/// The size the kernel gives the block device now (it can lag the volume's until a resize).
pub fn device_size(device: &Path) -> io::Result<u64> {
    let name = device.file_name().ok_or_else(|| io::Error::other("device path has no name"))?;
    let sys = Path::new("/sys/class/block").join(name).join("size");
    let sectors: u64 = std::fs::read_to_string(&sys)?.trim().parse().map_err(io::Error::other)?;
    Ok(sectors * 512)
}

/// Filesystem usage of the mount at `path`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub bytes_total: u64,
    pub bytes_available: u64,
    pub bytes_used: u64,
    pub inodes_total: u64,
    pub inodes_free: u64,
    pub inodes_used: u64,
}

pub fn usage(path: &Path) -> io::Result<Usage> {
    let s = rustix::fs::statvfs(path)?;
    let frsize = s.f_frsize;
    Ok(Usage {
        bytes_total: s.f_blocks * frsize,
        bytes_available: s.f_bavail * frsize,
        bytes_used: (s.f_blocks - s.f_bfree) * frsize,
        inodes_total: s.f_files,
        inodes_free: s.f_ffree,
        inodes_used: s.f_files - s.f_ffree,
    })
}

/// Runs a host tool; Internal with its stderr when it fails.
pub async fn run(program: &str, args: &[&str]) -> Result<String, Status> {
    let out = tokio::time::timeout(
        COMMAND_TIMEOUT,
        tokio::process::Command::new(program).args(args).stdin(std::process::Stdio::null()).output(),
    )
    .await
    .map_err(|_| Status::deadline_exceeded(format!("{program} {} took longer than 10 minutes", args.join(" "))))?
    .map_err(|e| Status::internal(format!("cannot run {program}: {e}")))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(Status::internal(format!("{program} {} failed ({}): {}", args.join(" "), out.status, err.trim())));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What a device holds: `Some(fs type)`, `None` when it is blank; FailedPrecondition when it holds
/// something that is not a filesystem (a partition table, say), which we must not format over.
pub async fn content(device: &Path) -> Result<Option<String>, Status> {
    let dev = device.to_string_lossy();
    let out = tokio::process::Command::new("blkid")
        .args(["-p", "-o", "export", &dev])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| Status::internal(format!("cannot run blkid: {e}")))?;
    match out.status.code() {
        Some(2) => Ok(None), // nothing found: blank
        Some(0) => {
            let text = String::from_utf8_lossy(&out.stdout);
            let value = |key: &str| text.lines().find_map(|l| l.strip_prefix(key)).map(str::to_owned);
            match (value("TYPE="), value("PTTYPE=")) {
                (Some(t), _) => Ok(Some(t)),
                (None, Some(pt)) => Err(Status::failed_precondition(format!(
                    "{dev} holds a {pt} partition table, not a filesystem; refusing to format it"
                ))),
                (None, None) => Err(Status::failed_precondition(format!("{dev} holds unrecognised content"))),
            }
        }
        _ => Err(Status::internal(format!("blkid {dev} failed: {}", String::from_utf8_lossy(&out.stderr).trim()))),
    }
}

pub async fn mkfs(device: &Path, fs: &str) -> Result<(), Status> {
    let dev = device.to_string_lossy();
    match fs {
        "ext4" => run("mkfs.ext4", &["-q", "-F", "-E", "nodiscard", &dev]).await,
        "xfs" => run("mkfs.xfs", &["-q", "-f", "-K", &dev]).await,
        other => return Err(Status::invalid_argument(format!("fs_type {other:?} is not supported"))),
    }
    .map(drop)
}

/// Mounts `device`'s filesystem at `target`. xfs gets `nouuid`: a clone carries its origin's
/// UUID, and both may be mounted on one node.
pub async fn mount(device: &Path, target: &Path, fs: &str, flags: &[String], read_only: bool) -> Result<(), Status> {
    let mut opts: Vec<&str> = flags.iter().map(String::as_str).collect();
    if fs == "xfs" {
        opts.push("nouuid");
    }
    if read_only {
        opts.push("ro");
    }
    let (dev, dir) = (device.to_string_lossy(), target.to_string_lossy());
    let o = opts.join(",");
    let mut args = vec!["-t", fs];
    if !o.is_empty() {
        args.extend(["-o", &o]);
    }
    args.extend([&*dev, &*dir]);
    run("mount", &args).await.map(drop)
}

/// Bind-mounts `source` (a directory or a device node) at `target`, read-only if asked.
pub async fn bind(source: &Path, target: &Path, read_only: bool) -> Result<(), Status> {
    let (src, dst) = (source.to_string_lossy(), target.to_string_lossy());
    run("mount", &["--bind", &src, &dst]).await?;
    if read_only && let Err(e) = run("mount", &["-o", "remount,bind,ro", &dst]).await {
        let _ = run("umount", &[&dst]).await;
        return Err(e);
    }
    Ok(())
}

/// Unmounts everything stacked at `target`.
pub async fn unmount_all(target: &Path) -> Result<(), Status> {
    while mounted_at(target).map_err(|e| Status::internal(format!("reading the mount table: {e}")))?.is_some() {
        run("umount", &[&target.to_string_lossy()]).await?;
    }
    Ok(())
}

/// Grows the filesystem mounted at `mount_point` from `device` to the device's size.
pub async fn grow(fs: &str, device: &Path, mount_point: &Path) -> Result<(), Status> {
    match fs {
        "ext4" | "ext3" | "ext2" => run("resize2fs", &[&device.to_string_lossy()]).await,
        "xfs" => run("xfs_growfs", &[&mount_point.to_string_lossy()]).await,
        other => return Err(Status::failed_precondition(format!("cannot grow a {other} filesystem"))),
    }
    .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_parse() {
        let text = b"\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 259:3 / /var/lib/k\\040s/stage rw,nosuid - xfs /dev/ublkb3 rw,nouuid
41 22 0:5 /ublkb3 /pods/dev ro,relatime shared:2 master:1 - devtmpfs udev rw
42 22 0:6 / /a-b rw - tmpfs tmpfs rw
garbage line
1 2 3:4 / /x rw -
";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 4);
        assert_eq!(m[1].target, PathBuf::from("/var/lib/k s/stage"));
        assert_eq!((m[1].dev, m[1].fs_type.as_str(), m[1].read_only), ((259, 3), "xfs", false));
        assert_eq!(
            (m[2].root.as_path(), m[2].read_only, m[2].fs_type.as_str()),
            (Path::new("/ublkb3"), true, "devtmpfs")
        );
        assert_eq!((m[3].target.as_path(), m[3].fs_type.as_str()), (Path::new("/a-b"), "tmpfs"));
    }

    /// The kernel's escaping (fs/proc_namespace.c: `mangle` of " \t\n\\").
    fn mangle(path: &[u8]) -> Vec<u8> {
        path.iter()
            .flat_map(|&c| if b" \t\n\\".contains(&c) { format!("\\{c:03o}").into_bytes() } else { vec![c] })
            .collect()
    }

    proptest::proptest! {
        /// Any path the kernel can print (bytes other than NUL, escaped as the kernel does) comes
        /// back exactly, whatever optional fields the line carries.
        #[test]
        fn mountinfo_paths_round_trip(
            parts in proptest::collection::vec(proptest::collection::vec(1u8..=255, 1..12), 0..5),
            root in proptest::collection::vec(1u8..=255, 0..12),
            optional in proptest::collection::vec("(shared|master|propagate_from):[0-9]{1,3}|unbindable", 0..3),
            fs_type in "[a-z0-9.]{1,8}",
            ro in proptest::bool::ANY,
            dev in (0u32..4096, 0u32..1_048_576),
        ) {
            use std::os::unix::ffi::OsStrExt;
            let target: Vec<u8> = parts.iter().flat_map(|p| {
                let mut c = vec![b'/'];
                c.extend(p.iter().map(|&b| if b == b'/' { b'_' } else { b }));
                c
            }).collect();
            let target = if target.is_empty() { b"/".to_vec() } else { target };
            let root = [b"/".as_slice(), &root].concat();
            let mut line = format!("36 35 {}:{} ", dev.0, dev.1).into_bytes();
            line.extend(mangle(&root));
            line.push(b' ');
            line.extend(mangle(&target));
            line.extend(format!(" {},noatime", if ro { "ro" } else { "rw" }).bytes());
            for o in &optional {
                line.extend(format!(" {o}").bytes());
            }
            line.extend(format!(" - {fs_type} /dev/x rw\n").bytes());
            let m = parse_mountinfo(&line);
            proptest::prop_assert_eq!(m.len(), 1);
            proptest::prop_assert_eq!(m[0].target.as_os_str().as_bytes(), target.as_slice());
            proptest::prop_assert_eq!(m[0].root.as_os_str().as_bytes(), root.as_slice());
            proptest::prop_assert_eq!((m[0].dev, m[0].read_only, m[0].fs_type.as_str()), (dev, ro, fs_type.as_str()));
        }

        /// Arbitrary bytes never panic the parser.
        #[test]
        fn mountinfo_garbage_is_skipped(text in proptest::collection::vec(proptest::num::u8::ANY, 0..400)) {
            let _ = parse_mountinfo(&text);
        }
    }

    #[test]
    fn own_mounts_and_usage() {
        assert!(mounted_at(Path::new("/proc")).unwrap().is_some());
        assert!(mounted_at(Path::new("/nonexistent/ferrite")).unwrap().is_none());
        let u = usage(Path::new("/")).unwrap();
        assert!(u.bytes_total > 0 && u.bytes_used <= u.bytes_total && u.inodes_used <= u.inodes_total);
        assert!(usage(Path::new("/nonexistent/ferrite")).is_err());
    }
}
