//! A namespace read in pages at one revision, so that no listing depends on what fits in one
//! response: four 1.2 MiB notes once made a namespace's single listing 4.9 MB, over the client's
//! 4 MiB limit, and every new watcher failed to join (and a broken watch retried the same
//! listing for good). Pages shrink when one does not fit, down to one key; a key whose value
//! alone does not fit is skipped, named in the log. Values over [`MAX_VALUE`] are refused
//! before anything opens or decodes them.

use etcd_client::{Client, GetOptions, KeyValue};

/// The largest value a watcher opens (an agent's metadata, a region update): etcd's own
/// default request limit is 1.5 MiB, and an agent's metadata with a thousand regions is about
/// 100 KiB.
pub(super) const MAX_VALUE: usize = 1 << 20;

/// Keys a page asks for at first.
const PAGE: i64 = 256;

/// The end of the range of every key that starts with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: to the end of the keyspace.
    vec![0]
}

fn too_large(e: &etcd_client::Error) -> bool {
    let t = e.to_string();
    t.contains("too large") || t.contains("OutOfRange") || t.contains("message length")
}

/// Every key under `prefix` with its value, read at revision `at` (0: the first page's), in
/// pages; returns them and that revision.
pub(super) async fn list(
    c: &mut Client,
    prefix: &str,
    at: i64,
) -> Result<(Vec<KeyValue>, i64), etcd_client::Error> {
    let end = prefix_end(prefix.as_bytes());
    let mut from = prefix.as_bytes().to_vec();
    let mut rev = at;
    let mut limit = PAGE;
    let mut out = Vec::new();
    loop {
        let mut opts = GetOptions::new().with_range(end.clone()).with_limit(limit);
        if rev != 0 {
            opts = opts.with_revision(rev);
        }
        let r = match c.get(from.clone(), Some(opts)).await {
            Ok(r) => r,
            Err(e) if too_large(&e) && limit > 1 => {
                limit = (limit / 4).max(1);
                continue;
            }
            Err(e) if too_large(&e) => {
                // One value alone is too large: learn its key, skip it.
                let mut o = GetOptions::new()
                    .with_range(end.clone())
                    .with_limit(1)
                    .with_keys_only();
                if rev != 0 {
                    o = o.with_revision(rev);
                }
                let k = c.get(from.clone(), Some(o)).await?;
                let Some(kv) = k.kvs().first() else {
                    return Err(e);
                };
                log::warn!(
                    "kvxfer: etcd key {} skipped: its value alone exceeds a response",
                    String::from_utf8_lossy(kv.key())
                );
                from = kv.key().to_vec();
                from.push(0);
                continue;
            }
            Err(e) => return Err(e),
        };
        if rev == 0 {
            rev = r.header().map_or(0, |h| h.revision());
        }
        let more = r.more();
        if let Some(last) = r.kvs().last() {
            from = last.key().to_vec();
            from.push(0);
        }
        out.extend(r.kvs().iter().cloned());
        if !more || r.kvs().is_empty() {
            return Ok((out, rev));
        }
        limit = (limit * 2).min(PAGE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_ends_after_its_last_key() {
        assert_eq!(prefix_end(b"/ns/agents/"), b"/ns/agents0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }
}
