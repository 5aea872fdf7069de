//! Test support shared by the drop-in's integration tests, mounted by each as `mod support;`: the C test programs
//! built against the drop-in ([`programs`]), the function list of an `nccl.h` ([`header`]), and the two halves of
//! the acceleration tests over the fake runtimes ([`accel_common`]). Each test uses only part of it.
#![allow(dead_code)]

pub mod accel_common;
pub mod header;
pub mod programs;
