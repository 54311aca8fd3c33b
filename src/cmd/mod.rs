//! One module per subcommand.

pub mod bench;
pub mod simulate;
pub mod vectors;
