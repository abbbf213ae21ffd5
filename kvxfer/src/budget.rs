//! A memory budget: every byte kvxfer allocates for its own bookkeeping and buffers (request
//! state, descriptor lists, stream-lane headers, staging) is charged to it. The limit is set
//! up front and readable at run time; a charge that does not fit waits for others to be
//! released (backpressure) up to a time-out, then fails with [`Error::OutOfMemory`]. A charge
//! larger than the whole limit fails at once. Memory never grows past the limit.
#![forbid(unsafe_code)]

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvxfer_proto::error::{Error, Result};

pub use crate::cgroup::memory_limit as cgroup_memory_limit;

#[derive(Debug, Default)]
struct State {
    used: u64,
    peak: u64,
    waits: u64,
}

#[derive(Debug)]
struct Inner {
    limit: u64,
    st: Mutex<State>,
    cv: Condvar,
}

/// A shared memory budget (cheap to clone: all clones share one limit).
#[derive(Clone, Debug)]
pub struct MemoryBudget {
    inner: Arc<Inner>,
}

impl Default for MemoryBudget {
    fn default() -> Self {
        MemoryBudget::unlimited()
    }
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> MemoryBudget {
        MemoryBudget {
            inner: Arc::new(Inner {
                limit,
                st: Mutex::new(State::default()),
                cv: Condvar::new(),
            }),
        }
    }

    /// No limit (charges are still counted).
    pub fn unlimited() -> MemoryBudget {
        MemoryBudget::new(u64::MAX)
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.inner.limit
    }

    /// Bytes charged now.
    pub fn used(&self) -> u64 {
        self.lock().used
    }

    /// The most bytes ever charged at once.
    pub fn peak(&self) -> u64 {
        self.lock().peak
    }

    /// Refuses, at start, a worker that cannot fit: its KV caches (`caches` bytes), plus this
    /// budget's limit (what kvxfer may allocate besides them), plus `reserve` for the rest of
    /// the process, against `limit` (e.g. [`cgroup_memory_limit`]). The error names every
    /// figure, so a deployment learns it before the OOM killer does.
    pub fn check_fits(&self, caches: u64, reserve: u64, limit: u64) -> Result<()> {
        let budget = self.limit();
        let need = caches.saturating_add(budget).saturating_add(reserve);
        if need > limit {
            let mib = |b: u64| {
                if b == u64::MAX {
                    "unlimited".to_string()
                } else {
                    format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
                }
            };
            return Err(Error::OutOfMemory(format!(
                "the KV caches ({}) + kvxfer's budget ({}) + the process's reserve ({}) need {} \
                 and the memory limit is {}: give the worker more memory, fewer KV blocks, or \
                 kvxfer a budget (AgentConfig::budget)",
                mib(caches),
                mib(budget),
                mib(reserve),
                mib(need),
                mib(limit)
            )));
        }
        Ok(())
    }

    /// Charges that had to wait for room.
    pub fn waits(&self) -> u64 {
        self.lock().waits
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Charges `bytes` for `what`, waiting up to `wait` for room.
    pub fn charge(&self, bytes: u64, what: &str, wait: Duration) -> Result<Charge> {
        if bytes > self.inner.limit {
            return Err(Error::OutOfMemory(format!(
                "{what} needs {bytes} bytes, more than the whole budget of {}",
                self.inner.limit
            )));
        }
        let end = Instant::now() + wait;
        let mut st = self.lock();
        let mut waited = false;
        while st.used + bytes > self.inner.limit {
            let now = Instant::now();
            if now >= end {
                return Err(Error::OutOfMemory(format!(
                    "{what} needs {bytes} bytes; {} of the {}-byte budget are in use and none \
                     came free within {wait:?}",
                    st.used, self.inner.limit
                )));
            }
            if !waited {
                st.waits += 1;
                waited = true;
            }
            st = self
                .inner
                .cv
                .wait_timeout(st, end - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        st.used += bytes;
        st.peak = st.peak.max(st.used);
        Ok(Charge {
            budget: self.clone(),
            bytes,
        })
    }

    /// Charges `bytes` only if they fit now.
    pub fn try_charge(&self, bytes: u64, what: &str) -> Result<Charge> {
        self.charge(bytes, what, Duration::ZERO)
    }
}

/// Bytes charged to a budget, released on drop.
#[derive(Debug)]
pub struct Charge {
    budget: MemoryBudget,
    bytes: u64,
}

impl Charge {
    /// The bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        let mut st = self.budget.lock();
        st.used -= self.bytes;
        drop(st);
        self.budget.inner.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caches_that_cannot_fit_are_refused_with_every_figure() {
        let gib = 1u64 << 30;
        let b = MemoryBudget::new(256 << 20);
        assert!(b
            .check_fits(2 * gib, 256 << 20, 3 * gib + (gib / 2))
            .is_ok());
        let e = b
            .check_fits(4 * gib, 256 << 20, 3 * gib + (gib / 2))
            .unwrap_err();
        let t = e.to_string();
        for f in ["4096 MiB", "256 MiB", "4608 MiB", "3584 MiB"] {
            assert!(t.contains(f), "{f}: {t}");
        }
        // An unlimited budget fits under no limit.
        assert!(MemoryBudget::unlimited().check_fits(1, 0, 3 * gib).is_err());
    }

    #[test]
    fn waits_for_room_then_completes_and_never_exceeds() {
        let b = MemoryBudget::new(100);
        let a = b.charge(60, "a", Duration::ZERO).unwrap();
        assert!(matches!(b.try_charge(50, "b"), Err(Error::OutOfMemory(_))));
        assert!(matches!(
            b.charge(101, "huge", Duration::from_secs(9)),
            Err(Error::OutOfMemory(_))
        ));
        let b2 = b.clone();
        let t = std::thread::spawn(move || {
            let c = b2.charge(50, "b", Duration::from_secs(10)).unwrap();
            c.bytes()
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(b.used(), 60);
        drop(a);
        assert_eq!(t.join().unwrap(), 50);
        assert_eq!(b.used(), 0);
        assert_eq!(b.peak(), 60);
        assert_eq!(b.waits(), 1, "the thread waited; try_charge did not");
    }

    #[test]
    fn many_threads_stay_within_the_limit() {
        let b = MemoryBudget::new(1000);
        let hs: Vec<_> = (0..16)
            .map(|i| {
                let b = b.clone();
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        let _c = b
                            .charge(100 + i * 10, "t", Duration::from_secs(30))
                            .unwrap();
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        assert!(b.peak() <= 1000, "{}", b.peak());
        assert_eq!(b.used(), 0);
    }
}
