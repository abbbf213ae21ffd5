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
    /// With TLS: the server's certificate and key (PEM files) and the CA that signed them.
    tls: Option<(PathBuf, PathBuf, PathBuf)>,
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
            tls: None,
        };
        e.run();
        Some(e)
    }

    /// An etcd that serves clients over TLS only, with a certificate for 127.0.0.1 signed by a
    /// CA made here (`openssl`); `None` (SKIP said) without etcd or openssl.
    pub fn start_tls() -> Option<Etcd> {
        if Command::new("openssl").arg("version").output().is_err() {
            eprintln!("SKIP: no openssl binary");
            return None;
        }
        let mut e = Etcd::start()?;
        e.stop();
        let pki = e.dir.with_extension("pki");
        std::fs::create_dir_all(&pki).unwrap();
        let sh = format!(
            "set -e; cd {0}; \
             openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=kvx-test-ca \
               -keyout ca.key -out ca.pem 2>/dev/null; \
             openssl req -newkey rsa:2048 -nodes -subj /CN=127.0.0.1 -keyout server.key \
               -out server.csr 2>/dev/null; \
             printf 'subjectAltName=IP:127.0.0.1\\n' > san.ext; \
             openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
               -days 1 -extfile san.ext -out server.pem 2>/dev/null",
            pki.display()
        );
        let ok = Command::new("sh").args(["-c", &sh]).status().unwrap();
        assert!(ok.success(), "making the test certificates");
        e.tls = Some((
            pki.join("server.pem"),
            pki.join("server.key"),
            pki.join("ca.pem"),
        ));
        let _ = std::fs::remove_dir_all(&e.dir);
        e.run();
        Some(e)
    }

    /// The CA certificate of a TLS etcd.
    pub fn ca(&self) -> Option<PathBuf> {
        self.tls.as_ref().map(|t| t.2.clone())
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client)
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
            .args(self.tls.iter().flat_map(|(cert, key, _)| {
                [
                    "--cert-file".into(),
                    cert.clone().into_os_string(),
                    "--key-file".into(),
                    key.clone().into_os_string(),
                ]
            }))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let end = Instant::now() + Duration::from_secs(20);
        let mut probe = EtcdConfig::new(&[&self.url()], "/probe");
        probe.tls_ca = self.ca();
        while EtcdDiscovery::connect(probe.clone()).is_err() {
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
        let _ = std::fs::remove_dir_all(self.dir.with_extension("pki"));
    }
}
