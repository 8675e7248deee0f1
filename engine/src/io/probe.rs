//! What a file or block device already holds, before it is formatted as a pool: the signatures
//! of the filesystems, volume managers and partition tables an administrator may point
//! `ferrite pool format` at by mistake (the same places blkid/wipefs look), and our own pool.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// A pool's superblock magic (`format::SUPER_MAGIC`, which is above this band; a test there
/// checks they agree).
pub(crate) const POOL_MAGIC: [u8; 8] = *b"FERRPOOL";

/// (what, byte offset, signature). Offsets within the first 68 KiB.
const SIGNATURES: &[(&str, u64, &[u8])] = &[
    ("a Ferrite pool", 0, &POOL_MAGIC),
    ("an XFS filesystem", 0, b"XFSB"),
    ("a LUKS encrypted volume", 0, b"LUKS\xba\xbe"),
    ("a squashfs filesystem", 0, b"hsqs"),
    ("a GPT partition table", 512, b"EFI PART"),
    ("an LVM physical volume", 536, b"LVM2 001"),
    ("an NTFS filesystem", 3, b"NTFS    "),
    ("an ext2/3/4 filesystem", 1080, &[0x53, 0xEF]),
    ("a swap area", 4086, b"SWAPSPACE2"),
    ("a btrfs filesystem", 65600, b"_BHRfS_M"),
];

/// Bytes read from the start of the store.
const PROBE_BYTES: usize = 68 << 10;

/// Whether `file` starts with a pool's superblock magic (a pool, or the start of one).
pub fn holds_pool(file: &File) -> io::Result<bool> {
    let mut magic = [0u8; 8];
    match file.read_exact_at(&mut magic, 0) {
        Ok(()) => Ok(magic == POOL_MAGIC),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// Describes what `file` holds, if anything recognisable: a filesystem, volume manager or pool
/// signature, or a DOS partition table (a boot signature with a partition entry). None for a
/// store that is all zeros or holds nothing known.
pub fn probe(file: &File) -> io::Result<Option<String>> {
    let mut buf = vec![0u8; PROBE_BYTES];
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let buf = &buf[..got];
    for &(what, at, sig) in SIGNATURES {
        let at = usize::try_from(at).expect("small");
        if buf.get(at..at + sig.len()) == Some(sig) {
            // ext's magic is two bytes: also ask for a plausible block size (log2 - 10 ≤ 6).
            if sig.len() == 2 && buf.get(1048..1052).is_none_or(|b| u32::from_le_bytes(b.try_into().unwrap()) > 6) {
                continue;
            }
            return Ok(Some(format!("{what} (signature at byte {at})")));
        }
    }
    if buf.get(510..512) == Some(&[0x55, 0xAA]) {
        // A DOS partition table: four 16-byte entries from 446; any non-empty one counts. A
        // FAT boot sector has the same boot signature.
        if buf.get(54..57) == Some(b"FAT") || buf.get(82..85) == Some(b"FAT") {
            return Ok(Some("a FAT filesystem (signature at byte 54)".into()));
        }
        if buf[446..510].iter().any(|&b| b != 0) {
            return Ok(Some("a DOS (MBR) partition table (boot signature at byte 510)".into()));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn with(bytes: &[(usize, &[u8])]) -> Option<String> {
        let mut f = tempfile::tempfile().unwrap();
        let mut img = vec![0u8; 1 << 20];
        for &(at, b) in bytes {
            img[at..at + b.len()].copy_from_slice(b);
        }
        f.write_all(&img).unwrap();
        probe(&f).unwrap()
    }

    #[test]
    fn recognises_what_format_must_not_overwrite() {
        assert_eq!(with(&[]), None);
        assert!(with(&[(0, b"FERRPOOL")]).unwrap().contains("Ferrite pool"));
        assert!(with(&[(1080, &[0x53, 0xEF]), (1048, &[2, 0, 0, 0])]).unwrap().contains("ext2/3/4"));
        assert_eq!(with(&[(1080, &[0x53, 0xEF]), (1048, &[200, 0, 0, 0])]), None, "not a plausible ext superblock");
        assert!(with(&[(512, b"EFI PART")]).unwrap().contains("GPT"));
        assert!(with(&[(510, &[0x55, 0xAA]), (446, &[0x80, 0, 1])]).unwrap().contains("MBR"));
        assert_eq!(with(&[(510, &[0x55, 0xAA])]), None, "a boot signature with no partition");
        assert!(with(&[(65600, b"_BHRfS_M")]).unwrap().contains("btrfs"));
        assert!(with(&[(0, b"XFSB")]).unwrap().contains("XFS"));
        assert!(with(&[(4086, b"SWAPSPACE2")]).unwrap().contains("swap"));
    }

    #[test]
    fn a_short_file_is_probed_as_far_as_it_goes() {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(b"XFSB").unwrap();
        assert!(probe(&f).unwrap().unwrap().contains("XFS"));
    }
}
