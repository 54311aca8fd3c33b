//! `ratewarden vectors`: runs vector files against a store.

use std::process::ExitCode;

/// Arguments of `ratewarden vectors`.
#[derive(clap::Args)]
pub struct Args {
    /// Vector files, or directories searched for `*.json` files.
    #[arg(required = true)]
    pub paths: Vec<std::path::PathBuf>,
}

/// Runs the command.
pub fn run(_args: Args) -> ExitCode {
    ExitCode::from(2)
}
