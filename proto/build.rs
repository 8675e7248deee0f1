//! Generates Rust from the .proto files. protoc comes from the protoc-bin-vendored crate unless
//! PROTOC is set, so a fresh machine needs no system protobuf compiler.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded; nothing else reads the environment now.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    for dir in ["ferrite", "csi", "csi-addons", "snapshot-metadata"] {
        println!("cargo:rerun-if-changed={dir}");
    }
    // A mirrored write's data is sent to every member: `Bytes` shares one copy among them. A
    // node plugin serving only its node's attachments (no daemon there) implements a few admin
    // RPCs: the others answer UNIMPLEMENTED (default stubs).
    tonic_prost_build::configure().bytes(".ferrite.v1.MirrorWrite.data").generate_default_stubs(true).compile_protos(
        &["ferrite/v1/admin.proto", "ferrite/v1/replica.proto", "ferrite/v1/mirror.proto", "ferrite/v1/backup.proto"],
        &["."],
    )?;
    // CSI, CSI-Addons and the snapshot-metadata sidecar's API: servers for `ferrite csi`,
    // clients for its tests. The well-known types
    // (descriptor, timestamp, wrappers) come with the vendored protoc.
    // RPCs a plugin does not advertise answer UNIMPLEMENTED (default stubs), as the spec expects.
    let wkt = protoc_bin_vendored::include_path()?;
    tonic_prost_build::configure().generate_default_stubs(true).compile_protos(
        &[
            "csi/v1/csi.proto",
            "csi-addons/identity.proto",
            "csi-addons/reclaimspace.proto",
            "csi-addons/fence.proto",
            "csi-addons/volumegroup.proto",
            "csi-addons/replication.proto",
            "csi-addons/encryptionkeyrotation.proto",
            "snapshot-metadata/schema.proto",
        ],
        &[".", wkt.to_str().ok_or("protoc include path is not UTF-8")?],
    )?;
    Ok(())
}
