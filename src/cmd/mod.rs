//! One module per subcommand.

pub mod serve;
pub mod vectors;
