//! `vmnet`: the client commands, run here; every other command runs in `vmnetd` beside it
//! (see the `vmnet` library's docs).
//!
//! The process starts at C's `main`, without the Rust runtime's own start-up: an orchestrator
//! runs `vmnet` once per VM, and that start-up (reading `/proc/self/maps` to place a guard page
//! below the main thread's stack, for a "stack overflow" message instead of a plain `SIGSEGV`)
//! is a measurable part of a client command's time. Arguments, the environment and standard
//! output work as in any Rust program; a panic still prints its message and exits with 101.
// A test build keeps the test harness's own `main`.
#![cfg_attr(not(test), no_main)]

#[cfg(not(test))]
use std::ffi::{c_char, c_int};

#[cfg(not(test))]
// SAFETY: this is the program's only `main` symbol (the crate has `no_main`, so the standard
// library defines none); its signature is the one C's start-up code calls.
#[unsafe(no_mangle)]
extern "C" fn main(_argc: c_int, _argv: *const *const c_char) -> c_int {
    // `exit` flushes standard output, as returning from a Rust `main` does.
    let status = std::panic::catch_unwind(vmnet::thin::main).map_or(101, |s| s.0);
    std::process::exit(c_int::from(status))
}
