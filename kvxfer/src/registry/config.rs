//! Where an agent is to be found, as configuration (plain data, in every build): what
//! [`join`](super::join) acts on, beside the agent's own configuration.
#![forbid(unsafe_code)]

use std::time::Duration;

use kvxfer_proto::error::{Error, Result};

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
    },
}

impl DiscoveryConfig {
    /// Parses a discovery URL: `etcd://host:2379[,host2:2379]` (plain HTTP to each endpoint),
    /// for the namespace `namespace`, leases of `ttl` (at least 1 s: etcd counts seconds).
    pub fn parse(url: &str, namespace: &str, ttl: Duration) -> Result<DiscoveryConfig> {
        let bad = |why: &str| {
            Error::InvalidArgument(format!(
                "discovery {url:?}: {why} (expected etcd://host:port[,host:port])"
            ))
        };
        let rest = url
            .strip_prefix("etcd://")
            .ok_or_else(|| bad("unknown scheme"))?;
        let endpoints: Vec<String> = rest
            .trim_end_matches('/')
            .split(',')
            .map(str::trim)
            .map(|h| format!("http://{h}"))
            .collect();
        if rest.trim().is_empty() || endpoints.iter().any(|e| e == "http://") {
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
                ttl
            }
        );
        for (url, ns, ttl, says) in [
            ("consul://a:1", "/ns", ttl, "unknown scheme"),
            ("etcd://", "/ns", ttl, "no endpoint"),
            ("etcd://a:1,", "/ns", ttl, "no endpoint"),
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
