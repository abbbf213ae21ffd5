//! The README's quick start, two-process example and connector example, run as a user runs
//! them: each must exit 0 and print what it did.

#![allow(clippy::unwrap_used)] // Tests fail loudly on purpose.

mod common;

use std::process::Command;

fn run(name: &str) -> String {
    let out = Command::new(common::example(name)).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{name}: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    print!("{stdout}");
    stdout
}

#[test]
fn quick_start_prints_what_it_moved() {
    let out = run("quickstart");
    assert!(
        out.contains("wrote 4096 bytes") && out.contains("\"kv bytes\""),
        "{out}"
    );
}

#[test]
fn two_processes_learn_the_peer_regions_and_verify() {
    let out = run("two_process");
    assert!(
        out.contains("has 1 region(s); region 0 holds 1048576 bytes"),
        "{out}"
    );
    assert!(out.contains("65536 bytes verified"), "{out}");
}

#[test]
fn the_connector_in_its_natural_order_moves_only_the_missing_blocks() {
    let out = run("connector");
    assert!(out.contains("7.3 MB moved, 3.7 MB skipped"), "{out}");
    assert!(
        out.contains("bytes verified") && out.contains("(Acked)"),
        "{out}"
    );
}
