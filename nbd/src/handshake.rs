//! Fixed newstyle negotiation: from the greeting to the start of transmission.
//!
//! Every option gets the reply the protocol specifies; malformed options get
//! `NBD_REP_ERR_INVALID`, unknown ones `NBD_REP_ERR_UNSUP`, unknown export names
//! `NBD_REP_ERR_UNKNOWN` (or, for `NBD_OPT_EXPORT_NAME`, which has no error reply, a
//! disconnect). Anything that breaks framing (bad magic, an absurd option length) ends the
//! connection; nothing in negotiation touches any export's data.
//!
//! TLS: `NBD_OPT_STARTTLS` upgrades the connection where the listener offers TLS, and resets
//! what was negotiated before it (structured replies, meta contexts: CVE-2021-3716). Where TLS
//! is required, every other option but ABORT gets `NBD_REP_ERR_TLS_REQD` until it is up.
//! Authorization: an export whose allow list does not admit the client (by address or by a
//! verified certificate identity) is, to that client, an export that does not exist: not listed,
//! `NBD_REP_ERR_UNKNOWN`.

use std::io;
use std::net::IpAddr;
use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::export::{Export, Exports};
use crate::proto::*;
use crate::tls::{Stream, Tls, TlsMode};

/// Longest option payload accepted (a name and a few queries need far less).
const MAX_OPTION_LEN: u32 = 64 << 10;
/// Longest string (export name, context query) the protocol allows.
const MAX_STRING: usize = 4096;
/// Largest request payload or read length served.
pub const MAX_REQUEST: u32 = 32 << 20;
/// Context id of `base:allocation` once selected.
pub const BASE_ALLOCATION_ID: u32 = 1;
const BASE_ALLOCATION: &str = "base:allocation";
/// Context id of `ferrite:changed:<snapshot>` once selected: which extents changed since that
/// snapshot (beneath the export's image), flag [`crate::proto::STATE_CHANGED`].
pub const CHANGED_ID: u32 = 2;
const CHANGED: &str = "ferrite:changed:";
/// Context id of `ferrite:allocation-depth` once selected: for each extent, which layer of the
/// image's chain holds it (0: none, 1: the image's own, 2: its parent, ...), as
/// `qemu:allocation-depth` reports a backing chain.
pub const DEPTH_ID: u32 = 3;
const DEPTH: &str = "ferrite:allocation-depth";

/// What negotiation agreed on.
#[derive(Debug)]
pub struct Session {
    pub export: Arc<Export>,
    pub structured: bool,
    pub base_allocation: bool,
    /// The snapshot `ferrite:changed:` reports against, if that context was selected.
    pub changed: Option<String>,
    pub depth: bool,
}

/// Metadata contexts selected so far, and for which export.
#[derive(Debug, Default)]
struct Contexts {
    base_allocation: bool,
    depth: bool,
    /// (export, snapshot) of a selected `ferrite:changed:` context.
    changed: Option<(String, String)>,
}

impl Contexts {
    /// The session on `export` (named `name`): a changed context selected for another export
    /// does not carry over.
    fn session(self, name: &str, export: Arc<Export>, structured: bool) -> Session {
        let changed = self.changed.filter(|(e, _)| e == name).map(|(_, snap)| snap);
        Session { export, structured, base_allocation: self.base_allocation, changed, depth: self.depth }
    }
}

/// Whether `ferrite:changed:<snapshot>` can be served on `export`: the snapshot lies beneath
/// its image.
fn changed_context_ok(export: &Export, snapshot: &str) -> bool {
    !snapshot.is_empty() && export.volume.changed(snapshot, 0, 1).is_ok()
}

/// Transmission flags of an export for this session.
pub fn transmission_flags(export: &Export, structured: bool) -> u16 {
    let mut f = TF_HAS_FLAGS | TF_SEND_FLUSH | TF_SEND_FUA | TF_CAN_MULTI_CONN | TF_SEND_CACHE;
    if export.is_read_only() {
        f |= TF_READ_ONLY;
    } else {
        f |= TF_SEND_TRIM | TF_SEND_WRITE_ZEROES | TF_SEND_FAST_ZERO;
    }
    if structured {
        f |= TF_SEND_DF;
    }
    f
}

/// The export size and transmission flags as sent by EXPORT_NAME and NBD_INFO_EXPORT.
fn size_and_flags(export: &Export, structured: bool) -> io::Result<Vec<u8>> {
    let mut v = export.volume.size().map_err(io::Error::other)?.to_be_bytes().to_vec();
    v.extend_from_slice(&transmission_flags(export, structured).to_be_bytes());
    Ok(v)
}

fn protocol_error(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

async fn reply<S: AsyncWrite + Unpin>(s: &mut S, option: u32, kind: u32, payload: &[u8]) -> io::Result<()> {
    s.write_all(&option_reply(option, kind, payload)).await
}

async fn reply_err<S: AsyncWrite + Unpin>(s: &mut S, option: u32, kind: u32, msg: &str) -> io::Result<()> {
    reply(s, option, kind, msg.as_bytes()).await
}

/// Who is negotiating: the client's address (None on a Unix socket) and its listener's TLS.
#[derive(Debug, Clone, Copy)]
pub struct Client<'a> {
    pub ip: Option<IpAddr>,
    pub tls: &'a Tls,
}

/// Runs negotiation. `Ok(None)` means the client ended it cleanly (abort, or an unknown name
/// with `NBD_OPT_EXPORT_NAME`).
pub async fn negotiate<S>(s: &mut Stream<S>, exports: &Exports, client: Client<'_>) -> io::Result<Option<Session>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    // The exports this client may see and open.
    let role = client.tls.role.as_ref();
    let permits = |s: &Stream<S>, e: &Export| e.permits(client.ip, s.peer_certificate(), role);
    let visible = |s: &Stream<S>, name: &str| exports.get(name).filter(|e| permits(s, e));
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&NBD_MAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    s.write_all(&greeting).await?;
    let client_flags = s.read_u32().await?;
    if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(protocol_error(format!("unknown client flags {client_flags:#x}")));
    }
    let no_zeroes = client_flags & FLAG_C_NO_ZEROES != 0;
    let mut structured = false;
    let mut contexts = Contexts::default();
    loop {
        let mut header = [0u8; OPTION_HEADER_LEN];
        s.read_exact(&mut header).await?;
        let (option, len) =
            decode_option_header(&header).map_err(|m| protocol_error(format!("bad option magic {m:#x}")))?;
        if len > MAX_OPTION_LEN {
            return Err(protocol_error(format!("option {option} payload of {len} bytes is too large")));
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data).await?;
        if client.tls.mode == TlsMode::Require && !s.is_tls() && !matches!(option, OPT_STARTTLS | OPT_ABORT) {
            if option == OPT_EXPORT_NAME {
                tracing::debug!("NBD_OPT_EXPORT_NAME before TLS on a listener that requires it; disconnecting");
                return Ok(None);
            }
            reply_err(s, option, REP_ERR_TLS_REQD, "this server requires TLS (NBD_OPT_STARTTLS) first").await?;
            continue;
        }
        match option {
            OPT_EXPORT_NAME => {
                let name = std::str::from_utf8(&data).unwrap_or_default().to_owned();
                let Some(export) = visible(s, &name) else {
                    tracing::debug!("NBD_OPT_EXPORT_NAME for an unknown export; disconnecting");
                    return Ok(None);
                };
                let mut out = size_and_flags(&export, structured)?;
                if !no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                s.write_all(&out).await?;
                return Ok(Some(contexts.session(&name, export, structured)));
            }
            OPT_ABORT => {
                let _ = reply(s, option, REP_ACK, &[]).await;
                return Ok(None);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    reply_err(s, option, REP_ERR_INVALID, "NBD_OPT_LIST takes no data").await?;
                    continue;
                }
                let listed: Vec<_> = exports.list().into_iter().filter(|e| permits(s, e)).collect();
                for e in listed {
                    let mut p = Vec::with_capacity(4 + e.name.len());
                    p.extend_from_slice(&u32::try_from(e.name.len()).unwrap_or(0).to_be_bytes());
                    p.extend_from_slice(e.name.as_bytes());
                    reply(s, option, REP_SERVER, &p).await?;
                }
                reply(s, option, REP_ACK, &[]).await?;
            }
            OPT_STARTTLS => {
                let acceptor = client.tls.acceptor.as_ref().filter(|_| client.tls.mode != TlsMode::Off);
                if !data.is_empty() {
                    reply_err(s, option, REP_ERR_INVALID, "NBD_OPT_STARTTLS takes no data").await?;
                } else if s.is_tls() {
                    reply_err(s, option, REP_ERR_INVALID, "TLS is already on").await?;
                } else if let Some(acceptor) = acceptor {
                    reply(s, option, REP_ACK, &[]).await?;
                    s.start_tls(acceptor).await?;
                    // Nothing negotiated in plaintext carries over into TLS.
                    (structured, contexts) = (false, Contexts::default());
                } else {
                    reply_err(s, option, REP_ERR_POLICY, "TLS is not configured on this listener").await?;
                }
            }
            OPT_INFO | OPT_GO => {
                let Some((name, infos)) = parse_info(&data) else {
                    reply_err(s, option, REP_ERR_INVALID, "malformed NBD_OPT_INFO/GO request").await?;
                    continue;
                };
                let Some(export) = visible(s, name) else {
                    reply_err(s, option, REP_ERR_UNKNOWN, &format!("no export named {name:?}")).await?;
                    continue;
                };
                send_info(s, option, &export, &infos, structured).await?;
                reply(s, option, REP_ACK, &[]).await?;
                if option == OPT_GO {
                    return Ok(Some(contexts.session(name, export, structured)));
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    reply_err(s, option, REP_ERR_INVALID, "NBD_OPT_STRUCTURED_REPLY takes no data").await?;
                    continue;
                }
                structured = true;
                reply(s, option, REP_ACK, &[]).await?;
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                let set = option == OPT_SET_META_CONTEXT;
                if set && !structured {
                    reply_err(s, option, REP_ERR_INVALID, "negotiate structured replies first").await?;
                    continue;
                }
                let Some((name, queries)) = parse_meta(&data) else {
                    reply_err(s, option, REP_ERR_INVALID, "malformed meta context request").await?;
                    continue;
                };
                let Some(export) = visible(s, name) else {
                    reply_err(s, option, REP_ERR_UNKNOWN, &format!("no export named {name:?}")).await?;
                    continue;
                };
                let wanted = if queries.is_empty() {
                    !set
                } else {
                    queries.iter().any(|q| *q == BASE_ALLOCATION || (!set && (*q == "base:" || q.is_empty())))
                };
                let depth = if queries.is_empty() {
                    !set
                } else {
                    queries.iter().any(|q| *q == DEPTH || (!set && (*q == "ferrite:" || q.is_empty())))
                };
                // Changed extents against a snapshot: asked for by its full name (one context per
                // snapshot beneath the export, so they are not listed).
                let changed = queries
                    .iter()
                    .filter_map(|q| q.strip_prefix(CHANGED))
                    .find(|snap| changed_context_ok(&export, snap))
                    .map(str::to_owned);
                if set {
                    contexts = Contexts {
                        base_allocation: wanted,
                        depth,
                        changed: changed.clone().map(|snap| (name.to_owned(), snap)),
                    };
                }
                if wanted {
                    let mut p = BASE_ALLOCATION_ID.to_be_bytes().to_vec();
                    p.extend_from_slice(BASE_ALLOCATION.as_bytes());
                    reply(s, option, REP_META_CONTEXT, &p).await?;
                }
                if depth {
                    let mut p = DEPTH_ID.to_be_bytes().to_vec();
                    p.extend_from_slice(DEPTH.as_bytes());
                    reply(s, option, REP_META_CONTEXT, &p).await?;
                }
                if let Some(snap) = changed {
                    let mut p = CHANGED_ID.to_be_bytes().to_vec();
                    p.extend_from_slice(format!("{CHANGED}{snap}").as_bytes());
                    reply(s, option, REP_META_CONTEXT, &p).await?;
                }
                reply(s, option, REP_ACK, &[]).await?;
            }
            _ => reply_err(s, option, REP_ERR_UNSUP, "option not supported").await?,
        }
    }
}

fn parse_info(data: &[u8]) -> Option<(&str, Vec<u16>)> {
    let mut c = Cursor::new(data);
    let name = c.string(MAX_STRING)?;
    let n = c.u16()?;
    let infos = (0..n).map(|_| c.u16()).collect::<Option<Vec<_>>>()?;
    c.is_empty().then_some((name, infos))
}

fn parse_meta(data: &[u8]) -> Option<(&str, Vec<&str>)> {
    let mut c = Cursor::new(data);
    let name = c.string(MAX_STRING)?;
    let n = c.u32()?;
    if n > 256 {
        return None;
    }
    let queries = (0..n).map(|_| c.string(MAX_STRING)).collect::<Option<Vec<_>>>()?;
    c.is_empty().then_some((name, queries))
}

async fn send_info<S: AsyncWrite + Unpin>(
    s: &mut S,
    option: u32,
    export: &Export,
    infos: &[u16],
    structured: bool,
) -> io::Result<()> {
    let mut p = INFO_EXPORT.to_be_bytes().to_vec();
    p.extend(size_and_flags(export, structured)?);
    reply(s, option, REP_INFO, &p).await?;
    // Block sizes are always sent: any byte alignment works (sub-block writes are
    // read-modify-write), 4 KiB is what the engine prefers.
    let mut p = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    for v in [1u32, 4096, MAX_REQUEST] {
        p.extend_from_slice(&v.to_be_bytes());
    }
    reply(s, option, REP_INFO, &p).await?;
    if infos.contains(&INFO_NAME) {
        let mut p = INFO_NAME.to_be_bytes().to_vec();
        p.extend_from_slice(export.name.as_bytes());
        reply(s, option, REP_INFO, &p).await?;
    }
    if infos.contains(&INFO_DESCRIPTION) && !export.description.is_empty() {
        let mut p = INFO_DESCRIPTION.to_be_bytes().to_vec();
        p.extend_from_slice(export.description.as_bytes());
        reply(s, option, REP_INFO, &p).await?;
    }
    Ok(())
}
