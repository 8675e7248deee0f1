//! Encrypted volumes through `ferrite csi` over its real gRPC sockets: the StorageClass
//! parameter and the key in the request's secrets, every wrong field refused, ControllerPublish
//! opening the volume with the secrets' key, and the CSI-Addons EncryptionKeyRotation service
//! (a new key-encryption key, and the data key replaced as an EncryptionKeyRotationJob asks).

use crate::common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::Daemon;
use common::csi::{channel, code, create, start_csi};
use ferrite_proto::csi::v1 as csi;
use ferrite_proto::csi_addons::encryptionkeyrotation as ekr;
use ferrite_proto::csi_addons::identity;
use tonic::Code;

const KEY_A: &str = "a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1a1";
const KEY_B: &str = "b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2b2";

fn secrets(key: &str) -> HashMap<String, String> {
    HashMap::from([("encryptionKey".into(), key.into()), ("encryptionKeyID".into(), "team-a".into())])
}

fn encrypted(name: &str, key: Option<&str>) -> csi::CreateVolumeRequest {
    let mut r = create(name, 16 << 20, Some("node-a"));
    r.parameters.insert("encrypted".into(), "true".into());
    r.secrets = key.map(secrets).unwrap_or_default();
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_volumes_and_key_rotation_through_csi() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("a")).unwrap();
    let a = Daemon::start(&dir.path().join("a"));
    let addons_sock = dir.path().join("addons.sock");
    let _csi = start_csi(
        dir.path(),
        &[("node-a", &a)],
        &["--mode", "controller", "--addons-endpoint", &addons_sock.display().to_string()],
    );
    let mut ctl = csi::controller_client::ControllerClient::new(channel(&dir.path().join("csi.sock")).await);
    let addons = channel(&addons_sock).await;

    // Bad requests: no key, a key that is not 64 hex digits, a bad parameter value.
    assert_eq!(code(ctl.create_volume(encrypted("e0", None)).await), Code::InvalidArgument);
    assert_eq!(code(ctl.create_volume(encrypted("e0", Some("abc"))).await), Code::InvalidArgument);
    let mut bad = encrypted("e0", Some(KEY_A));
    bad.parameters.insert("encrypted".into(), "yes".into());
    assert_eq!(code(ctl.create_volume(bad).await), Code::InvalidArgument);
    assert!(a.ok(&["volume", "list"]).lines().count() == 1, "a refused request made a volume");

    let v = ctl.create_volume(encrypted("e1", Some(KEY_A))).await.unwrap().into_inner().volume.unwrap();
    let name = v.volume_id.split_once('/').map_or(v.volume_id.as_str(), |(_, n)| n).to_owned();
    let show = a.json(&["volume", "show", &name]);
    assert_eq!(
        (&show["encryption"]["key_id"], &show["encryption"]["provider"]),
        (&"team-a".into(), &"request".into()),
        "{show}"
    );
    // The daemon stores only the wrapped key: nothing in its key directory.
    assert!(!a.dir.join("keys").exists());

    // The identity says the service is there.
    let mut ident = identity::identity_client::IdentityClient::new(addons.clone());
    let caps = ident.get_capabilities(identity::GetCapabilitiesRequest {}).await.unwrap().into_inner().capabilities;
    assert!(caps.iter().any(|c| matches!(c.r#type, Some(identity::capability::Type::EncryptionKeyRotation(_)))));

    let mut rot = ekr::encryption_key_rotation_controller_client::EncryptionKeyRotationControllerClient::new(addons);
    let rotate = |key: Option<&str>, new: &str| ekr::EncryptionKeyRotateRequest {
        volume_id: v.volume_id.clone(),
        encryption_key: new.into(),
        secrets: key.map(secrets).unwrap_or_default(),
        ..Default::default()
    };
    assert_eq!(
        code(rot.encryption_key_rotate(ekr::EncryptionKeyRotateRequest::default()).await),
        Code::InvalidArgument
    );
    assert_eq!(code(rot.encryption_key_rotate(rotate(None, KEY_B)).await), Code::InvalidArgument);
    let mut unknown = rotate(Some(KEY_A), KEY_B);
    unknown.volume_id = "node-a/nope".into();
    assert_eq!(code(rot.encryption_key_rotate(unknown).await), Code::NotFound);
    // The wrong current key: refused, nothing changed.
    assert_eq!(code(rot.encryption_key_rotate(rotate(Some(KEY_B), KEY_A)).await), Code::Unauthenticated);

    // A new key-encryption key: rewrapped; the repeat (the Secret already updated) succeeds.
    let mut with_id = rotate(Some(KEY_A), KEY_B);
    with_id.parameters.insert("encryptionKeyID".into(), "team-a-2".into());
    rot.encryption_key_rotate(with_id.clone()).await.unwrap();
    assert_eq!(a.json(&["volume", "show", &name])["encryption"]["key_id"], "team-a-2");
    with_id.secrets = secrets(KEY_B);
    rot.encryption_key_rotate(with_id).await.unwrap();

    // ControllerPublish opens it with the secrets' key (the old one no longer does).
    let publish = |key: &str| csi::ControllerPublishVolumeRequest {
        volume_id: v.volume_id.clone(),
        node_id: "node-a".into(),
        volume_capability: Some(common::csi::mount_cap(csi::volume_capability::access_mode::Mode::SingleNodeWriter)),
        secrets: secrets(key),
        ..Default::default()
    };
    let mut daemon = a;
    assert!(daemon.stop().success());
    let a = Daemon::start(&dir.path().join("a"));
    assert_eq!(a.json(&["volume", "show", &name])["encryption"]["unlocked"], false);
    assert_eq!(code(ctl.controller_publish_volume(publish(KEY_A)).await), Code::FailedPrecondition);
    ctl.controller_publish_volume(publish(KEY_B)).await.unwrap();
    assert_eq!(a.json(&["volume", "show", &name])["encryption"]["unlocked"], true);

    // What an EncryptionKeyRotationJob sends (no new key): the data key is replaced.
    let data = common::pattern(5, 3 << 20);
    assert_eq!(common::nbd::write_on(&mut common::nbd::open(&a, &name), 1 << 20, &data), 0);
    let before = common::nbd::read_image(&a, &name, 16 << 20);
    assert_eq!(&before[1 << 20..4 << 20], &data[..]);
    rot.encryption_key_rotate(rotate(Some(KEY_B), "")).await.unwrap();
    let start = Instant::now();
    while !a.json(&["volume", "show", &name])["encryption"]["rotation"].is_null() {
        assert!(start.elapsed() < Duration::from_secs(60), "{}", a.ok(&["volume", "show", &name]));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(common::nbd::read_image(&a, &name, 16 << 20), before);
    assert!(!a.ok(&["volume", "show", &name]).contains("rotation"));
}
