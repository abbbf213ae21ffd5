//! A real etcd server for tests (Debian's `etcd-server`): on free ports, its data in a
//! temporary folder, stopped (and the folder removed) when dropped; `stop` and `run` again
//! for an outage. Shared by kvxfer's etcd tests and the bench's.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvxfer::registry::{EtcdConfig, EtcdDiscovery};

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Etcd {
    child: Option<Child>,
    dir: PathBuf,
    client: u16,
    peer: u16,
}

impl Etcd {
    pub fn start() -> Option<Etcd> {
        if Command::new("etcd").arg("--version").output().is_err() {
            eprintln!("SKIP: no etcd binary (apt-get install etcd-server)");
            return None;
        }
        let dir =
            std::env::temp_dir().join(format!("kvx-etcd-{}-{}", std::process::id(), free_port()));
        let mut e = Etcd {
            child: None,
            dir,
            client: free_port(),
            peer: free_port(),
        };
        e.run();
        Some(e)
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client)
    }

    pub fn run(&mut self) {
        let peer = format!("http://127.0.0.1:{}", self.peer);
        let child = Command::new("etcd")
            .args(["--name", "kvx", "--data-dir"])
            .arg(&self.dir)
            .args([
                "--listen-client-urls",
                &self.url(),
                "--advertise-client-urls",
                &self.url(),
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("kvx={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let end = Instant::now() + Duration::from_secs(20);
        while EtcdDiscovery::connect(EtcdConfig::new(&[&self.url()], "/probe")).is_err() {
            assert!(
                Instant::now() < end,
                "etcd did not come up at {}",
                self.url()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
