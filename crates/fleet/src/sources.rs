//! Connections counted per client address: the admission the discovery API's servers and the gateway share, so no
//! one address (and, with a total, no crowd of addresses) takes every connection a server has before it has shown
//! a valid token.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// Why a connection was not admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// Its address has as many counted connections as one address may.
    PerSource,
    /// All addresses together have as many as they may.
    Total,
}

impl Refused {
    /// The reason as a metric label: `per-source` or `total`.
    pub fn label(self) -> &'static str {
        match self {
            Self::PerSource => "per-source",
            Self::Total => "total",
        }
    }
}

/// Counted connections, per source address and in all.
#[derive(Debug, Default)]
pub struct SourceCounts {
    counts: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    by_source: HashMap<IpAddr, usize>,
    total: usize,
}

impl SourceCounts {
    /// No connection counted yet.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Counts one more connection from `source`, unless that address has `per_source` already or all of them
    /// together have `total`. The count is given back when the slot is [released](SourceSlot::release) or dropped.
    ///
    /// # Errors
    /// Which cap the connection met.
    pub fn admit(self: &Arc<Self>, source: IpAddr, per_source: usize, total: usize) -> Result<SourceSlot, Refused> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if counts.total >= total {
            return Err(Refused::Total);
        }
        let count = counts.by_source.entry(source).or_default();
        if *count >= per_source {
            if *count == 0 {
                counts.by_source.remove(&source);
            }
            return Err(Refused::PerSource);
        }
        *count += 1;
        counts.total += 1;
        Ok(SourceSlot { counts: self.clone(), source, held: AtomicBool::new(true) })
    }

    /// Connections counted now, from `source` and in all.
    pub fn counted(&self, source: IpAddr) -> (usize, usize) {
        let counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        (counts.by_source.get(&source).copied().unwrap_or(0), counts.total)
    }
}

/// One connection's place in the counts, given back once: when it is released (the connection showed a valid
/// token) or dropped (it closed).
#[derive(Debug)]
pub struct SourceSlot {
    counts: Arc<SourceCounts>,
    source: IpAddr,
    held: AtomicBool,
}

impl SourceSlot {
    /// Gives the place back now (later calls, and the drop, do nothing).
    pub fn release(&self) {
        if self.held.swap(false, Ordering::AcqRel) {
            let mut counts = self.counts.counts.lock().unwrap_or_else(PoisonError::into_inner);
            counts.total -= 1;
            if let Some(count) = counts.by_source.get_mut(&self.source) {
                *count -= 1;
                if *count == 0 {
                    counts.by_source.remove(&self.source);
                }
            }
        }
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_address_and_all_of_them_have_a_cap_and_places_come_back_once() {
        let counts = SourceCounts::new();
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().expect("a"), "2001:db8::2".parse().expect("b"));
        let first = counts.admit(a, 2, 3).expect("first");
        let second = counts.admit(a, 2, 3).expect("second");
        assert_eq!(counts.admit(a, 2, 3).expect_err("a is full"), Refused::PerSource);
        let third = counts.admit(b, 2, 3).expect("b has room");
        assert_eq!(counts.admit(b, 2, 3).expect_err("all are full"), Refused::Total);
        assert_eq!(counts.counted(a), (2, 3));
        first.release();
        first.release();
        drop(first);
        assert_eq!(counts.counted(a), (1, 2), "released once, whatever is called after");
        drop((second, third));
        assert_eq!((counts.counted(a), counts.counted(b)), ((0, 0), (0, 0)));
        assert_eq!(counts.admit(a, 0, 3).expect_err("none allowed"), Refused::PerSource);
        assert!(counts.counts.lock().expect("lock").by_source.is_empty(), "a refused address leaves nothing behind");
    }
}
