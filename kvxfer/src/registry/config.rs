//! Where an agent is to be found, as configuration (plain data, in every build): what
//! [`join`](super::join) acts on, beside the agent's own configuration.
#![forbid(unsafe_code)]

use std::time::Duration;

use kvxfer_proto::error::{Error, Result};

/// A user of etcd's own authentication: a name and its password (the password never prints).
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdUser {
    /// The user's name.
    pub name: String,
    password: String,
}

impl EtcdUser {
    /// User `name` with `password`.
    pub fn new(name: &str, password: &str) -> EtcdUser {
        EtcdUser {
            name: name.to_string(),
            password: password.to_string(),
        }
    }

    /// The password.
    pub fn password(&self) -> &str {
        &self.password
    }

    /// `url` without a `user:password@` before its host, and that user: how a discovery URL
    /// or an endpoint carries etcd credentials.
    pub fn split_url(url: &str) -> (String, Option<EtcdUser>) {
        let (scheme, rest) = match url.split_once("://") {
            Some((s, r)) => (format!("{s}://"), r),
            None => (String::new(), url),
        };
        // Hosts hold no '@'; a password may.
        match rest.rsplit_once('@') {
            Some((info, hosts)) => {
                let (name, password) = info.split_once(':').unwrap_or((info, ""));
                (
                    format!("{scheme}{hosts}"),
                    Some(EtcdUser::new(name, password)),
                )
            }
            None => (url.to_string(), None),
        }
    }
}

impl std::fmt::Debug for EtcdUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdUser")
            .field("name", &self.name)
            .field("password", &"<redacted>")
            .finish()
    }
}

/// How an agent publishes itself and finds peers by name.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DiscoveryConfig {
    /// etcd (needs the `etcd` feature at [`join`](super::join)).
    Etcd {
        /// Endpoints, e.g. `http://10.0.0.5:2379`.
        endpoints: Vec<String>,
        /// Prefix of every key (one per deployment).
        namespace: String,
        /// Lease TTL: how long a dead agent's keys outlive it.
        ttl: Duration,
        /// etcd's own authentication (`etcd://user:password@host:port`), if it is on.
        user: Option<EtcdUser>,
        /// Over TLS (`etcds://host:port?ca=PATH`): the CA certificate (PEM) that signed
        /// etcd's server certificate.
        tls_ca: Option<std::path::PathBuf>,
    },
}

impl DiscoveryConfig {
    /// Parses a discovery URL: `etcd://[user:password@]host:2379[,host2:2379]` (plain HTTP to
    /// each endpoint; with a user, etcd's own authentication), or `etcds://...?ca=PATH` (TLS,
    /// etcd's certificate signed by the CA in the PEM file `PATH`), for the namespace
    /// `namespace`, leases of `ttl` (at least 1 s: etcd counts seconds).
    pub fn parse(url: &str, namespace: &str, ttl: Duration) -> Result<DiscoveryConfig> {
        let (url, tls_ca) = match url.split_once("?ca=") {
            Some((u, ca)) => (u, Some(std::path::PathBuf::from(ca))),
            None => (url, None),
        };
        let (shown, user) = EtcdUser::split_url(url);
        let (scheme, http) = if shown.starts_with("etcds://") {
            ("etcds://", "https://")
        } else {
            ("etcd://", "http://")
        };
        if (scheme == "etcds://") != tls_ca.is_some() {
            return Err(Error::InvalidArgument(format!(
                "discovery {shown:?}: TLS is etcds://host:port?ca=PATH (the CA's PEM file), both \
                 or neither"
            )));
        }
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "discovery {shown:?}: {why} (expected etcd://[user:password@]host:port[,host:port])"
            ))
        };
        if user.as_ref().is_some_and(|u| u.name.is_empty()) {
            return Err(bad("an empty user name"));
        }
        let rest = shown
            .strip_prefix(scheme)
            .ok_or_else(|| bad("unknown scheme"))?;
        let endpoints: Vec<String> = rest
            .trim_end_matches('/')
            .split(',')
            .map(str::trim)
            .map(|h| format!("{http}{h}"))
            .collect();
        if rest.trim().is_empty() || endpoints.iter().any(|e| e == http) {
            return Err(bad("no endpoint"));
        }
        if namespace.is_empty() || !namespace.starts_with('/') {
            return Err(Error::InvalidArgument(format!(
                "discovery namespace {namespace:?}: must start with '/'"
            )));
        }
        if ttl < Duration::from_secs(1) {
            return Err(Error::InvalidArgument(format!(
                "discovery TTL {ttl:?}: at least 1 s (etcd leases count seconds)"
            )));
        }
        Ok(DiscoveryConfig::Etcd {
            endpoints,
            namespace: namespace.to_string(),
            ttl,
            user,
            tls_ca,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn urls_parse_and_mistakes_are_refused() {
        let ttl = Duration::from_secs(10);
        assert_eq!(
            DiscoveryConfig::parse("etcd://a:2379, b:2379/", "/ns", ttl).unwrap(),
            DiscoveryConfig::Etcd {
                endpoints: vec!["http://a:2379".into(), "http://b:2379".into()],
                namespace: "/ns".into(),
                ttl,
                user: None,
                tls_ca: None,
            }
        );
        let DiscoveryConfig::Etcd {
            endpoints, tls_ca, ..
        } = DiscoveryConfig::parse("etcds://a:2379?ca=/etc/ca.pem", "/ns", ttl).unwrap();
        assert_eq!(endpoints, ["https://a:2379"]);
        assert_eq!(tls_ca.unwrap(), std::path::Path::new("/etc/ca.pem"));
        let d = DiscoveryConfig::parse("etcd://kvx:p@ss:w@a:2379,b:2379", "/ns", ttl).unwrap();
        let DiscoveryConfig::Etcd {
            endpoints, user, ..
        } = &d;
        assert_eq!(endpoints, &["http://a:2379", "http://b:2379"]);
        let u = user.as_ref().unwrap();
        assert_eq!((u.name.as_str(), u.password()), ("kvx", "p@ss:w"));
        let shown = format!("{d:?}");
        assert!(!shown.contains("p@ss"), "{shown}");
        for (url, ns, ttl, says) in [
            ("consul://a:1", "/ns", ttl, "unknown scheme"),
            ("etcd://", "/ns", ttl, "no endpoint"),
            ("etcd://a:1,", "/ns", ttl, "no endpoint"),
            ("etcd://:pw@a:1", "/ns", ttl, "an empty user name"),
            ("etcds://a:1", "/ns", ttl, "both or neither"),
            ("etcd://a:1?ca=/x", "/ns", ttl, "both or neither"),
            ("etcd://a:1", "ns", ttl, "must start with '/'"),
            (
                "etcd://a:1",
                "/ns",
                Duration::from_millis(500),
                "at least 1 s",
            ),
        ] {
            let e = DiscoveryConfig::parse(url, ns, ttl)
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{url} {ns}: {e}");
        }
    }
}
