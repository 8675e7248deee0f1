//! Generates Rust from the .proto files. protoc comes from the protoc-bin-vendored crate unless
//! PROTOC is set, so a fresh machine needs no system protobuf compiler.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        // SAFETY: build scripts are single-threaded; nothing else reads the environment now.
        unsafe { std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?) };
    }
    println!("cargo:rerun-if-changed=ferrite");
    tonic_prost_build::configure().compile_protos(&["ferrite/v1/admin.proto"], &["."])?;
    Ok(())
}
