//! The replica's side: applying a delta to a replica volume, all or nothing.
//!
//! Pieces are written into the replica volume's head; clients of a replica read its mirror
//! snapshots, never the head. [`Transfer::commit`] takes the mirror snapshot only once every
//! byte up to the delta's end has arrived, so the replica's newest mirror snapshot is always a
//! complete one. A transfer that is not resumed starts from the base again: the head is rolled
//! back to it first, so nothing of an abandoned delta can leak into the next snapshot.

use ferrite_engine::{Error, ErrorKind, Pool, Result, SnapshotInfo, Volume};

use crate::{BLOCK, Piece, block_crcs};

/// A delta being applied to a replica volume.
#[derive(Debug)]
pub struct Transfer {
    replica: String,
    to: String,
    /// One past the last byte the sender says the delta touches.
    end: u64,
    /// Every byte below this has been applied (the resume point).
    next: u64,
    vol: Volume,
}

impl Transfer {
    /// Starts receiving snapshot `to` (of a volume of `size` bytes; the delta touches bytes
    /// below `end`) over `base` into volume `replica`. `resume` is where an earlier transfer of
    /// the same `to` got to (as [`Transfer::durable`] reported and the caller kept); without it the
    /// replica is first returned to `base` (a first sync creates the replica volume and refuses
    /// an existing one: the caller deletes what an abandoned first sync of its own left).
    ///
    /// Refused: a writable volume, `base` not a snapshot of the replica (it needs a resync), a
    /// first sync into a replica that already holds snapshots, `to` already there, `end` past `size`, a size
    /// smaller than the replica's.
    ///
    /// `wrapped_keys`, for an encrypted source: its snapshot's wrapped data key first, then the
    /// older keys of its chain. The replica is made with the first and written with the
    /// ciphertext the pieces carry (it never needs the key); a later delta brings the source's
    /// current wrappings (a rekey there) or a new data key (a rotation there), which the
    /// replica's head takes (`Pool::follow_wrapped_keys`). Refused: a plaintext delta into an
    /// encrypted replica, and the other way round.
    #[allow(clippy::too_many_arguments)] // the push's begin message, field by field
    pub fn begin(
        pool: &Pool,
        replica: &str,
        base: Option<&str>,
        to: &str,
        size: u64,
        end: u64,
        resume: Option<u64>,
        wrapped_keys: Option<&[Vec<u8>]>,
    ) -> Result<Transfer> {
        let wrapped_key = wrapped_keys.and_then(<[_]>::split_first);
        if end > size || !size.is_multiple_of(BLOCK as u64) {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("delta for {to:?}: end {end} and size {size} must be whole blocks, the end inside the size"),
            ));
        }
        // A replica is read-only to its clients: a volume they may write is nobody's replica,
        // and no delta may roll it back, grow it or write into it.
        if pool.volume_info(replica).is_ok_and(|v| !v.read_only) {
            return Err(Error::new(
                ErrorKind::ReadOnly,
                format!(
                    "volume {replica:?} is writable here (a primary or an independent volume): no delta applies to it"
                ),
            ));
        }
        if pool.snapshot_info(to).is_ok() {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!("replica {replica:?} already holds snapshot {to:?}"),
            ));
        }
        let theirs = |s: &SnapshotInfo| s.volume.as_deref() == Some(replica);
        match base {
            Some(b) => {
                if !pool.snapshot_info(b).is_ok_and(|s| theirs(&s)) {
                    return Err(Error::new(
                        ErrorKind::NotFound,
                        format!("replica {replica:?} does not hold base snapshot {b:?}: it needs a resync"),
                    ));
                }
                if resume.is_none() {
                    pool.rollback_volume(replica, b)?;
                }
            }
            None => {
                let exists = pool.volume_info(replica).is_ok();
                if exists && !pool.snapshots(Some(replica))?.is_empty() {
                    return Err(Error::new(
                        ErrorKind::AlreadyExists,
                        format!("replica {replica:?} already holds mirror snapshots: a delta must name its base"),
                    ));
                }
                // A first sync never takes over a volume it did not create: only resuming one
                // continues into an existing volume.
                // Clients may read a replica's mirror snapshots, never write it.
                match (exists, resume) {
                    (false, _) => {
                        match wrapped_key {
                            Some((w, _)) => pool.create_volume_wrapped(replica, size, w)?,
                            None => pool.create_volume(replica, size)?,
                        };
                        pool.set_read_only(replica, true)?;
                    }
                    (true, Some(_)) => {}
                    (true, None) => {
                        return Err(Error::new(
                            ErrorKind::AlreadyExists,
                            format!("volume {replica:?} already exists: a first sync creates its replica volume"),
                        ));
                    }
                }
            }
        }
        let info = pool.volume_info(replica)?;
        match (wrapped_key, info.encryption.is_some()) {
            (Some((w, older)), true) => pool.follow_wrapped_keys(replica, w, older)?,
            (None, false) => {}
            (w, _) => {
                let (delta, here) = if w.is_some() { ("encrypted", "plaintext") } else { ("plaintext", "encrypted") };
                return Err(Error::new(
                    ErrorKind::InvalidArgument,
                    format!("delta for {to:?} is of an {delta} volume; replica {replica:?} is {here}"),
                ));
            }
        }
        let have = info.size;
        if have > size {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("delta for {to:?} is for a {size}-byte volume; replica {replica:?} is {have} bytes"),
            ));
        }
        if have < size {
            pool.grow_volume(replica, size)?;
        }
        Ok(Transfer {
            replica: replica.to_owned(),
            to: to.to_owned(),
            end,
            next: resume.unwrap_or(0).min(end),
            vol: pool.open_volume(replica)?.past_read_only().ciphertext(),
        })
    }

    /// Every byte below this has been applied (not yet durably).
    pub fn next(&self) -> u64 {
        self.next
    }

    /// Makes what was applied durable and returns where a resumed transfer may start: the
    /// value to keep for [`Transfer::begin`]'s `resume`.
    pub fn durable(&self) -> Result<u64> {
        self.vol.flush()?;
        Ok(self.next)
    }

    /// Applies one piece. Refused, with nothing written: a piece out of order (below
    /// [`Transfer::next`]) or past the delta's end, not on block boundaries, a data piece whose
    /// crcs do not match its blocks.
    pub fn apply(&mut self, piece: &Piece) -> Result<()> {
        let (offset, len) = piece.range();
        let b = BLOCK as u64;
        if offset < self.next || offset + len > self.end || offset % b != 0 || len % b != 0 || len == 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "delta for {:?}: piece [{offset}, +{len}) is out of order or not whole blocks (next {}, end {})",
                    self.to, self.next, self.end
                ),
            ));
        }
        match piece {
            Piece::Data { data, crcs, .. } => {
                let got = block_crcs(data);
                if got.len() != crcs.len() {
                    return Err(Error::new(
                        ErrorKind::Corrupt,
                        format!(
                            "delta for {:?}: piece at {offset} has {} crcs for {} blocks",
                            self.to,
                            crcs.len(),
                            got.len()
                        ),
                    ));
                }
                if let Some(i) = got.iter().zip(crcs).position(|(a, b)| a != b) {
                    return Err(Error::new(
                        ErrorKind::Corrupt,
                        format!("delta for {:?}: block at byte {} fails its crc32c", self.to, offset + i as u64 * b),
                    ));
                }
                self.vol.write(offset, data)?;
            }
            Piece::Zero { .. } => self.vol.write_zeroes(offset, len, false)?,
        }
        self.next = offset + len;
        Ok(())
    }

    /// Makes the applied pieces durable and takes mirror snapshot `to` on the replica. Refused
    /// (nothing taken) until the delta has arrived up to its end.
    pub fn commit(self, pool: &Pool) -> Result<SnapshotInfo> {
        if self.next < self.end {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!("delta for {:?} is incomplete: {} of {} bytes arrived", self.to, self.next, self.end),
            ));
        }
        // The snapshot syncs the store before the catalog records it: durable on return.
        pool.create_snapshot(&self.replica, &self.to)
    }
}
