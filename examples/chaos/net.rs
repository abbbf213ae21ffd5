//! Two network namespaces joined by a veth pair (names prefixed `kvx`, addresses in
//! 198.18.0.0/15), a worker in each; the link cut by taking both ends down (packets dropped,
//! connections kept, as a pulled cable or a failed switch port; this kernel has no netem)
//! and restored by bringing them up. Everything is removed on drop.

use std::process::{Command, Stdio};

/// The namespaces and their link.
pub struct Netns {
    /// The prefill worker's namespace, device and address.
    pub a: (String, String, &'static str),
    /// The decode worker's.
    pub b: (String, String, &'static str),
}

fn sh(args: &[&str]) -> bool {
    Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl Netns {
    /// Sets them up; `None` (with why on stderr) without root or iproute2.
    pub fn new() -> Option<Netns> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || !sh(&["ip", "-V"]) || !sh(&["tc", "-V"]) {
            eprintln!("chaos: --netns needs root and iproute2 (ip, tc)");
            return None;
        }
        let id = std::process::id() % 100_000;
        let n = Netns {
            a: (format!("kvxc{id}a"), format!("kvxc{id}x"), "198.18.64.1"),
            b: (format!("kvxc{id}b"), format!("kvxc{id}y"), "198.18.64.2"),
        };
        let (a, b) = (&n.a, &n.b);
        let ok = sh(&["ip", "netns", "add", &a.0])
            && sh(&["ip", "netns", "add", &b.0])
            && sh(&[
                "ip", "link", "add", &a.1, "netns", &a.0, "type", "veth", "peer", "name", &b.1,
                "netns", &b.0,
            ])
            && [a, b].iter().all(|s| {
                sh(&[
                    "ip",
                    "-n",
                    &s.0,
                    "addr",
                    "add",
                    &format!("{}/24", s.2),
                    "dev",
                    &s.1,
                ]) && sh(&["ip", "-n", &s.0, "link", "set", &s.1, "up"])
                    && sh(&["ip", "-n", &s.0, "link", "set", "lo", "up"])
            });
        if !ok {
            eprintln!("chaos: setting up namespaces {} / {} failed", a.0, b.0);
            return None;
        }
        if !n.wait_up() {
            eprintln!("chaos: the veth carrier did not come up");
            return None;
        }
        Some(n)
    }

    /// The command line that runs `exe` in namespace `ns`.
    pub fn exec(ns: &str, exe: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns, exe]);
        c
    }

    /// Waits until both ends carry traffic (the kernel reports a veth carrier up to a second
    /// after the link is set up; transports skip an interface that is not running yet).
    fn wait_up(&self) -> bool {
        let up = |s: &(String, String, &str)| {
            Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &s.0,
                    "cat",
                    &format!("/sys/class/net/{}/operstate", s.1),
                ])
                .output()
                .is_ok_and(|o| o.stdout.starts_with(b"up"))
        };
        let t = std::time::Instant::now();
        while !(up(&self.a) && up(&self.b)) {
            if t.elapsed().as_secs() >= 10 {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        true
    }

    /// Cuts (`true`) or restores the link, both ways; a restore returns once it carries.
    pub fn cut(&self, cut: bool) -> bool {
        let state = if cut { "down" } else { "up" };
        [&self.a, &self.b]
            .iter()
            .all(|s| sh(&["ip", "-n", &s.0, "link", "set", &s.1, state]))
            && (cut || self.wait_up())
    }

    /// Removes the namespaces (and the link with them); idempotent.
    pub fn remove(&self) {
        // Deleting a namespace deletes its end of the veth pair, and the pair with it.
        sh(&["ip", "netns", "del", &self.a.0]);
        sh(&["ip", "netns", "del", &self.b.0]);
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        self.remove();
    }
}
