//! Shared test support: the naive reference model and a seeded generator.

#![allow(dead_code)]

pub mod naive;
pub mod rng;
