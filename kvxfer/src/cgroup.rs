//! The memory limit a deployment put on this process: its cgroup's (v2 `memory.max`, v1
//! `memory.limit_in_bytes`), read from `/proc/self/cgroup` and the cgroup file systems.
#![forbid(unsafe_code)]

/// v1 reports "no limit" as a page-rounded `i64::MAX`.
const V1_UNLIMITED: u64 = 1 << 62;

/// This process's cgroup memory limit in bytes; `None` when there is none (or no cgroup file
/// system to read it from).
pub fn memory_limit() -> Option<u64> {
    let cg = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    limit_from(&cg, |p| std::fs::read_to_string(p).ok())
}

/// The limit for the `/proc/self/cgroup` text `cg`, reading cgroup files with `read`.
fn limit_from(cg: &str, read: impl Fn(&str) -> Option<String>) -> Option<u64> {
    let mut v1 = None;
    let mut v2 = None;
    for line in cg.lines() {
        let mut f = line.splitn(3, ':');
        let (_, ctl, path) = (f.next()?, f.next()?, f.next()?);
        if ctl.is_empty() {
            v2 = Some(path.to_string());
        } else if ctl.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_string());
        }
    }
    if let Some(p) = v1 {
        let v = read(&format!("/sys/fs/cgroup/memory{p}/memory.limit_in_bytes"))?;
        return v.trim().parse::<u64>().ok().filter(|&l| l < V1_UNLIMITED);
    }
    let p = v2?;
    for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
        if let Some(v) = read(&format!("{root}{p}/memory.max")) {
            return v.trim().parse::<u64>().ok();
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_v2_and_no_limit() {
        let files =
            |want: &'static str, v: &'static str| move |p: &str| (p == want).then(|| v.to_string());
        let v1 = "12:memory:/kvx\n0::/user.slice\n";
        assert_eq!(
            limit_from(
                v1,
                files(
                    "/sys/fs/cgroup/memory/kvx/memory.limit_in_bytes",
                    "3758096384\n"
                )
            ),
            Some(3_758_096_384)
        );
        assert_eq!(
            limit_from(
                v1,
                files(
                    "/sys/fs/cgroup/memory/kvx/memory.limit_in_bytes",
                    "9223372036854771712"
                )
            ),
            None
        );
        let v2 = "0::/kvx\n";
        assert_eq!(
            limit_from(v2, files("/sys/fs/cgroup/kvx/memory.max", "1073741824")),
            Some(1 << 30)
        );
        assert_eq!(
            limit_from(v2, files("/sys/fs/cgroup/kvx/memory.max", "max")),
            None
        );
        assert_eq!(limit_from("", |_| None), None);
    }
}
