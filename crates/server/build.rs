//! Compiles Envoy's rate-limit service protos into Rust.
//!
//! `protox` parses the `.proto` files in pure Rust, so building needs no
//! system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = protox::compile(["envoy/service/ratelimit/v3/rls.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // prost's codec with a small first answer buffer (see grpc::Codec).
        .codec_path("crate::grpc::Codec")
        .compile_fds(files)?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
