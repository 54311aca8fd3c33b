//! One module per subcommand.

pub mod vectors;
