//! UCX's section of an agent's configuration, owned by the backend that reads it: the
//! devices, the progress mode, peer-failure detection, the opt-in to UCX's own TCP transport,
//! and the `UCX_*` settings kvxfer derives from them.
#![forbid(unsafe_code)]

use kvxfer_proto::types::Transport;

/// UCX's settings. Which transports were asked for belongs to the agent as a whole; the
/// methods take it.
#[derive(Clone, Debug, Default)]
pub(crate) struct UcxConfig {
    /// `UCX_NET_DEVICES`; `None` leaves UCX's default.
    pub(crate) net_devices: Option<String>,
    /// Spin on `ucp_worker_progress` instead of sleeping on the worker's event fd.
    pub(crate) busy_poll: bool,
    /// Split operations longer than this (0: never).
    pub(crate) max_op_bytes: u64,
    /// A user's own settings (names without `UCX_`), applied last.
    pub(crate) extra: Vec<(String, String)>,
    /// Peer-failure detection forced on or off; `None`: [`UcxConfig::peer_failure`] decides.
    pub(crate) peer_failure: Option<bool>,
    /// UCX's own TCP transport opted in (trusted peers and network only).
    pub(crate) tcp: bool,
    /// WRITEs over UCX's shared memory opted in where UCX emulates them
    /// ([`shm_writes_emulated`]; trusted writers only).
    pub(crate) emulated_shm: bool,
}

/// The oldest UCX measured to move a WRITE into a same-host peer's user memory without
/// active messages through that peer's receive FIFO (1.22: CMA zero-copy).
const DIRECT_SHM_WRITES: (u32, u32) = (1, 22);

/// Whether UCX `version` ("1.13.1") moves a WRITE into a same-host peer's memory by software
/// emulation: active messages through the target's shared-memory receive FIFO, which every
/// same-host sender shares. A sender killed between reserving a slot and marking it written
/// leaves a slot the target waits on for good, and the target serves no UCX shared-memory
/// peer again (`tests/peer_death.rs`). Measured on 1.13 (`UCX_PROTO_INFO=y`: "software
/// emulation | sysv/memory", protocols v1 and v2 alike) and 1.22 ("zero-copy | cma/memory");
/// versions between are taken as 1.13 (not measured), an unparsable one too.
pub(crate) fn shm_writes_emulated(version: &str) -> bool {
    let mut parts = version.split('.').map(|p| p.trim().parse::<u32>());
    match (parts.next(), parts.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => (major, minor) < DIRECT_SHM_WRITES,
        _ => true,
    }
}

/// Whether UCX may use a transport with a shared-memory receive FIFO (`posix`, `sysv`; `sm`,
/// `shm` and `all` name them too) with `asked`, as given: UCX's TCP opt-in changes nothing
/// here. CMA alone has no FIFO (it carries no active messages).
pub(crate) fn may_use_shm_fifo(asked: &Transport) -> bool {
    const FIFO: [&str; 5] = ["sm", "shm", "posix", "sysv", "all"];
    match asked {
        Transport::Tcp => false,
        Transport::Shm | Transport::Auto => true,
        Transport::Custom(l) => {
            let named = |body: &str, x: &str| body.split(',').any(|n| n.trim() == x);
            match l.strip_prefix('^') {
                // An exclusion list leaves a FIFO in unless it takes out both.
                Some(ex) => {
                    !(named(ex, "sm")
                        || named(ex, "shm")
                        || (named(ex, "posix") && named(ex, "sysv")))
                }
                None => FIFO.iter().any(|x| named(l, x)),
            }
        }
    }
}

impl UcxConfig {
    /// Whether UCX's TCP transport is left out, lanes on or off: unless opted in. Besides
    /// authenticating nobody, its emulated RMA aborts the process that serves a READ (and,
    /// on UCX 1.13, a WRITE) when the peer's connection fails under it (UCX 1.13 and 1.22:
    /// `ucp_request.inl` "Fatal: unexpected error: Endpoint timeout";
    /// `tests/peer_death.rs`). The lanes carry what it would.
    pub(crate) fn tcp_off(&self) -> bool {
        !self.tcp
    }

    /// Peer-failure detection: as forced, else on except for shared memory (which no UCX
    /// transport that detects a dead peer serves) and where TCP, the one that does, is out.
    pub(crate) fn peer_failure(&self, asked: &Transport) -> bool {
        self.peer_failure
            .unwrap_or(*asked != Transport::Shm && !self.tcp_off())
    }

    /// The transports UCX may use: `asked` without TCP where [`UcxConfig::tcp_off`].
    pub(crate) fn transport(&self, asked: &Transport) -> Transport {
        if !self.tcp_off() {
            return asked.clone();
        }
        match asked {
            // Every byte takes the sealed lane; UCX keeps only its loopback to this process.
            Transport::Tcp => Transport::Custom("self".into()),
            Transport::Shm => Transport::Shm,
            Transport::Auto => Transport::Custom("^tcp".into()),
            Transport::Custom(l) => match l.strip_prefix('^') {
                Some(ex) if ex.split(',').any(|x| x.trim() == "tcp") => asked.clone(),
                Some(ex) => Transport::Custom(format!("^{ex},tcp")),
                None if l.split(',').any(|x| x.trim() == "all") => Transport::Custom("^tcp".into()),
                None => {
                    let kept: Vec<&str> = l
                        .split(',')
                        .map(str::trim)
                        .filter(|x| !x.is_empty() && *x != "tcp")
                        .collect();
                    Transport::Custom(if kept.is_empty() {
                        "self".into()
                    } else {
                        kept.join(",")
                    })
                }
            },
        }
    }

    /// Whether the transports UCX gets ([`UcxConfig::transport`]) include ones named
    /// `prefix*` (`tcp`, `cuda`).
    pub(crate) fn may_use(&self, asked: &Transport, prefix: &str) -> bool {
        match &self.transport(asked) {
            Transport::Auto => true,
            Transport::Tcp => prefix == "tcp",
            Transport::Shm => false,
            Transport::Custom(l) => match l.strip_prefix('^') {
                Some(excluded) => !excluded.split(',').any(|x| x.trim().starts_with(prefix)),
                None => l
                    .split(',')
                    .map(str::trim)
                    .any(|x| x.starts_with(prefix) || x == "all"),
            },
        }
    }

    /// The settings UCX gets, the user's own `UCX_*` variables in this process's environment
    /// winning over kvxfer's defaults.
    pub(crate) fn settings(&self, asked: &Transport) -> Vec<(String, String)> {
        self.settings_under(asked, |k| std::env::var_os(k).is_some())
    }

    /// The settings, given which `UCX_*` variables the environment sets.
    fn settings_under(
        &self,
        asked: &Transport,
        in_env: impl Fn(&str) -> bool,
    ) -> Vec<(String, String)> {
        let may_use = |p: &str| self.may_use(asked, p);
        let mut v = vec![("TLS".to_string(), self.transport(asked).ucx_tls())];
        // kvxfer registers its regions explicitly; UCX's registration cache only serves
        // implicit registrations, and its default limits are infinite (memory grows with
        // every buffer UCX ever saw). Bounded here; `AgentConfig::ucx` overrides.
        if ["rc", "ud", "dc", "ib"].iter().any(|t| may_use(t)) {
            // Only where IB transports may be used: UCX warns about settings no transport
            // of the context consumed.
            v.push(("?IB_RCACHE_MAX_SIZE".into(), "4G".into()));
            v.push(("?IB_RCACHE_MAX_REGIONS".into(), "65536".into()));
        }
        // NIXL's default: with the rendezvous threshold at "auto", UCX >= 1.15 (protocols v2)
        // emulates ucp_put over TCP with active messages; at "inf" it posts zero-copy puts
        // (UCX 1.22, KV-shaped WRITE over tcp/lo: 8,344 blocks 334-385 ms -> 133 ms, one region
        // 313-377 ms -> 90-102 ms). kvxfer's own notifications are small eager messages, so
        // nothing of kvxfer needs rendezvous. A user's own UCX_RNDV_THRESH wins.
        if !in_env("UCX_RNDV_THRESH") {
            v.push(("RNDV_THRESH".into(), "inf".into()));
        }
        // READ of device memory inside a host: UCX 1.22's cuda_ipc leaves get_zcopy off on
        // platforms it rates slower ("auto"), and ucp_get then falls back to software
        // emulation over its host transports. H200, UCX 1.22 wheel, 273 MB KV-shaped, random
        // blocks, same run: direct READ 709.7 ms with "auto", 69.5 ms with "y". Only where
        // UCX may use its CUDA transports; a user's own setting wins; "?": UCX builds without
        // the cuda module do not know it.
        if may_use("cuda") && !in_env("UCX_CUDA_IPC_ENABLE_GET_ZCOPY") {
            v.push(("?CUDA_IPC_ENABLE_GET_ZCOPY".into(), "y".into()));
        }
        // UCX's TCP transport sends at most TX_SEG_SIZE (8 KiB) per active-message fragment.
        // Every RMA over TCP that UCX emulates with active messages (all of them in UCX 1.13,
        // every GET in 1.22) was cut into 5 fragments per 32 KiB KV block; 64 KiB (its
        // receive segment's default) sends a block whole. KV-shaped 273 MB over tcp/lo,
        // alternated runs against UCX_TCP_TX_SEG_SIZE=8K: UCX 1.13 WRITE random 177-184 ->
        // 86-88 ms, READ random 158-181 -> 74-76 ms, WRITE one region 150-153 -> 89-124 ms
        // (its READ of one region turned bimodal: 57-61 or 180-197 ms per iteration, against
        // ~130 ms); UCX 1.22 READ random 153-156 -> 73-75 ms (its WRITE is zero-copy:
        // unchanged); peak RSS unchanged at concurrency 4.
        // Spelled "TX_SEG_SIZE" for UCX 1.13 (which applies its cached transport settings
        // without the "TCP_" prefix, and warns about the prefixed name as unused) and
        // "TCP_TX_SEG_SIZE" for 1.22 (which refuses the bare one).
        if may_use("tcp") && !in_env("UCX_TCP_TX_SEG_SIZE") {
            v.push(("TX_SEG_SIZE|TCP_TX_SEG_SIZE".into(), "64K".into()));
        }
        if let Some(d) = &self.net_devices {
            v.push(("NET_DEVICES".into(), d.clone()));
        }
        v.extend(self.extra.iter().cloned());
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shm_writes_are_emulated_before_1_22() {
        assert!(shm_writes_emulated("1.13.1"));
        assert!(shm_writes_emulated("1.21.0"));
        assert!(!shm_writes_emulated("1.22.0"));
        assert!(!shm_writes_emulated("1.22.1"));
        assert!(!shm_writes_emulated("2.0.0"));
        // What cannot be read is taken as the old behaviour.
        assert!(shm_writes_emulated("unknown"));
        assert!(shm_writes_emulated("1"));
    }

    #[test]
    fn which_transports_may_use_a_shared_memory_fifo() {
        for (t, shm) in [
            (Transport::Tcp, false),
            (Transport::Shm, true),
            (Transport::Auto, true),
            (Transport::Custom("rc,sm".into()), true),
            (Transport::Custom("posix,cma".into()), true),
            (Transport::Custom("all".into()), true),
            (Transport::Custom("rc,tcp".into()), false),
            (Transport::Custom("^tcp".into()), true),
            (Transport::Custom("^sm,tcp".into()), false),
            (Transport::Custom("^posix,sysv".into()), false),
            (Transport::Custom("^posix".into()), true),
            (Transport::Custom("cma,tcp".into()), false),
            (Transport::Custom("sysv".into()), true),
        ] {
            assert_eq!(may_use_shm_fifo(&t), shm, "{t:?}");
        }
    }

    /// kvxfer's value of the setting `key` for transports `t`, given which `UCX_*`
    /// variables are set.
    fn setting(
        c: &UcxConfig,
        t: Transport,
        key: &str,
        in_env: impl Fn(&str) -> bool,
    ) -> Option<String> {
        c.settings_under(&t, in_env)
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    fn opted(tcp: bool) -> UcxConfig {
        UcxConfig {
            tcp,
            ..UcxConfig::default()
        }
    }

    #[test]
    fn ucx_loses_its_tcp_transport_unless_opted_in() {
        let tls = |t: &Transport, ucx_tcp: bool| {
            opted(ucx_tcp)
                .settings_under(t, |_| false)
                .into_iter()
                .find(|(k, _)| k == "TLS")
                .map(|(_, v)| v)
                .unwrap()
        };
        let custom = |l: &str| Transport::Custom(l.into());
        for (t, want) in [
            (Transport::Tcp, "self"),
            (Transport::Auto, "^tcp"),
            (Transport::Shm, "sm"),
            (custom("rc,tcp"), "rc"),
            (custom("tcp"), "self"),
            (custom("^cuda_ipc"), "^cuda_ipc,tcp"),
            (custom("^tcp,cma"), "^tcp,cma"),
            (custom("all"), "^tcp"),
        ] {
            // Without the opt-in, lanes on or off (a secret changes nothing here): the lanes
            // carry what TCP would, or nothing does.
            assert_eq!(tls(&t, false), want, "{t:?}");
            // The opt-in: as asked.
            assert_eq!(tls(&t, true), t.ucx_tls(), "{t:?}");
        }
    }

    #[test]
    fn rendezvous_threshold_defaults_to_inf_unless_the_user_sets_it() {
        let c = UcxConfig::default();
        let none = |_: &str| false;
        assert_eq!(
            setting(&c, Transport::Tcp, "RNDV_THRESH", none).as_deref(),
            Some("inf")
        );
        assert_eq!(
            setting(&c, Transport::Tcp, "RNDV_THRESH", |k| k
                == "UCX_RNDV_THRESH"),
            None
        );
        // A user's own setting comes last, so it wins over the default too.
        let c = UcxConfig {
            extra: vec![("RNDV_THRESH".into(), "64k".into())],
            ..c
        };
        let v = c.settings_under(&Transport::Tcp, none);
        assert_eq!(
            v.last().map(|(k, v)| (k.as_str(), v.as_str())),
            Some(("RNDV_THRESH", "64k"))
        );
    }

    #[test]
    fn ib_registration_cache_is_bounded_where_ucx_may_use_ib() {
        let none = |_: &str| false;
        let c = UcxConfig::default();
        for t in [
            Transport::Auto,
            Transport::parse("rc,sm"),
            Transport::parse("^tcp"),
        ] {
            assert_eq!(
                setting(&c, t, "?IB_RCACHE_MAX_SIZE", none).as_deref(),
                Some("4G")
            );
        }
        for t in [Transport::Tcp, Transport::Shm, Transport::parse("tcp,sm")] {
            assert_eq!(setting(&c, t, "?IB_RCACHE_MAX_SIZE", none), None);
        }
    }

    #[test]
    fn cuda_ipc_get_is_on_where_ucx_may_use_cuda_unless_the_user_sets_it() {
        let c = UcxConfig::default();
        let key = "?CUDA_IPC_ENABLE_GET_ZCOPY";
        let none = |_: &str| false;
        for t in [Transport::Auto, Transport::parse("cuda_ipc,cuda_copy,tcp")] {
            assert_eq!(setting(&c, t.clone(), key, none).as_deref(), Some("y"));
            let set = |k: &str| k == "UCX_CUDA_IPC_ENABLE_GET_ZCOPY";
            assert_eq!(setting(&c, t, key, set), None);
        }
        for t in [Transport::Tcp, Transport::Shm, Transport::parse("rc,sm")] {
            assert_eq!(setting(&c, t, key, none), None);
        }
    }

    #[test]
    fn tcp_segments_hold_a_kv_block_where_ucx_may_use_tcp_unless_the_user_sets_it() {
        let key = "TX_SEG_SIZE|TCP_TX_SEG_SIZE";
        let none = |_: &str| false;
        for t in [
            Transport::Tcp,
            Transport::Auto,
            Transport::parse("tcp,sm"),
            Transport::parse("^rc"),
        ] {
            let c = opted(true);
            assert_eq!(setting(&c, t.clone(), key, none).as_deref(), Some("64K"));
            assert_eq!(setting(&c, t, key, |k| k == "UCX_TCP_TX_SEG_SIZE"), None);
        }
        for t in [
            Transport::Shm,
            Transport::parse("rc,sm"),
            Transport::parse("^tcp"),
        ] {
            assert_eq!(setting(&UcxConfig::default(), t, key, none), None);
        }
    }
}
