//! A StorageClass's parameters of ours, in one place: parsed once from a request into a
//! [`Class`] (strictly: a bad value or a key we do not know is refused), kept in a replicated
//! volume's context by CreateVolume ([`Class::context`]) and read back from its PV by the
//! failover loop ([`Class::from_context`]). A new parameter is a field here.

use std::collections::HashMap;
use std::time::Duration;

use tonic::Status;

/// How many copies (1, the default, is a local volume).
pub const REPLICAS: &str = "replicas";
/// How long a copy may be unreachable (or its node gone) before another node gets a copy in its
/// place: seconds, or with an `s`, `m` or `h` suffix; `0` never.
pub const REPLACE_AFTER: &str = "replace-after";
/// `"true"` makes a volume accessible from every node (a node without a copy reaches the primary
/// through its relay), so pods are not bound to the copies' nodes; `"false"` (the default) keeps
/// them there, next to their data.
pub const REMOTE_ACCESS: &str = "remoteAccess";
/// `required` or `preferred` (unset: copies by free space alone). A node without a zone label
/// counts as one zone, "".
pub const ZONE_SPREAD: &str = "zoneSpread";
/// `"true"` asks for an encrypted volume (`encryption.rs`: the key comes in the secrets).
pub const ENCRYPTED: &str = "encrypted";
/// Most copies a class may ask for.
const MOST: usize = 3;
/// Without `replace-after`: ten minutes, Longhorn's default (600 s) for the same decision. A
/// reboot, a kernel update or a daemon upgrade is back well within it, so its data is rebuilt
/// from what changed instead of copied whole; a node in maintenance waits longer still
/// (`failover/maintenance.rs`).
pub const DEFAULT_REPLACE_AFTER: Duration = Duration::from_secs(10 * 60);

/// Where a replicated volume's copies go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spread {
    /// By free space alone.
    Any,
    /// Each copy in a zone no other copy uses, where there is one.
    Preferred,
    /// Each copy in a zone of its own, or the volume is refused.
    Required,
}

impl Spread {
    /// The parameter's value ("" for the default).
    fn as_param(self) -> &'static str {
        match self {
            Spread::Any => "",
            Spread::Preferred => "preferred",
            Spread::Required => "required",
        }
    }
}

/// What a class asks of its volumes.
#[derive(Clone, Debug, PartialEq)]
pub struct Class {
    pub replicas: usize,
    /// None: a lost copy is never replaced.
    pub replace_after: Option<Duration>,
    pub remote_access: bool,
    pub zone_spread: Spread,
    pub encrypted: bool,
}

impl Class {
    /// The class `params` describe. Besides ours, only the metadata Kubernetes adds is taken:
    /// `csi.storage.k8s.io/*` (the PVC or VolumeSnapshot name with `--extra-create-metadata`) and
    /// `storage.kubernetes.io/*` (the provisioner's identity in a PV's attributes, which
    /// CSI-Addons passes on as parameters); any other key is refused rather than ignored.
    pub fn parse(params: &HashMap<String, String>) -> Result<Self, Status> {
        let class = Self {
            replicas: replicas(params)?,
            replace_after: replace_after(params)?,
            remote_access: flag(params, REMOTE_ACCESS)?,
            zone_spread: zone_spread(params)?,
            encrypted: flag(params, ENCRYPTED)?,
        };
        let ours = [REPLICAS, REPLACE_AFTER, REMOTE_ACCESS, ZONE_SPREAD, ENCRYPTED];
        let unknown = |k: &&String| {
            !k.starts_with("csi.storage.k8s.io/")
                && !k.starts_with("storage.kubernetes.io/")
                && !ours.contains(&k.as_str())
        };
        match params.keys().find(unknown) {
            Some(k) => Err(Status::invalid_argument(format!("unknown parameter {k:?}"))),
            None => Ok(class),
        }
    }

    /// What a replicated volume's context keeps of its class, for the failover loop: how many
    /// copies, when a lost one is replaced (seconds, 0 never), where copies go.
    pub fn context(&self) -> [(&'static str, String); 3] {
        [
            (REPLICAS, self.replicas.to_string()),
            (REPLACE_AFTER, self.replace_after.map_or(0, |d| d.as_secs()).to_string()),
            (ZONE_SPREAD, self.zone_spread.as_param().to_owned()),
        ]
    }

    /// The class a PV's attributes (a volume's context) keep, leniently: what the failover loop
    /// needs of a volume made by any release. None if the copies cannot be told. PVs made before
    /// the class was kept in the context: the copies they got (`copies`), the default delay.
    pub fn from_context(attrs: &HashMap<String, String>) -> Option<Self> {
        let replicas = match attrs.get(REPLICAS) {
            Some(n) => n.parse().ok()?,
            None => attrs.get("copies")?.split(',').count(),
        };
        let replace_after = match attrs.get(REPLACE_AFTER) {
            Some(s) => s.parse::<u64>().ok().filter(|s| *s > 0).map(Duration::from_secs),
            None => Some(DEFAULT_REPLACE_AFTER),
        };
        let zone_spread = zone_spread(attrs).unwrap_or(Spread::Any);
        Some(Self { replicas, replace_after, remote_access: false, zone_spread, encrypted: false })
    }
}

/// A boolean parameter `key` of `params`: `"true"` or `"false"`, false when unset.
fn flag(params: &HashMap<String, String>, key: &str) -> Result<bool, Status> {
    match params.get(key).map(String::as_str) {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(v) => Err(Status::invalid_argument(format!("parameter {key:?} is \"true\" or \"false\", not {v:?}"))),
    }
}

fn replicas(params: &HashMap<String, String>) -> Result<usize, Status> {
    match params.get(REPLICAS).map(String::as_str) {
        None => Ok(1),
        Some(v) => match v.parse::<usize>() {
            Ok(n @ 1..=MOST) => Ok(n),
            _ => Err(Status::invalid_argument(format!("parameter {REPLICAS} must be 1 to {MOST}, not {v:?}"))),
        },
    }
}

fn replace_after(params: &HashMap<String, String>) -> Result<Option<Duration>, Status> {
    let Some(v) = params.get(REPLACE_AFTER) else { return Ok(Some(DEFAULT_REPLACE_AFTER)) };
    let bad = || {
        Status::invalid_argument(format!(
            "parameter {REPLACE_AFTER} must be a duration such as \"300\", \"90s\", \"5m\" or \"1h\" (\"0\": never), not {v:?}"
        ))
    };
    let d = parse_duration(v).ok_or_else(bad)?;
    Ok(Some(d).filter(|d| !d.is_zero()))
}

fn zone_spread(params: &HashMap<String, String>) -> Result<Spread, Status> {
    match params.get(ZONE_SPREAD).map(String::as_str) {
        None => Ok(Spread::Any),
        Some("preferred") => Ok(Spread::Preferred),
        Some("required") => Ok(Spread::Required),
        Some(v) => Err(Status::invalid_argument(format!(
            "parameter {ZONE_SPREAD} must be \"required\" or \"preferred\", not {v:?}"
        ))),
    }
}

/// A duration as "300", "90s", "5m" or "1h"; None if it is none.
pub fn parse_duration(v: &str) -> Option<Duration> {
    let (digits, unit) = match v.strip_suffix(['s', 'm', 'h']) {
        Some(d) => (d, &v[d.len()..]),
        None => (v, "s"),
    };
    let n: u64 = digits.parse().ok()?;
    let secs = n.checked_mul(match unit {
        "h" => 3600,
        "m" => 60,
        _ => 1,
    })?;
    Some(Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn with(key: &str, v: &str) -> HashMap<String, String> {
        map(&[(key, v)])
    }

    #[test]
    fn replicas_parameter() {
        assert_eq!(replicas(&HashMap::new()).unwrap(), 1);
        assert_eq!(replicas(&with(REPLICAS, "3")).unwrap(), 3);
        for bad in ["0", "4", "two", "-1", ""] {
            assert_eq!(replicas(&with(REPLICAS, bad)).unwrap_err().code(), Code::InvalidArgument, "{bad}");
        }
    }

    #[test]
    fn zone_spread_parameter() {
        assert_eq!(zone_spread(&with(ZONE_SPREAD, "required")).unwrap(), Spread::Required);
        assert_eq!(zone_spread(&with(ZONE_SPREAD, "sometimes")).unwrap_err().code(), Code::InvalidArgument);
    }

    #[test]
    fn flag_parameters() {
        let p = |v: &str| flag(&with(REMOTE_ACCESS, v), REMOTE_ACCESS);
        assert!(!flag(&HashMap::new(), REMOTE_ACCESS).unwrap());
        assert!(p("true").unwrap());
        assert!(!p("false").unwrap());
        for bad in ["", "yes", "True", "1"] {
            assert_eq!(p(bad).unwrap_err().code(), Code::InvalidArgument, "{bad}");
        }
    }

    #[test]
    fn replace_after_parameter() {
        let p = |v: &str| replace_after(&with(REPLACE_AFTER, v));
        assert_eq!(replace_after(&HashMap::new()).unwrap(), Some(DEFAULT_REPLACE_AFTER));
        assert_eq!(p("0").unwrap(), None);
        assert_eq!(p("0m").unwrap(), None);
        assert_eq!(p("90").unwrap(), Some(Duration::from_secs(90)));
        assert_eq!(p("90s").unwrap(), Some(Duration::from_secs(90)));
        assert_eq!(p("5m").unwrap(), Some(Duration::from_secs(300)));
        assert_eq!(p("2h").unwrap(), Some(Duration::from_secs(7200)));
        for bad in ["", "m", "-5m", "5d", "1.5m", "five", " 5m", "99999999999999999999h"] {
            assert_eq!(p(bad).unwrap_err().code(), Code::InvalidArgument, "{bad}");
        }
    }

    #[test]
    fn a_class_parses_once_and_refuses_what_is_not_ours() {
        let params = map(&[
            ("replicas", "3"),
            ("zoneSpread", "preferred"),
            ("csi.storage.k8s.io/pvc/name", "x"),
            ("encrypted", "true"),
        ]);
        let c = Class::parse(&params).unwrap();
        assert_eq!((c.replicas, c.zone_spread, c.encrypted, c.remote_access), (3, Spread::Preferred, true, false));
        assert_eq!(Class::parse(&with("color", "blue")).unwrap_err().code(), Code::InvalidArgument);
        assert_eq!(Class::parse(&with(REPLICAS, "9")).unwrap_err().code(), Code::InvalidArgument);
    }

    #[test]
    fn the_context_keeps_what_failover_reads_back() {
        let mut c =
            Class::parse(&map(&[("replicas", "2"), ("replace-after", "5m"), ("zoneSpread", "required")])).unwrap();
        let attrs: HashMap<String, String> = c.context().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        assert_eq!(Class::from_context(&attrs), Some(c.clone()));
        c.replace_after = None;
        let attrs: HashMap<String, String> = c.context().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        assert_eq!(attrs[REPLACE_AFTER], "0");
        assert_eq!(Class::from_context(&attrs).unwrap().replace_after, None);
        // A PV of a release that kept only the copies.
        let old = Class::from_context(&with("copies", "a,b,c")).unwrap();
        assert_eq!((old.replicas, old.replace_after, old.zone_spread), (3, Some(DEFAULT_REPLACE_AFTER), Spread::Any));
        assert_eq!(Class::from_context(&HashMap::new()), None);
    }
}
