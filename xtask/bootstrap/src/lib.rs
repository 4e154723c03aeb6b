//! The part of `cargo xtask` that must run before xtask can compile: xtask links the kvm provider, whose `virt-sys`
//! build script needs libvirt's development files, so on a fresh machine the Debian packages come first. This crate
//! has no dependency that needs a system library; its binary installs what compiling xtask needs and then runs
//! `cargo run --package xtask` with the same arguments (replacing itself, so signals reach xtask).
//!
//! xtask uses the same [`packages`] and [`process`] code for the packages its tests need.

pub mod packages;
pub mod process;
