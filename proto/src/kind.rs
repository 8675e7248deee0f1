//! Errors a client tells apart by kind, never by their text: the daemon tags a `Status` with a
//! stable kind in its metadata (`ferrite-error-kind`, sent with the status), and a client asks
//! whether a status carries it. A message may be reworded at any time; a kind may not.

use tonic::Status;
use tonic::metadata::MetadataValue;

const KEY: &str = "ferrite-error-kind";

/// The kinds of error a client acts upon.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The request names a backup target the daemon's config does not have.
    UnknownTarget,
}

impl Kind {
    /// Its name on the wire.
    fn name(self) -> &'static str {
        match self {
            Kind::UnknownTarget => "unknown-target",
        }
    }

    /// `s`, carrying this kind.
    pub fn tag(self, mut s: Status) -> Status {
        s.metadata_mut().insert(KEY, MetadataValue::from_static(self.name()));
        s
    }

    /// Whether `s` carries this kind.
    pub fn is(self, s: &Status) -> bool {
        s.metadata().get(KEY).is_some_and(|v| v.as_encoded_bytes() == self.name().as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::Kind;

    #[test]
    fn a_kind_survives_the_wire_and_no_message_makes_one() {
        let s = Kind::UnknownTarget.tag(tonic::Status::not_found("reworded at will"));
        let sent = s.into_http::<()>();
        let back = tonic::Status::from_header_map(sent.headers()).unwrap();
        assert!(Kind::UnknownTarget.is(&back));
        assert!(!Kind::UnknownTarget.is(&tonic::Status::not_found("no backup target \"x\"")));
    }
}
