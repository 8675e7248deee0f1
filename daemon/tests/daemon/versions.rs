//! Versions: the CLI and the daemon report theirs, the daemon's metrics carry them, and a client
//! whose version the skew rule does not allow is refused on every call with both versions named.

use crate::common;

use common::Daemon;
use ferrite_proto::ferrite::v1 as pb;
use ferrite_proto::ferrite::v1::admin_client::AdminClient;

/// An admin client on the daemon's socket that says it is `agent`.
async fn client_as(d: &Daemon, agent: &str) -> AdminClient<tonic::transport::Channel> {
    let path = d.admin();
    let channel = tonic::transport::Endpoint::from_static("http://ferrite.invalid")
        .user_agent(agent.to_owned())
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?))
            }
        }))
        .await
        .unwrap();
    AdminClient::new(channel)
}

#[test]
fn versions_are_reported_and_the_skew_rule_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start(dir.path());
    let out = d.ok(&["-o", "json", "version"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["cli"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["daemon"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["format_version"], ferrite_engine::format::FORMAT_VERSION);
    assert_eq!(v["upgraded_from"], 0, "a new pool is not upgraded");
    let table = d.ok(&["version"]);
    assert!(table.contains("pool format"), "{table}");

    let (major, minor) = {
        let mut p = env!("CARGO_PKG_VERSION").split('.').map(|x| x.parse::<u64>().unwrap());
        (p.next().unwrap(), p.next().unwrap())
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        // The next minor version is allowed (clients are upgraded first), as is a caller that
        // names no version.
        let next = format!("ferrite/{major}.{}.0", minor + 1);
        for agent in [next.as_str(), "grpcurl/1.9"] {
            let mut c = client_as(&d, agent).await;
            c.pool_status(pb::PoolStatusRequest {}).await.unwrap_or_else(|e| panic!("{agent}: {e}"));
        }
        // Two minors ahead, or a major apart: refused, both versions named.
        for (agent, why) in [
            (format!("ferrite/{major}.{}.0", minor + 2), "upgrade the daemon first"),
            (format!("ferrite/{}.{minor}.0", major + 1), "different major"),
        ] {
            let mut c = client_as(&d, &agent).await;
            let e = c.pool_status(pb::PoolStatusRequest {}).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{agent}: {e}");
            assert!(e.message().contains(why) && e.message().contains(env!("CARGO_PKG_VERSION")), "{e}");
        }
        if minor > 0 {
            let mut c = client_as(&d, &format!("ferrite/{major}.{}.0", minor - 1)).await;
            let e = c.version(pb::VersionRequest {}).await.unwrap_err();
            assert!(e.message().contains("older than daemon version"), "{e}");
        }
    });
    assert!(d.log().contains("refused"), "{}", d.log());
}
