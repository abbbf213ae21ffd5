//! For tests that SIGSTOP a peer: waiting until it is stopped.

use std::time::{Duration, Instant};

/// Waits until every thread of process `pid` is stopped (a SIGSTOP takes each thread as it
/// next runs: until then one of them could still answer).
pub fn stopped(pid: i32) {
    let t0 = Instant::now();
    loop {
        let all = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
            .all(|st| {
                // The state follows the command name's closing parenthesis.
                st.rsplit_once(')').is_some_and(|(_, rest)| {
                    matches!(rest.trim_start().chars().next(), Some('T' | 't'))
                })
            });
        if all {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "process {pid} did not stop"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}
